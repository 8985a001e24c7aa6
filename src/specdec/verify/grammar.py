"""Constrained decoding: a request's grammar (JSON schema, JSON object, regex, Lark) as a mask on the target's logits.

The grammar engine is llguidance (`LLMatcher`). Measured by bench/grammar_bench.py on Qwen2.5's 151,936-token
vocabulary walking a 71-token JSON document of a 6-field schema (2 cores): llguidance 94 us per token mean,
287 us p99 (mask, its conversion to a bool tensor, and the token consumed); xgrammar 0.2.9 23 us mean, 69 us p99
(`fill_next_token_bitmask`). Both are under 1 % of a 0.5B target's forward on a CPU (tens of ms per token).
llguidance was chosen because it is a single wheel with no dependencies, whereas xgrammar requires torch,
transformers, triton and apache-tvm-ffi (pip would pull a CUDA triton and transformers into every install); it
also rolls tokens back natively and validates a draft prefix in one call (`validate_tokens`).

Under speculation (engine/engine.py):
  - a draft is cut at its first token the grammar forbids, and the tokens the grammar forces after its valid prefix
    (`forced_after`, e.g. the keys of a JSON schema) fill the cut part as free point-mass drafts
    (`GrammarMatcher.valid_prefix`); a draft with sampled
    draft probabilities under rejection acceptance keeps that token as its last: the target, masked, gives it
    probability 0, so rejection sampling rejects it and draws from the residual max(0, q - p), which keeps the
    output's distribution the masked target's (cutting it instead would not);
  - verify row i is masked with the state reached by the draft tokens 0 .. i-1 (`GrammarMatcher.masks_along`,
    which consumes the draft and rolls it back);
  - the committed state advances by the emitted tokens only, so rejected tokens never enter it.
Every row is masked elementwise with the same mask plain decoding computes at that position, so greedy and exact
sampled outputs equal plain constrained decoding's token for token.

End of sequence: the grammar's end is allowed as every end-of-sequence token and stop_token_ids; those tokens are
never consumed by the matcher (the sequence ends on them).

The llguidance view of a tokenizer is built once per (tokenizer, vocabulary size) and cached (`ll_tokenizer`); the
server builds it in a thread when it starts (`start_warm_up`), so the first constrained request does not wait for it.
"""
from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence

import llguidance
import numpy as np
import torch

from specdec.config import GuidedDecoding
from specdec.models.tokenizer import Tokenizer

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {vocab size: LLTokenizer}
# held while a view is looked up or built: a request arriving during the server's warm-up waits for that build
# instead of starting a second one
_LL_TOKENIZERS_LOCK = threading.Lock()


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of a constraint."""
    if guided.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(guided.json_schema)
    if guided.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    if guided.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(guided.regex)
    return llguidance.grammar_from("lark", guided.lark)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance view of a tokenizer over at least vocab_size ids (the model's logits width; more when the
    tokenizer has more tokens than the model has rows); built once per (tokenizer, size) and cached while the
    tokenizer lives (1.5 to 4 s for Qwen2.5's 151,936 tokens on 2 cores, holding Python's GIL throughout)."""
    with _LL_TOKENIZERS_LOCK:
        per_size = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
            n_vocab = max(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
            per_size[vocab_size] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return per_size[vocab_size]


def has_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> bool:
    """Whether the llguidance view of (tokenizer, vocab_size) is built and cached."""
    with _LL_TOKENIZERS_LOCK:
        return vocab_size in _LL_TOKENIZERS.get(tokenizer, {})


def warm_up(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Builds the tokenizer view and compiles one JSON grammar, so that the first constrained request pays neither."""
    GrammarMatcher(GuidedDecoding(json_object=True), tokenizer, vocab_size, tokenizer.eos_token_ids).allowed()


def start_warm_up(tokenizer: Tokenizer, vocab_size: int) -> threading.Thread:
    """warm_up in a daemon thread, started; returns it (join it to wait). The caller goes on at once, but the build
    holds the GIL, so other Python threads of the process run little until it ends."""
    thread = threading.Thread(target=warm_up, args=(tokenizer, vocab_size), name="specdec-grammar-warm-up",
                              daemon=True)
    thread.start()
    return thread


def _timed(method: Callable) -> Callable:
    """Adds the method's wall time to the matcher's grammar_time_s, once for the outermost of nested calls."""
    @functools.wraps(method)
    def timed(self: GrammarMatcher, *args, **kwargs):
        if self._timing:
            return method(self, *args, **kwargs)
        self._timing = True
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.grammar_time_s += time.perf_counter() - start
            self._timing = False

    return timed


class GrammarMatcher:
    """One request's grammar state: the allowed-token mask, advancing by emitted tokens, trying drafts.

    end_token_ids: the tokens that end the sequence (end-of-sequence and stop_token_ids): allowed exactly where the
    grammar may end, never consumed.
    mask_time_s / masks_computed: time spent computing masks and how many (for benchmarks: mask time per token).
    grammar_time_s: time spent in the matcher's methods after construction: the masks, and consuming emitted
        tokens, validating drafts and finding forced tokens (mask_time_s is part of it).
    """

    def __init__(self, guided: GuidedDecoding, tokenizer: Tokenizer, vocab_size: int,
                 end_token_ids: Collection[int]) -> None:
        lltok = ll_tokenizer(tokenizer, vocab_size)
        grammar = grammar_text(guided)
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(f"invalid {guided.kind} constraint: {error}")
        self._matcher = llguidance.LLMatcher(lltok, grammar)
        if self._matcher.is_error():
            raise ValueError(f"invalid {guided.kind} constraint: {self._matcher.get_error()}")
        self.vocab_size = vocab_size
        self._ll_eos = lltok.eos_token
        self.end_token_ids = frozenset(end_token_ids)
        self._end_ids = torch.tensor(sorted(t for t in self.end_token_ids if t < vocab_size), dtype=torch.long)
        self.mask_time_s = 0.0
        self.masks_computed = 0
        self.grammar_time_s = 0.0
        self._timing = False  # inside a timed method (nested calls are counted once)

    # ---- the committed state -------------------------------------------------------------------------
    @_timed
    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (the end tokens when it may end)."""
        start = time.perf_counter()
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")
        mask = torch.from_numpy(bits[: self.vocab_size].astype(bool))
        # the grammar may end here, or it errored (nothing allowed): ending is left
        if bits[self._ll_eos] or not packed.any():
            mask[self._end_ids] = True
        self.mask_time_s += time.perf_counter() - start
        self.masks_computed += 1
        return mask

    @_timed
    def advance(self, token_id: int) -> bool:
        """Consumes an emitted token; False when the grammar forbids it (the state is then unchanged)."""
        if token_id in self.end_token_ids:
            return True
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """Whether the grammar has ended (only an end token is allowed next)."""
        return self._matcher.is_stopped()

    @_timed
    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model says (empty when it allows a choice)."""
        return list(self._matcher.compute_ff_tokens())

    # ---- drafts ------------------------------------------------------------------------------------------
    @_timed
    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a draft the grammar allows (an allowed end token counts, and ends the draft)."""
        end_at = next((i for i, token_id in enumerate(token_ids) if token_id in self.end_token_ids), len(token_ids))
        valid = self._matcher.validate_tokens(list(token_ids[:end_at])) if end_at else 0
        if valid < end_at or end_at == len(token_ids):
            return valid
        return end_at + 1 if self._ends_after(token_ids[:end_at]) else end_at

    @_timed
    def forced_after(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """Up to limit tokens the grammar forces after a valid draft prefix (no end token in it): free drafts.

        They are the canonical tokenization of the bytes the grammar forces; the mask may still allow another
        tokenization, so they are drafts like any other (point masses), not emitted tokens."""
        if limit <= 0:
            return []
        consumed = self._consume(token_ids)
        forced = list(self._matcher.compute_ff_tokens())[:limit]
        if consumed:
            self._matcher.rollback(consumed)
        return [token_id for token_id in forced if token_id < self.vocab_size]

    def _ends_after(self, token_ids: Sequence[int]) -> bool:
        consumed = self._consume(token_ids)
        mask = self.allowed()
        if consumed:
            self._matcher.rollback(consumed)
        return bool(mask[self._end_ids].any()) if len(self._end_ids) else False

    @_timed
    def masks_along(self, token_ids: Sequence[int], rows: int) -> torch.Tensor:
        """[rows, vocab] bool: row i is the mask after draft tokens 0 .. i-1 (rows <= len(token_ids) + 1).

        Only the grammar-valid prefix of token_ids is consumed; rows past it (after a forbidden or an end token,
        never emitted from) repeat the last valid row's mask. The committed state is restored."""
        masks = [self.allowed()]
        consumed = 0
        for token_id in token_ids[: rows - 1]:
            if not self._consume_if_valid(token_id):
                break
            consumed += 1
            masks.append(self.allowed())
        if consumed:
            self._matcher.rollback(consumed)
        masks += [masks[-1]] * (rows - len(masks))
        return torch.stack(masks)

    def allowed_after(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[vocab] bool: the mask after the committed tokens and then token_ids, for a drafter that drafts within the
        grammar; nothing allowed when token_ids hold an end token or a token the grammar forbids (the engine cuts
        the draft there anyway). The committed state is restored."""
        consumed = 0
        try:
            for token_id in token_ids:
                if not self._consume_if_valid(token_id):
                    return torch.zeros(self.vocab_size, dtype=torch.bool)
                consumed += 1
            return self.allowed()
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def _consume_if_valid(self, token_id: int) -> bool:
        """Consumes token_id when the grammar allows it and it is no end token (a draft continues past neither)."""
        if token_id in self.end_token_ids or self._matcher.validate_tokens([token_id]) != 1:
            return False
        self._matcher.consume_token(token_id)
        return True

    def _consume(self, token_ids: Sequence[int]) -> int:
        for token_id in token_ids:
            self._matcher.consume_token(token_id)
        return len(token_ids)


def mask_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], masks [rows, vocab] bool -> logits with the forbidden tokens at -inf (fp32)."""
    return logits.float().masked_fill(~masks.to(logits.device), float("-inf"))
