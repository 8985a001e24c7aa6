"""Drafters over trained heads that read the target's hidden states: EAGLE (a chain through one decoder layer
with its own KV cache) and Medusa (k independent heads on the last hidden state). See specdec/heads/.

Both keep, per request, the committed tokens and the target hidden rows not yet consumed; the engine hands
over hidden(t) for every committed position t except the newest token's (HiddenStateDrafter). Draft
probabilities (sampling) are the head's distribution over its draft vocabulary scattered into the full
vocabulary, so rejection sampling stays exact; greedy drafts are point masses. The heads draft with frozen copies
of their linear maps in the target's weight format (q8 by default: our int8 kernel), not the fp32 training modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.base import Draft, HiddenStateDrafter, check_propose_args, unknown_request_error
from specdec.drafters.tree import check_tree_args
from specdec.heads.modules import EagleHead, MedusaHeads, TargetParts
from specdec.verify.sampling import greedy_tokens, logits_to_probs, sample


@dataclass
class _HeadState:
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # committed sequence (prompt + output)
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden]: rows not yet consumed
    num_hidden: int = 0  # target hidden rows received = positions 0 .. num_hidden - 1
    consumed: int = 0  # hidden rows already consumed (EAGLE: pairs in the head's KV cache)
    slot: int = -1  # EAGLE head KV-cache slot


class HeadDrafter(HiddenStateDrafter):
    """Request bookkeeping shared by the EAGLE and Medusa drafters.

    forward_per_draft_token: EAGLE runs its head once per draft position; Medusa once per step (cost model).
    weight_format: the format of the frozen drafting copies of the head's linear maps and draft lm_head rows
    ("q8": our int8 kernel, a quarter of fp32's bytes; "fp32"); the head module itself is not changed.
    """

    forward_per_draft_token: bool

    def __init__(self, head: EagleHead | MedusaHeads, parts: TargetParts, vocab_size: int, weight_format: str = "q8") -> None:
        self.head = head.eval()
        self.parts = parts
        self.vocab_size = vocab_size
        self.projections = head.projections(weight_format)
        self.draft_lm_head = parts.draft_lm_head_in(weight_format)
        self.states: dict[str, _HeadState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    generator: torch.Generator | None) -> None:
        self.states[request_id] = _HeadState(params, generator, list(prompt_token_ids))

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights one head forward reads: the drafting copies of its linear maps, the draft lm_head rows
        and the head's other (norm) parameters."""
        linears = self.projections.as_list() if isinstance(self.head, EagleHead) else self.projections
        linear_params = {id(p) for m in self.head.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
        others = sum(p.numel() * p.element_size() for p in self.head.parameters() if id(p) not in linear_params)
        return sum(linear.nbytes() for linear in linears) + self.draft_lm_head.nbytes() + others

    def _state(self, request_id: str) -> _HeadState:
        if request_id not in self.states:
            raise unknown_request_error(request_id, self.states)
        return self.states[request_id]

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._state(request_id).token_ids.extend(token_ids)

    def observe_target_hidden(self, request_id: str, target_hidden: torch.Tensor) -> None:
        state = self._state(request_id)
        state.pending_hidden.append(target_hidden.float())
        state.num_hidden += target_hidden.shape[0]

    def remove_request(self, request_id: str) -> None:
        self._state(request_id)
        del self.states[request_id]

    def _draft_tokens(self, states: list[_HeadState], hidden: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """hidden [len(states), hidden] predicted states -> per state (draft token, draft probs [1, vocab] or None)."""
        logits = self.parts.draft_logits(hidden, self.draft_lm_head)  # [rows, draft vocab]
        return [self._draft_token(state, logits[row : row + 1]) for row, state in enumerate(states)]

    def _draft_token(self, state: _HeadState, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [1, draft vocab] -> (target token id, its draft distribution over the full vocabulary or None)."""
        if state.params.greedy:
            return int(self.parts.draft_token_ids[int(greedy_tokens(logits)[0])]), None
        probs = logits_to_probs(logits, state.params)  # [1, draft vocab]
        row = int(sample(probs, state.generator)[0])
        full = torch.zeros(1, self.vocab_size, device=probs.device)
        full[0, self.parts.draft_token_ids] = probs[0]
        return int(self.parts.draft_token_ids[row]), full


def _drafts(drafted: list[list[int]], probs: list[list[torch.Tensor]]) -> list[Draft]:
    return [Draft(tuple(tokens), torch.cat(p) if p else None) for tokens, p in zip(drafted, probs)]


@dataclass
class _Forks:
    """A greedy chain's runner-up tokens while it is drafted: offers (worth, depth, token id), where worth is the
    draft probability of the chain before `depth` times the runner-up's own."""

    chain_prob: float = 1.0
    offers: list[tuple[float, int, int]] = field(default_factory=list)

    def offer(self, logits: torch.Tensor, chosen_token_id: int, depth: int, draft_token_ids: torch.Tensor) -> None:
        """logits [draft vocab] at `depth`, where the chain took chosen_token_id."""
        probs = torch.softmax(logits.float(), dim=-1)  # [draft vocab]
        top_probs, top_rows = probs.topk(min(2, probs.shape[0]))
        top_ids = draft_token_ids[top_rows].tolist()
        if chosen_token_id not in top_ids:  # cannot happen for argmax; keeps the bookkeeping honest
            raise RuntimeError(f"greedy draft {chosen_token_id} is not among the head's top tokens {top_ids}")
        chosen = top_ids.index(chosen_token_id)
        if len(top_ids) == 2:
            self.offers.append((self.chain_prob * float(top_probs[1 - chosen]), depth, top_ids[1 - chosen]))
        self.chain_prob *= float(top_probs[chosen])

    def tree(self, chain: list[int], max_forks: int, min_prob: float) -> Draft:
        """The chain plus its best max_forks offers worth >= min_prob, each as a branch ending at its fork."""
        best = sorted((o for o in self.offers if o[0] >= min_prob), key=lambda o: (-o[0], o[1]))[:max_forks]
        return Draft.from_branches([chain] + [chain[:depth] + [token_id] for _, depth, token_id in best])


class EagleDrafter(HeadDrafter):
    """Step 0 feeds every pair (hidden(t), token(t + 1)) the head cache lacks and drafts from the last row;
    step j feeds (predicted state, draft j) at the next position. Afterwards only the real pairs count as
    cached (rollback by length): the next step's real hidden rows overwrite the drafted positions.

    num_branches = b > 1 (greedy requests; EAGLE-2's dynamic tree by draft confidence, in its cheapest form):
    the chain is drafted as above, and at every depth d the head's runner-up token is an offer worth the draft
    probability of the chain up to d times its own; the best b - 1 offers worth at least min_branch_prob become
    branches chain[:d] + [runner-up] of the tree the target verifies. They end there, so they cost the head
    nothing more: one verify row each. Sampled requests draft chains.
    """

    forward_per_draft_token = True

    def __init__(self, head: EagleHead, parts: TargetParts, vocab_size: int, max_num_seqs: int, max_model_len: int,
                 weight_format: str = "q8", num_branches: int = 1, min_branch_prob: float = 0.05) -> None:
        super().__init__(head, parts, vocab_size, weight_format)
        check_tree_args(num_branches, min_branch_prob)
        self.num_branches = num_branches
        self.min_branch_prob = min_branch_prob
        self.cache = KVCache(head.cache_config(), max_num_seqs, max_model_len, parts.draft_lm_head.device)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    generator: torch.Generator | None) -> None:
        super().add_request(request_id, prompt_token_ids, params, generator)
        self.states[request_id].slot = self.cache.allocate()

    def remove_request(self, request_id: str) -> None:
        self.cache.free(self._state(request_id).slot)
        super().remove_request(request_id)

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        check_propose_args(request_ids, max_draft_tokens)
        states = [self._state(request_id) for request_id in request_ids]
        drafted: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        active = [i for i, (state, budget) in enumerate(zip(states, max_draft_tokens)) if budget > 0 and state.pending_hidden]
        forks = {i: _Forks() for i in active if self.num_branches > 1 and states[i].params.greedy}
        predicted = self._consume_pending([states[i] for i in active])  # [active, hidden]
        step = 0
        while active:
            logits = self.parts.draft_logits(predicted, self.draft_lm_head)  # [active, draft vocab]
            for row, i in enumerate(active):
                token_id, token_probs = self._draft_token(states[i], logits[row : row + 1])
                if i in forks:
                    forks[i].offer(logits[row], token_id, len(drafted[i]), self.parts.draft_token_ids)
                drafted[i].append(token_id)
                if token_probs is not None:
                    probs[i].append(token_probs)
            keep = [row for row, i in enumerate(active) if len(drafted[i]) < max_draft_tokens[i]]
            active, predicted = [active[row] for row in keep], predicted[keep]
            if active:
                predicted = self._feed_drafts([states[i] for i in active], [drafted[i][-1] for i in active], predicted, step)
                step += 1
        drafts = _drafts(drafted, probs)
        for i, request_forks in forks.items():
            drafts[i] = request_forks.tree(drafted[i], self.num_branches - 1, self.min_branch_prob)
        return drafts

    def _consume_pending(self, states: list[_HeadState]) -> torch.Tensor:
        """Feeds every request's unconsumed real pairs; returns the last row's predicted state [len(states), hidden]."""
        if not states:
            return torch.empty(0, self.head.config.hidden_size)
        hidden = torch.cat([row for state in states for row in state.pending_hidden])  # [pairs, hidden]
        tokens = [tok for state in states for tok in state.token_ids[state.consumed + 1 : state.num_hidden + 1]]
        positions = [pos for state in states for pos in range(state.consumed, state.num_hidden)]
        slots = [state.slot for state in states for _ in range(state.consumed, state.num_hidden)]
        out = self._forward(tokens, hidden, positions, slots)  # [pairs, hidden]
        last_rows = torch.tensor([state.num_hidden - state.consumed for state in states]).cumsum(0) - 1
        for state in states:
            state.consumed, state.pending_hidden = state.num_hidden, []
        return out[last_rows]

    def _feed_drafts(self, states: list[_HeadState], tokens: list[int], predicted: torch.Tensor, step: int) -> torch.Tensor:
        """predicted [len(states), hidden]: the state draft `step` was drafted from -> the next predicted states."""
        positions = [state.num_hidden + step for state in states]
        return self._forward(tokens, predicted, positions, [state.slot for state in states])

    def _forward(self, tokens: list[int], hidden: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=hidden.device)  # noqa: E731
        embeds = self.parts.embed(as_long(tokens))  # [rows, hidden]
        return self.head.forward_cached(embeds, hidden, as_long(positions), as_long(slots), self.cache, self.projections)


class MedusaDrafter(HeadDrafter):
    """Draft j (1-based) is head j's token from hidden(n - 2), the newest hidden row: it predicts token n - 1 + j,
    i.e. the j-th token after the newest committed token n - 1."""

    forward_per_draft_token = False

    def __init__(self, heads: MedusaHeads, parts: TargetParts, vocab_size: int, weight_format: str = "q8") -> None:
        super().__init__(heads, parts, vocab_size, weight_format)

    def observe_target_hidden(self, request_id: str, target_hidden: torch.Tensor) -> None:
        super().observe_target_hidden(request_id, target_hidden)
        state = self._state(request_id)
        state.pending_hidden = [state.pending_hidden[-1][-1:]]  # only the newest row is ever read

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        check_propose_args(request_ids, max_draft_tokens)
        states = [self._state(request_id) for request_id in request_ids]
        drafted: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        limit = self.head.config.num_medusa_heads
        active = [i for i, (state, budget) in enumerate(zip(states, max_draft_tokens)) if budget > 0 and state.pending_hidden]
        if not active:
            return _drafts(drafted, probs)
        newest = torch.cat([states[i].pending_hidden[-1] for i in active])  # [active, hidden]
        predicted = self.head(newest, self.projections)  # [heads, active, hidden]
        for head in range(min(limit, max(max_draft_tokens[i] for i in active))):
            rows = [row for row, i in enumerate(active) if head < max_draft_tokens[i]]
            chosen = [states[active[row]] for row in rows]
            for row, (token_id, token_probs) in zip(rows, self._draft_tokens(chosen, predicted[head, rows])):
                drafted[active[row]].append(token_id)
                if token_probs is not None:
                    probs[active[row]].append(token_probs)
        return _drafts(drafted, probs)
