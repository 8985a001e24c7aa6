"""Per-request state: tokens, cache bookkeeping, stop conditions, streamed text and metrics (no tensors)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.config import SamplingParams
from specdec.engine.metrics import SpecDecodeMetrics
from specdec.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.verify.noise import RequestNoise

if TYPE_CHECKING:
    from specdec.verify.grammar import GrammarMatcher


class TokenKind(str, enum.Enum):
    """How an emitted token came about (shown by `--show-drafts` and the playground)."""

    TARGET = "target"  # sampled by the target alone (prefill or plain decode step)
    ACCEPTED = "accepted"  # a draft token the target accepted
    RECOVERED = "recovered"  # the target's own token at the first rejected draft position
    BONUS = "bonus"  # the target's extra token after a fully accepted draft


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    noise: RequestNoise | None  # a sampled request's random numbers by output index; None for greedy requests
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    max_model_len: int
    speculative: bool = True
    slot: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    token_kinds: list[TokenKind] = field(default_factory=list)
    text: str = ""
    num_cached: int = 0  # positions whose keys/values are valid in the cache
    cached_prompt_tokens: int = 0  # prompt positions copied from the prefix cache instead of prefilled
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stopped_by_string: bool = False
    streamed_chars: int = 0  # characters of `text` already handed out
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    grammar: GrammarMatcher | None = (
        None  # the output's constraint state after the committed tokens (verify/grammar.py)
    )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    @property
    def prefilling(self) -> bool:
        """Admitted, but the prompt is not yet fully in the cache."""
        return self.slot >= 0 and self.num_cached < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    def max_draft_tokens(self, num_speculative_tokens: int) -> int:
        """Longest useful draft: within max_tokens and within the context (draft rows need cache positions)."""
        room_in_context = self.max_model_len - 1 - self.num_cached - 1
        return max(0, min(num_speculative_tokens, self.remaining_tokens - 1, room_in_context))

    def append(self, token_id: int, kind: TokenKind) -> str:
        """Adds one generated token, applies the stop rules and returns the newly streamable text."""
        self.output_token_ids.append(token_id)
        self.token_kinds.append(kind)
        if self.grammar is not None and not self.grammar.advance(token_id):
            raise RuntimeError(f"token {token_id} emitted against the request's grammar")
        is_eos = (
            token_id in self.eos_token_ids and not self.params.ignore_eos
        ) or token_id in self.params.stop_token_ids
        if not is_eos:
            self._add_text(self.detokenizer.push(token_id))
        if self.finish_reason is None:
            if is_eos:
                self.finish_reason = "stop"
            elif self.remaining_tokens <= 0 or len(self.all_token_ids) >= self.max_model_len:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                self._add_text(self.detokenizer.flush())
        return self._take_streamable()

    def _add_text(self, piece: str) -> None:
        """Appends decoded text unless a stop string already ended it; cuts the text at a stop string."""
        if not piece or self.stopped_by_string:
            return
        before = len(self.text)
        self.text += piece
        if len(self.output_token_ids) < self.params.min_tokens:  # stop strings count from min_tokens on (vLLM)
            return
        hits = [at for stop in self.params.stop if (at := self.text.find(stop, max(0, before - len(stop) + 1))) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped_by_string = True
            self.finish_reason = "stop"

    def _take_streamable(self) -> str:
        """Text not streamed yet; holds back a tail that could still become a stop string."""
        holdback = 0 if self.finished or not self.params.stop else max(map(len, self.params.stop)) - 1
        end = max(self.streamed_chars, len(self.text) - holdback)
        new_text = self.text[self.streamed_chars : end]
        self.streamed_chars = end
        return new_text


def new_sequence(request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 max_model_len: int, noise: RequestNoise | None, speculative: bool) -> Sequence:
    if not prompt_token_ids:
        raise ValueError("the prompt is empty (no tokens)")
    if len(prompt_token_ids) + 1 > max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens but the context is {max_model_len} tokens "
            f"(max_model_len); at least one token must remain for generation"
        )
    vocab_size = tokenizer.vocab_size  # one lookup: the backend rebuilds its vocabulary per call (0.24 ms for Gemma's)
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t in params.token_ids_in_params() if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias / stop_token_ids name token ids out of range [0, {vocab_size}): {bad[:5]}")
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        noise=noise,
        detokenizer=IncrementalDetokenizer(tokenizer),
        eos_token_ids=tokenizer.eos_token_ids,
        max_model_len=max_model_len,
        speculative=speculative,
    )
