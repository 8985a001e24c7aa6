"""Draft-model drafter: a smaller model with the same tokenizer proposes k tokens autoregressively.

It keeps its own KV cache (one slot per request). `cached_token_ids` records which tokens have valid
entries in that cache; after the target verifies, the longest prefix that still agrees with the committed
sequence stays valid (rollback = truncating that list), and the next proposal first feeds the tokens the
draft model has not seen yet — the recovered/bonus token, and after a fully accepted draft also the last
draft token (catch-up), all in the same batched forward.

With num_branches = b > 1 a greedy request drafts EAGLE-2's dynamic tree (drafters.tree_growth): at every depth the
draft model expands the chain's node and the b - 1 other nodes whose paths it finds likeliest, one row each in
the same forward (the chain in place in the draft cache, the others at scratch positions attending their own
paths, so each row is its path decoded alone), and each adds its b most likely next tokens. The chain is exactly
the chain draft; the other nodes follow it likeliest first, their path probability their acceptance probability, and
the engine keeps those that pay for their verify rows. Sampled requests draft chains: each draft token is drawn with the
request's
draft number of its output index (verify/noise.py), plain decoding's own under exact acceptance.

With draft_token_ids (`draft_vocab_size`), the draft model computes only those rows of its output layer (the
first ids of a byte-level BPE vocabulary are its most frequent merges, plus the end-of-sequence tokens) and
drafts among them: Qwen2.5-0.5B's tied output layer is 136 M of its 494 M weights, read by every draft forward.

A request's first draft prefills its prompt in the draft model. With `prefix_cache_tokens` > 0 the draft
cache entries of earlier requests' prompts are kept (`PrefixCache`), and a new request copies the longest
shared prefix (a chat template's system turn, a repeated document) instead of recomputing it; the copied
entries are bitwise those a prefill would write, so drafts do not change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache
from specdec.cache.prefix_store import PrefixCache, common_prefix_length
from specdec.config import SamplingParams
from specdec.drafters.base import AllowedAfter, Draft, Drafter, DrafterCostDescription
from specdec.drafters.tree_growth import depth_batches, new_growth
from specdec.drafters.tree import check_tree_args
from specdec.models.batch import ForwardBatch
from specdec.models.layers import Linear
from specdec.models.transformer import Transformer
from specdec.verify.noise import RequestNoise
from specdec.verify.sampling import greedy_tokens, logits_to_probs, sample_one

STEADY_FEED = 2  # tokens a request drafting every step feeds at most before its draft: bonus + last draft token


@dataclass
class _DraftState:
    slot: int
    params: SamplingParams
    noise: RequestNoise | None  # a sampled request's random numbers (None: greedy)
    token_ids: list[int]  # committed sequence (prompt + output)
    prompt_length: int
    cached_token_ids: list[int] = field(default_factory=list)  # tokens with valid draft-cache entries, by position
    prefix_saved: bool = False  # its prompt's draft-cache entries went to the prefix store
    # the prefix store's match for token_ids while nothing is cached: (store version, len(token_ids), match length)
    prefix_match: tuple[int, int, int] | None = None
    allowed_after: AllowedAfter | None = None  # a constrained request's grammar: draft prefix -> [vocab] bool
    drafted: list[int] = field(default_factory=list)  # the chain drafted so far in the current proposal


class DraftModelDrafter(Drafter):
    def __init__(self, model: Transformer, max_num_seqs: int, max_model_len: int, num_branches: int = 1,
                 min_branch_prob: float = 0.05, prefix_cache_tokens: int = 4096,
                 draft_token_ids: Sequence[int] | None = None) -> None:
        """draft_token_ids: the tokens the draft model may propose (a reduced draft vocabulary: only these rows of
        its output layer are computed); None = all."""
        check_tree_args(num_branches, min_branch_prob)
        self.model = model
        self.draft_token_ids: torch.Tensor | None = None  # [draft vocab] int64, ascending
        self.draft_head: Linear | None = None  # the output layer's rows of draft_token_ids
        if draft_token_ids is not None:
            ids = sorted(set(int(token_id) for token_id in draft_token_ids))
            if not ids or ids[0] < 0 or ids[-1] >= model.config.vocab_size:
                raise ValueError(f"draft token ids must be a non-empty set of ids in [0, {model.config.vocab_size}), "
                                 f"got {len(ids)} ids from {ids[:1]} to {ids[-1:]}")
            self.draft_token_ids = torch.tensor(ids, dtype=torch.long, device=model.device)
            self.draft_head = model.lm_head.rows(self.draft_token_ids)
        self.num_branches = num_branches
        self.min_branch_prob = min_branch_prob
        self.cache = KVCache(model.config, max_num_seqs, max_model_len, model.device, dtype=model.kv_cache_dtype)
        self.prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.states: dict[str, _DraftState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    noise: RequestNoise | None) -> None:
        self.states[request_id] = _DraftState(self.cache.allocate(), params, noise, list(prompt_token_ids),
                                              len(prompt_token_ids))

    def constrain(self, request_id: str, allowed_after: AllowedAfter) -> None:
        """Drafts for the request are chains drawn from the draft model's logits masked by the constraint."""
        self.states[request_id].allowed_after = allowed_after

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self.states[request_id]
        state.token_ids.extend(token_ids)
        valid = common_prefix_length(state.cached_token_ids, state.token_ids)
        # keep at least the last committed token uncached: the next proposal needs its logits
        del state.cached_token_ids[min(valid, len(state.token_ids) - 1):]

    def remove_request(self, request_id: str) -> None:
        self.cache.free(self.states.pop(request_id).slot)

    def catch_up_tokens(self, request_id: str) -> int:
        """Tokens the next draft's first forward feeds beyond a steady step's two (the bonus token and the last
        draft token after a fully accepted draft): the prompt, less a stored prefix, at a request's first draft;
        every token since at a draft after k = 0."""
        state = self.states[request_id]
        cached = len(state.cached_token_ids)
        if not cached and self.prefixes is not None:
            cached = self._prefix_match(state)
        return max(0, len(state.token_ids) - cached - STEADY_FEED)

    def _prefix_match(self, state: _DraftState) -> int:
        """`PrefixCache.match_length` of the request's tokens, looked up again only when it can have changed: the
        store changed, or the last match reached the end of the tokens then (more tokens may match further) or
        was looked up below the store's minimum match. A request that never drafts is asked every step."""
        store = self.prefixes.store
        if state.prefix_match is not None:
            version, length, match = state.prefix_match
            if version == store.version and match < length - 1 and length - 1 >= store.min_match:
                return match
        match = self.prefixes.match_length(state.token_ids)
        state.prefix_match = (store.version, len(state.token_ids), match)
        return match

    @property
    def weight_nbytes(self) -> int:
        """Weight bytes one draft forward reads (the output layer's draft rows only, with a reduced vocabulary)."""
        if self.draft_head is None:
            return self.model.weight_nbytes
        return self.model.weight_nbytes - self.model.lm_head.nbytes() + self.draft_head.nbytes()

    def cost_description(self) -> DrafterCostDescription:
        """One draft model forward per draft position, reading `weight_nbytes`."""
        return DrafterCostDescription(forward_weight_nbytes=self.weight_nbytes, forward_per_draft_token=True)

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The draft forward: logits [logit rows, vocab]; with a reduced vocabulary -inf outside it (so argmax,
        softmax, top-k and top-p see only the draft tokens; their order, and so the argmax's ties, is kept)."""
        if self.draft_head is None:
            return self.model.forward(batch, self.cache)
        reduced = self.model.logits(
            self.model.forward_normed(batch, self.cache), self.draft_head
        )  # [rows, draft vocab]
        logits = reduced.new_full((reduced.shape[0], self.model.config.vocab_size), float("-inf"))  # [rows, vocab]
        logits[:, self.draft_token_ids] = reduced
        return logits

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        states = [self.states[request_id] for request_id in request_ids]
        for state in states:
            state.drafted = []
        growths = [new_growth(len(state.token_ids), budget, state.params.greedy,
                              lambda logits, depth, state=state: self._draft_token(state, logits, depth),
                              1 if state.allowed_after is not None else self.num_branches, self.min_branch_prob,
                              self.cache.max_len)
                   for state, budget in zip(states, max_draft_tokens)]
        # Depth 0 feeds every token the draft cache lacks; later depths feed each draft's newest rows.
        active = [i for i, budget in enumerate(max_draft_tokens) if budget > 0]
        if active:
            for i in active:
                self._reuse_prefix(states[i])
            pending = [states[i].token_ids[len(states[i].cached_token_ids):] for i in active]
            logits = self._forward([states[i] for i in active], pending)  # [active, vocab]
            for row, i in enumerate(active):
                self._save_prefix(states[i])
                growths[i].first(logits[row : row + 1])
        for fed, batch in depth_batches(growths, active, [state.slot for state in states], self.model.device):
            logits = self._logits(batch)  # [rows, vocab]
            for (i, rows), seq_logits in zip(fed.items(), batch.split_logits(logits)):
                states[i].cached_token_ids.append(rows.token_ids[0])  # the first row sits in place (the chain's)
                growths[i].add(seq_logits)
        return [growth.draft() for growth in growths]

    @property
    def reused_prefix_tokens(self) -> int:
        """Draft-cache positions copied from the prefix store instead of computed."""
        return self.prefixes.hit_tokens if self.prefixes is not None else 0

    def _reuse_prefix(self, state: _DraftState) -> None:
        """Before a request's first draft forward: copy the longest stored prefix of its committed tokens (all but
        the last, whose logits the draft needs) into its slot."""
        if self.prefixes is None or state.cached_token_ids:
            return
        length = self.prefixes.reuse(self.cache, state.slot, state.token_ids)
        if length:
            state.cached_token_ids = list(state.token_ids[:length])

    def _save_prefix(self, state: _DraftState) -> None:
        """After a request's first draft forward its slot holds every committed token: keep them for later requests."""
        if self.prefixes is not None and not state.prefix_saved:
            self.prefixes.keep(self.cache, state.slot, state.cached_token_ids)
            state.prefix_saved = True

    def _forward(self, states: list[_DraftState], new_tokens: list[list[int]]) -> torch.Tensor:
        batch = ForwardBatch.build(
            new_tokens,
            [len(state.cached_token_ids) for state in states],
            [state.slot for state in states],
            all_logits=False,
            device=self.model.device,
        )
        logits = self._logits(batch)  # [len(states), vocab]
        for state, tokens in zip(states, new_tokens):
            state.cached_token_ids.extend(tokens)
        return logits

    def _draft_token(self, state: _DraftState, logits: torch.Tensor, depth: int) -> tuple[int, torch.Tensor | None]:
        """logits [1, vocab] at `depth` of the chain -> (draft token, its draft distribution [1, vocab] or None for
        greedy). A sampled draft is the inverse cumulative distribution of the draft's processed probabilities at
        the request's draft number of its output index: under exact acceptance plain decoding's u_t, so that the
        draft lands on the target's draw whenever the two distributions agree around u_t. A constrained request's
        logits are masked with the tokens its grammar allows after the chain so far (none allowed: left as they are,
        and the engine cuts the draft there)."""
        if state.allowed_after is not None:
            logits = self._within_constraint(state, logits)
        if state.params.greedy:
            token_id, probs = int(greedy_tokens(logits)[0]), None
        else:
            probs = logits_to_probs(logits, state.params)  # [1, vocab]
            output_index = len(state.token_ids) - state.prompt_length + depth
            token_id = sample_one(probs, state.noise.draft(output_index))
        state.drafted.append(token_id)
        return token_id, probs

    @staticmethod
    def _within_constraint(state: _DraftState, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, vocab] with the tokens the constraint forbids after state.drafted at -inf (unchanged when
        that leaves nothing: the engine then cuts the draft at this token)."""
        allowed = state.allowed_after(state.drafted).to(logits.device)  # [target vocab] bool
        width = logits.shape[-1]
        if allowed.shape[0] < width:  # rows of the draft model's embedding beyond the target's vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        masked = logits.float().masked_fill(~allowed[:width], float("-inf"))  # [1, vocab]
        return masked if bool(torch.isfinite(masked).any()) else logits

