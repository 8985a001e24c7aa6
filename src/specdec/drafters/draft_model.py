"""Draft-model drafter: a smaller model with the same tokenizer proposes k tokens autoregressively.

It keeps its own KV cache (one slot per request). `cached_token_ids` records which tokens have valid
entries in that cache; after the target verifies, the longest prefix that still agrees with the committed
sequence stays valid (rollback = truncating that list), and the next proposal first feeds the tokens the
draft model has not seen yet — the recovered/bonus token, and after a fully accepted draft also the last
draft token (catch-up), all in the same batched forward.

With num_branches = b > 1, a greedy request drafts a token tree grown where the draft model is unsure
(EAGLE-2's idea, decided online): branch 0 is the argmax chain, exactly the chain draft; at every depth each
live branch offers its runner-up token as a fork, worth the draft probability of the path up to it, and the
best offers whose worth reaches `min_branch_prob` become new branches while fewer than b exist. Every branch
then continues greedily; all are advanced together, one row each, in every later forward. Branch 0 sits in
place in the draft cache; branch j > 0 writes its nodes at scratch positions base + j * k + depth and attends
the committed prefix, the in-place nodes of branch 0 it shares, the scratch nodes it shares with the branch it
forked from, and its own, so its tokens are those of the same path decoded alone. Sampled requests draft
chains.

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
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.tree import check_tree_args
from specdec.engine.batch import ForwardBatch
from specdec.models.layers import Linear
from specdec.models.transformer import Transformer
from specdec.verify.sampling import greedy_tokens, logits_to_probs, sample


@dataclass
class _DraftState:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # committed sequence (prompt + output)
    cached_token_ids: list[int] = field(default_factory=list)  # tokens with valid draft-cache entries, by position
    prefix_saved: bool = False  # its prompt's draft-cache entries went to the prefix store


@dataclass
class _Branch:
    """One branch of a greedy draft tree while it is drafted."""

    token_ids: list[int]  # its draft tokens from depth 0 (the prefix it shares with its parent included)
    path_prob: float = 1.0  # draft probability of its tokens so far (product over depths)
    shared_depth: int = 0  # leading nodes it shares with branch 0 (in place in the draft cache); unused for branch 0
    scratch_positions: list[int] = field(default_factory=list)  # draft-cache positions of its fed scratch nodes


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
                    generator: torch.Generator | None) -> None:
        self.states[request_id] = _DraftState(self.cache.allocate(), params, generator, list(prompt_token_ids))

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self.states[request_id]
        state.token_ids.extend(token_ids)
        valid = common_prefix_length(state.cached_token_ids, state.token_ids)
        # keep at least the last committed token uncached: the next proposal needs its logits
        del state.cached_token_ids[min(valid, len(state.token_ids) - 1):]

    def remove_request(self, request_id: str) -> None:
        self.cache.free(self.states.pop(request_id).slot)

    @property
    def weight_nbytes(self) -> int:
        """Weight bytes one draft forward reads (the output layer's draft rows only, with a reduced vocabulary)."""
        if self.draft_head is None:
            return self.model.weight_nbytes
        return self.model.weight_nbytes - self.model.lm_head.nbytes() + self.draft_head.nbytes()

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The draft forward: logits [logit rows, vocab]; with a reduced vocabulary -inf outside it (so argmax,
        softmax, top-k and top-p see only the draft tokens; their order, and so the argmax's ties, is kept)."""
        if self.draft_head is None:
            return self.model.forward(batch, self.cache)
        reduced = self.model.logits(self.model.forward_normed(batch, self.cache), self.draft_head)  # [rows, draft vocab]
        logits = reduced.new_full((reduced.shape[0], self.model.config.vocab_size), float("-inf"))  # [rows, vocab]
        logits[:, self.draft_token_ids] = reduced
        return logits

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        states = [self.states[request_id] for request_id in request_ids]
        branches: list[list[_Branch]] = [[_Branch([])] for _ in states]  # per request; branch 0 = the chain
        draft_probs: list[list[torch.Tensor]] = [[] for _ in states]
        # Step 0 feeds every token the draft cache lacks; later steps feed each branch's last token.
        active = [i for i, budget in enumerate(max_draft_tokens) if budget > 0]
        if active:
            for i in active:
                self._reuse_prefix(states[i])
            pending = [states[i].token_ids[len(states[i].cached_token_ids):] for i in active]
            logits = self._forward([states[i] for i in active], pending)  # [active, vocab]
            for i in active:
                self._save_prefix(states[i])
            for row, i in enumerate(active):
                self._next_tokens(states[i], branches[i], logits[row : row + 1], max_draft_tokens[i], draft_probs[i])
            active = [i for i in active if len(branches[i][0].token_ids) < max_draft_tokens[i]]
        while active:
            logits_per_seq = self._forward_branches([states[i] for i in active], [branches[i] for i in active],
                                                    [max_draft_tokens[i] for i in active])  # each [branches, vocab]
            for i, logits in zip(active, logits_per_seq):
                self._next_tokens(states[i], branches[i], logits, max_draft_tokens[i], draft_probs[i])
            active = [i for i in active if len(branches[i][0].token_ids) < max_draft_tokens[i]]
        return [self._draft(request_branches, probs) for request_branches, probs in zip(branches, draft_probs)]

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

    def _num_branches(self, state: _DraftState, max_tokens: int) -> int:
        """Branches of a greedy request's tree, as many as fit in the draft cache's scratch positions."""
        if not state.params.greedy:
            return 1
        room = (self.cache.max_len - len(state.token_ids)) // max_tokens
        return max(1, min(self.num_branches, room))

    def _next_tokens(self, state: _DraftState, branches: list[_Branch], logits: torch.Tensor, max_tokens: int,
                     draft_probs: list[torch.Tensor]) -> None:
        """logits [branches, vocab]: every branch's next token; for a tree, also the forks worth taking."""
        max_branches = self._num_branches(state, max_tokens)
        if max_branches == 1:
            token_id, probs = self._draft_token(state, logits)
            branches[0].token_ids.append(token_id)
            if probs is not None:
                draft_probs.append(probs)
            return
        probs = torch.softmax(logits.float(), dim=-1)  # [branches, vocab]
        best = greedy_tokens(logits).tolist()  # the chain's choice (ties: the first index)
        top2_probs, top2_ids = probs.topk(2, dim=-1)  # each [branches, 2]
        offers = []  # (worth, branch index, runner-up token)
        for index, (branch, best_id) in enumerate(zip(branches, best)):
            ids, values = top2_ids[index].tolist(), top2_probs[index].tolist()
            runner_up = 1 if ids[0] == best_id else 0
            offers.append((branch.path_prob * values[runner_up], index, ids[runner_up]))
            branch.path_prob *= float(probs[index, best_id])
        depth = len(branches[0].token_ids)
        forks = []
        for worth, index, token_id in sorted(offers, key=lambda offer: -offer[0]):
            if len(branches) + len(forks) >= max_branches or worth < self.min_branch_prob:
                break
            parent = branches[index]
            forks.append(_Branch(parent.token_ids[:depth] + [token_id], worth,
                                 depth if index == 0 else parent.shared_depth, list(parent.scratch_positions)))
        for branch, best_id in zip(branches, best):
            branch.token_ids.append(best_id)
        branches.extend(forks)

    @staticmethod
    def _draft(branches: list[_Branch], draft_probs: list[torch.Tensor]) -> Draft:
        if len(branches) == 1:
            return Draft(tuple(branches[0].token_ids), torch.cat(draft_probs) if draft_probs else None)
        return Draft.from_branches([branch.token_ids for branch in branches])

    def _forward_branches(self, states: list[_DraftState], branches: list[list[_Branch]],
                          max_tokens: list[int]) -> list[torch.Tensor]:
        """Feeds every branch's last token (one row per branch); returns per request [branches, vocab]."""
        rows = [_branch_rows(len(state.token_ids), request_branches, k)
                for state, request_branches, k in zip(states, branches, max_tokens)]
        batch = ForwardBatch.from_rows(*zip(*rows), [state.slot for state in states], device=self.model.device)
        logits = self._logits(batch)  # [rows, vocab]
        for state, request_branches in zip(states, branches):
            state.cached_token_ids.append(request_branches[0].token_ids[-1])  # branch 0 sits in place
        return batch.split_logits(logits)

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

    @staticmethod
    def _draft_token(state: _DraftState, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [1, vocab] -> (draft token, its draft distribution [1, vocab] or None for greedy)."""
        if state.params.greedy:
            return int(greedy_tokens(logits)[0]), None
        probs = logits_to_probs(logits, state.params)  # [1, vocab]
        return int(sample(probs, state.generator)[0]), probs


def _branch_rows(base: int, branches: list[_Branch], max_tokens: int):
    """Rows feeding each branch's last token: (tokens, RoPE positions, cache positions, prefix ends, tree keys).

    The token at depth d belongs at RoPE position base + d. Branch 0 is stored in place (prefix end
    base + d + 1); branch j > 0 stores its depth-d node at base + j * max_tokens + d and attends the
    positions < base + shared_depth plus its scratch positions (recorded here as each node is fed).
    """
    depth = len(branches[0].token_ids) - 1
    cache_positions, prefix_ends, tree_keys = [], [], []
    for j, branch in enumerate(branches):
        if j == 0:
            cache_positions.append(base + depth)
            prefix_ends.append(base + depth + 1)
            tree_keys.append([])
            continue
        branch.scratch_positions.append(base + j * max_tokens + depth)
        cache_positions.append(branch.scratch_positions[-1])
        prefix_ends.append(base + branch.shared_depth)
        tree_keys.append(list(branch.scratch_positions))
    return ([branch.token_ids[-1] for branch in branches], [base + depth] * len(branches), cache_positions,
            prefix_ends, tree_keys)
