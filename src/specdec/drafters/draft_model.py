"""Draft-model drafter: a smaller model with the same tokenizer proposes k tokens autoregressively.

It keeps its own KV cache (one slot per request). `cached_token_ids` records which tokens have valid
entries in that cache; after the target verifies, the longest prefix that still agrees with the committed
sequence stays valid (rollback = truncating that list), and the next proposal first feeds the tokens the
draft model has not seen yet — the recovered/bonus token, and after a fully accepted draft also the last
draft token (catch-up), all in the same batched forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.cache.kv_cache import KVCache
from specdec.config import SamplingParams
from specdec.drafters.base import Draft, Drafter
from specdec.engine.batch import ForwardBatch
from specdec.models.transformer import Transformer
from specdec.verify.sampling import logits_to_probs, sample


@dataclass
class _DraftState:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # committed sequence (prompt + output)
    cached_token_ids: list[int] = field(default_factory=list)  # tokens with valid draft-cache entries, by position


class DraftModelDrafter(Drafter):
    def __init__(self, model: Transformer, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.cache = KVCache(model.config, max_num_seqs, max_model_len, model.device)
        self.states: dict[str, _DraftState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    generator: torch.Generator | None) -> None:
        self.states[request_id] = _DraftState(self.cache.allocate(), params, generator, list(prompt_token_ids))

    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self.states[request_id]
        state.token_ids.extend(token_ids)
        valid = 0
        for cached, committed in zip(state.cached_token_ids, state.token_ids):
            if cached != committed:
                break
            valid += 1
        # keep at least the last committed token uncached: the next proposal needs its logits
        del state.cached_token_ids[min(valid, len(state.token_ids) - 1):]

    def remove_request(self, request_id: str) -> None:
        self.cache.free(self.states.pop(request_id).slot)

    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        states = [self.states[request_id] for request_id in request_ids]
        drafted: list[list[int]] = [[] for _ in states]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in states]
        # Step 0 feeds every token the draft cache lacks; later steps feed the previous draft token.
        pending = [state.token_ids[len(state.cached_token_ids):] for state in states]
        active = [i for i, budget in enumerate(max_draft_tokens) if budget > 0]
        while active:
            logits = self._forward([states[i] for i in active], [pending[i] for i in active])  # [active, vocab]
            for row, i in enumerate(active):
                token_id, probs = self._draft_token(states[i], logits[row : row + 1])
                drafted[i].append(token_id)
                if probs is not None:
                    draft_probs[i].append(probs)
                pending[i] = [token_id]
            active = [i for i in active if len(drafted[i]) < max_draft_tokens[i]]
        return [
            Draft(tuple(tokens), torch.cat(probs) if probs else None)
            for tokens, probs in zip(drafted, draft_probs)
        ]

    def _forward(self, states: list[_DraftState], new_tokens: list[list[int]]) -> torch.Tensor:
        batch = ForwardBatch.build(
            new_tokens,
            [len(state.cached_token_ids) for state in states],
            [state.slot for state in states],
            all_logits=False,
            device=self.model.device,
        )
        logits = self.model.forward(batch, self.cache)  # [len(states), vocab]
        for state, tokens in zip(states, new_tokens):
            state.cached_token_ids.extend(tokens)
        return logits

    @staticmethod
    def _draft_token(state: _DraftState, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [1, vocab] -> (draft token, its draft distribution [1, vocab] or None for greedy)."""
        if state.params.greedy:
            return int(logits[0].argmax()), None
        probs = logits_to_probs(logits, state.params)  # [1, vocab]
        return int(sample(probs, state.generator)[0]), probs
