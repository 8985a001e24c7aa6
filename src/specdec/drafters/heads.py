"""Drafters over trained heads that read the target's hidden states: EAGLE (a chain through one decoder layer
with its own KV cache) and Medusa (k independent heads on the last hidden state). See specdec/heads/.

Both keep, per request, the committed tokens and the target hidden rows not yet consumed; the engine hands
over hidden(t) for every committed position t except the newest token's (HiddenStateDrafter). Draft
probabilities (sampling) are the head's distribution over its draft vocabulary scattered into the full
vocabulary, so rejection sampling stays exact, and a sampled draft token is drawn from it with the request's draft
number of its output index (under exact acceptance plain decoding's own, verify/noise.py); greedy drafts are point
masses. The heads draft with frozen copies
of their linear maps in the target's weight format (q8 by default: our int8 kernel), not the fp32 training modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.base import (Draft, DrafterCostDescription, HiddenStateDrafter, check_propose_args,
                                   unknown_request_error)
from specdec.drafters.tree_growth import depth_batches, new_growth
from specdec.drafters.tree import check_tree_args
from specdec.models.batch import ForwardBatch
from specdec.heads.modules import EagleHead, MedusaHeads, TargetParts
from specdec.verify.noise import RequestNoise
from specdec.verify.sampling import greedy_tokens, logits_to_probs, sample_one


@dataclass
class _HeadState:
    params: SamplingParams
    noise: RequestNoise | None  # a sampled request's random numbers (None: greedy)
    token_ids: list[int]  # committed sequence (prompt + output)
    prompt_length: int
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden]: rows not yet consumed
    num_hidden: int = 0  # target hidden rows received = positions 0 .. num_hidden - 1
    consumed: int = 0  # hidden rows already consumed (EAGLE: pairs in the head's KV cache)
    slot: int = -1  # EAGLE head KV-cache slot


class HeadDrafter(HiddenStateDrafter):
    """Request bookkeeping shared by the EAGLE and Medusa drafters.

    forward_per_draft_token: EAGLE runs its head once per draft position; Medusa once per step (`cost_description`).
    weight_format: the format of the frozen drafting copies of the head's linear maps and draft lm_head rows
    ("q8": our int8 kernel, a quarter of fp32's bytes; "fp32"); the head module itself is not changed.
    """

    forward_per_draft_token: bool

    def __init__(
        self, head: EagleHead | MedusaHeads, parts: TargetParts, vocab_size: int, weight_format: str = "q8"
    ) -> None:
        self.head = head.eval()
        self.parts = parts
        self.vocab_size = vocab_size
        self.projections = head.projections(weight_format)
        self.draft_lm_head = parts.draft_lm_head_in(weight_format)
        self.states: dict[str, _HeadState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    noise: RequestNoise | None) -> None:
        self.states[request_id] = _HeadState(params, noise, list(prompt_token_ids), len(prompt_token_ids))

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights one head forward reads: the drafting copies of its linear maps, the draft lm_head rows
        and the head's other (norm) parameters."""
        linears = self.projections.as_list() if isinstance(self.head, EagleHead) else self.projections
        linear_params = {id(p) for m in self.head.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
        others = sum(p.numel() * p.element_size() for p in self.head.parameters() if id(p) not in linear_params)
        return sum(linear.nbytes() for linear in linears) + self.draft_lm_head.nbytes() + others

    def cost_description(self) -> DrafterCostDescription:
        """One head forward reading `weight_nbytes`, per draft position (EAGLE) or per step (Medusa)."""
        return DrafterCostDescription(forward_weight_nbytes=self.weight_nbytes,
                                      forward_per_draft_token=self.forward_per_draft_token)

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

    def _draft_tokens(self, states: list[_HeadState], hidden: torch.Tensor,
                      depth: int) -> list[tuple[int, torch.Tensor | None]]:
        """hidden [len(states), hidden] predicted states at `depth` -> per state (draft token, draft probs [1, vocab]
        or None)."""
        logits = self.parts.draft_logits(hidden, self.draft_lm_head)  # [rows, draft vocab]
        return [self._draft_token(state, logits[row : row + 1], depth) for row, state in enumerate(states)]

    def _draft_token(self, state: _HeadState, logits: torch.Tensor, depth: int) -> tuple[int, torch.Tensor | None]:
        """logits [1, draft vocab] at `depth` of the draft -> (target token id, its draft distribution over the full
        vocabulary or None). A sampled draft is the inverse cumulative distribution of the full-vocabulary draft
        distribution (token id order, as the target's) at the request's draft number of its output index."""
        if state.params.greedy:
            return int(self.parts.draft_token_ids[int(greedy_tokens(logits)[0])]), None
        probs = logits_to_probs(logits, state.params)  # [1, draft vocab]
        full = torch.zeros(1, self.vocab_size, device=probs.device)  # [1, vocab]
        full[0, self.parts.draft_token_ids] = probs[0]
        output_index = len(state.token_ids) - state.prompt_length + depth
        return sample_one(full, state.noise.draft(output_index)), full


def _drafts(drafted: list[list[int]], probs: list[list[torch.Tensor]]) -> list[Draft]:
    return [Draft(tuple(tokens), torch.cat(p) if p else None) for tokens, p in zip(drafted, probs)]


class EagleDrafter(HeadDrafter):
    """Step 0 feeds every pair (hidden(t), token(t + 1)) the head cache lacks and drafts from the last row;
    step j feeds (predicted state, draft j) at the next position. Afterwards only the real pairs count as
    cached (rollback by length): the next step's real hidden rows overwrite the drafted positions.

    num_branches = b > 1 (greedy requests): EAGLE-2's dynamic tree by draft confidence
    (drafters.tree_growth.GrowingTree).
    At every depth the head expands the chain's node and the b - 1 other nodes whose paths it finds likeliest
    (one head row each, all requests in one forward), each adding its b best next tokens; the draft is the chain
    then the other nodes by path probability (at least min_branch_prob), up to b * k nodes, which the engine cuts
    to its row budget. The chain is exactly the chain draft. Sampled requests draft chains.
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
                    noise: RequestNoise | None) -> None:
        super().add_request(request_id, prompt_token_ids, params, noise)
        self.states[request_id].slot = self.cache.allocate()

    def remove_request(self, request_id: str) -> None:
        self.cache.free(self._state(request_id).slot)
        super().remove_request(request_id)

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        check_propose_args(request_ids, max_draft_tokens)
        states = [self._state(request_id) for request_id in request_ids]
        growths = [new_growth(state.num_hidden, budget, state.params.greedy,
                              lambda logits, depth, state=state: self._draft_token(state, logits, depth),
                              self.num_branches, self.min_branch_prob, self.cache.max_len, self.parts.draft_token_ids)
                   for state, budget in zip(states, max_draft_tokens)]
        active = [
            i for i, (state, budget) in enumerate(zip(states, max_draft_tokens)) if budget > 0 and state.pending_hidden
        ]
        predicted = self._consume_pending([states[i] for i in active])  # [active, hidden]
        # the predicted state each next row is drafted from, per request and tree node (-1: the root; a chain's
        # newest prediction replaces its -1 after every depth)
        node_state = {i: {-1: predicted[row]} for row, i in enumerate(active)}
        logits = self.parts.draft_logits(predicted, self.draft_lm_head)  # [active, draft vocab]
        for row, i in enumerate(active):
            growths[i].first(logits[row : row + 1])
        for fed, batch in depth_batches(growths, active, [state.slot for state in states], predicted.device):
            hidden = torch.stack([node_state[i][parent] for i, rows in fed.items()
                                  for parent in rows.parents])  # [rows, hidden]
            out = self.head.forward_cached(batch, self.parts.embed(batch.token_ids), hidden, self.cache,
                                           self.projections)  # [rows, hidden]
            logits = self.parts.draft_logits(out, self.draft_lm_head)  # [rows, draft vocab]
            for (i, rows), seq_out, seq_logits in zip(fed.items(), out.split(list(batch.row_counts)),
                                                      logits.split(list(batch.row_counts))):
                for row, node in enumerate(rows.nodes):
                    node_state[i][node] = seq_out[row]
                growths[i].add(seq_logits)
        return [growth.draft() for growth in growths]

    def _consume_pending(self, states: list[_HeadState]) -> torch.Tensor:
        """Feeds every request's unconsumed real pairs; returns the last row's predicted state [len(states), hidden]."""
        if not states:
            return torch.empty(0, self.head.config.hidden_size)
        hidden = torch.cat([row for state in states for row in state.pending_hidden])  # [pairs, hidden]
        batch = ForwardBatch.build([state.token_ids[state.consumed + 1 : state.num_hidden + 1] for state in states],
                                   [state.consumed for state in states], [state.slot for state in states],
                                   all_logits=True, device=hidden.device)
        out = self.head.forward_cached(batch, self.parts.embed(batch.token_ids), hidden, self.cache,
                                       self.projections)  # [pairs, hidden]
        last_rows = torch.tensor(batch.row_counts).cumsum(0) - 1
        for state in states:
            state.consumed, state.pending_hidden = state.num_hidden, []
        return out[last_rows]


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
        active = [
            i for i, (state, budget) in enumerate(zip(states, max_draft_tokens)) if budget > 0 and state.pending_hidden
        ]
        if not active:
            return _drafts(drafted, probs)
        newest = torch.cat([states[i].pending_hidden[-1] for i in active])  # [active, hidden]
        predicted = self.head(newest, self.projections)  # [heads, active, hidden]
        for head in range(min(limit, max(max_draft_tokens[i] for i in active))):
            rows = [row for row, i in enumerate(active) if head < max_draft_tokens[i]]
            chosen = [states[active[row]] for row in rows]
            for row, (token_id, token_probs) in zip(rows, self._draft_tokens(chosen, predicted[head, rows], head)):
                drafted[active[row]].append(token_id)
                if token_probs is not None:
                    probs[active[row]].append(token_probs)
        return _drafts(drafted, probs)
