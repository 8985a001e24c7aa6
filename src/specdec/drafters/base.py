"""The drafter interface: propose draft tokens for a batch of requests, learn from committed tokens."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.drafters.tree import DraftTree
from specdec.verify.noise import RequestNoise


@dataclass(frozen=True)
class Draft:
    """The drafter's proposal for one request.

    token_ids is always a chain: with a tree it is the tree's first branch, which is what a request verifies when
    the engine does not verify its trees (`verifies_trees`).
    """

    token_ids: tuple[int, ...]  # k proposed tokens (k may be 0)
    draft_probs: torch.Tensor | None = None  # [k, vocab] draft distribution per position, None = point mass
    tree: DraftTree | None = None  # more branches for greedy verification; None = the chain only

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            raise ValueError(f"Draft.token_ids must be a tuple, got {type(self.token_ids).__name__}")
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(self.token_ids)
        ):
            raise ValueError(
                f"Draft.draft_probs must be [k, vocab] with k = {len(self.token_ids)}, "
                f"got shape {tuple(self.draft_probs.shape)}"
            )
        if self.tree is not None and self.tree.first_branch() != self.token_ids:
            raise ValueError(
                f"Draft.token_ids {self.token_ids} must be the first branch of Draft.tree, {self.tree.first_branch()}"
            )

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int]], max_nodes: int | None = None) -> "Draft":
        """Point-mass draft of one or more branches: a chain for one branch, a tree otherwise."""
        tree = DraftTree.from_branches(branches, max_nodes)
        chain = tree.first_branch()
        return cls(token_ids=chain, draft_probs=None, tree=None if tree.is_chain() else tree)

    def capped(self, max_nodes: int) -> "Draft":
        """This draft with its tree cut to max_nodes nodes (the first branch always stays: it is within k)."""
        if self.tree is None or self.tree.num_nodes <= max_nodes:
            return self
        tree = self.tree.truncated(max(max_nodes, len(self.token_ids)))
        return Draft(self.token_ids, self.draft_probs, None if tree.is_chain() else tree)


@dataclass(frozen=True)
class DrafterCostDescription:
    """How a drafter's work per step scales, for the draft-length policy's cost model (engine/draft_length), which
    prices it against the target's measured forward until the drafter itself is timed: decoding is memory-bound, so
    one drafter forward costs about the target's T(1) scaled by the weight bytes it reads.

    forward_weight_nbytes: weight bytes one drafter forward reads; 0: the drafter runs no model forward (a lookup,
        measured ≈ 0 s next to a target forward).
    forward_per_draft_token: one forward per draft position (a draft model, EAGLE), or one per step (Medusa: every
        head in one forward). Either way the sequences of a step share each forward.
    """

    forward_weight_nbytes: int = 0
    forward_per_draft_token: bool = False


AllowedAfter = Callable[[Sequence[int]], torch.Tensor]  # draft prefix -> [vocab] bool, the tokens allowed next


class Drafter(ABC):
    """One instance serves a whole batch of requests, each identified by its request id."""

    @abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        noise: RequestNoise | None,
    ) -> None:
        """Start tracking a request; its sequence so far is the prompt. noise: a sampled request's random
        numbers (None for greedy requests); a drafter that samples draws its draft for output index t with
        `noise.draft(t)`, output index 0 being the first token after the prompt."""

    @abstractmethod
    def propose(self, request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> list[Draft]:
        """One Draft per request, in order, with len(token_ids) <= max_draft_tokens[i]."""

    @abstractmethod
    def observe(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens just committed to the request's sequence (accepted drafts + the recovered/bonus token)."""

    @abstractmethod
    def remove_request(self, request_id: str) -> None:
        """The request finished; drafters with a cross-request cache keep its tokens there."""

    def constrain(self, request_id: str, allowed_after: AllowedAfter) -> None:
        """The request's output is constrained: allowed_after(draft prefix) -> [vocab] bool gives the tokens allowed
        after the committed tokens and that prefix. A drafter that proposes from a distribution masks it with this,
        so that its drafts stay within the constraint; the default keeps drafting as before (the engine cuts a draft
        at its first forbidden token either way, so this is about wasted draft work, never about exactness)."""

    def catch_up_tokens(self, request_id: str) -> int:
        """Committed tokens the drafter must ingest before it can draft for the request, beyond what a request
        drafting every step feeds (the draft policy weighs their cost against the request's remaining tokens).
        0 for drafters that keep no per-request model state (lookups) or whose catch-up is negligible."""
        return 0

    def cost_description(self) -> DrafterCostDescription:
        """What the drafter's work costs, for the draft-length policy; the default: no model forward (lookups)."""
        return DrafterCostDescription()


def verifies_trees(params: SamplingParams, noise: RequestNoise | None) -> bool:
    """Whether the engine verifies a request's token trees: greedy requests (along the argmax), and sampled
    requests under exact acceptance (along the target's seeded draws); rejection sampling verifies chains."""
    return params.greedy or (noise is not None and noise.exact)


def check_propose_args(request_ids: Sequence[str], max_draft_tokens: Sequence[int]) -> None:
    """Shared argument check for ``Drafter.propose``."""
    if len(request_ids) != len(max_draft_tokens):
        raise ValueError(
            f"propose got {len(request_ids)} request ids but {len(max_draft_tokens)} max_draft_tokens entries"
        )
    negative = [(request_id, budget) for request_id, budget in zip(request_ids, max_draft_tokens) if budget < 0]
    if negative:
        raise ValueError(f"max_draft_tokens must be >= 0, got (request_id, budget) {negative}")


def unknown_request_error(request_id: str, known_request_ids: Iterable[str]) -> KeyError:
    """The error every drafter raises for a request id it does not track."""
    return KeyError(f"unknown request id {request_id!r}; tracked: {sorted(known_request_ids)[:10]}")


class HiddenStateDrafter(Drafter):
    """A drafter that reads the target's hidden states (EAGLE, Medusa heads).

    The engine runs the target with ``forward_hidden`` for such a drafter and hands it, per request, the
    final-normed hidden rows of every newly committed position, in order, before the next ``propose``: every
    prefill chunk's rows, and after a verify step the rows of the last token and the accepted drafts (the
    recovered/bonus token's row comes with the next step, once the target has read it). So at
    ``propose`` time the drafter holds hidden(0 .. n-2) for a sequence of n committed tokens and pairs
    hidden(t) with token(t + 1).
    """

    @abstractmethod
    def observe_target_hidden(self, request_id: str, target_hidden: torch.Tensor) -> None:
        """target_hidden [n, hidden] fp32: rows of the next n committed positions of the request."""
