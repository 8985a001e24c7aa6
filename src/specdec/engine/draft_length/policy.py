"""How many tokens each speculating sequence drafts in a step (k = 0: no speculation this step)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence as SequenceOf

from specdec.engine.sequence import Sequence


@dataclass(frozen=True)
class StepCost:
    """What one decode step measurably cost (the engine reports it after every step)."""

    rows: int  # target rows verified: every sequence's last token + all draft tokens
    draft_lengths: tuple[int, ...]  # the draft length each speculating sequence got
    draft_s: float  # seconds in the drafter
    target_s: float  # seconds in the target forward
    contexts: tuple[int, ...] = ()  # cached tokens of each sequence of draft_lengths before the step
    catch_up_tokens: int = 0  # tokens the drafter caught up on before drafting (Drafter.catch_up_tokens, summed)


class DraftLengthPolicy(ABC):
    def observe_step(self, cost: StepCost) -> None:
        """Policies that plan with measured costs learn from each step here; fixed policies need nothing."""

    def observe_tree_acceptance(self, acceptance_prob_sum: float, accepted: int) -> None:
        """A step verified trees whose nodes carry acceptance probabilities: they summed to `acceptance_prob_sum`
        (the nodes the drafter expected accepted), and the target accepted `accepted` of the nodes (policies that
        cut trees by those probabilities calibrate them with this)."""

    def tree_nodes(self, seqs: SequenceOf[Sequence], draft_lengths: SequenceOf[int], verified_nodes: SequenceOf[int],
                   extra_acceptance_probs: SequenceOf[SequenceOf[float]], batch_size: int) -> list[int]:
        """How many of each sequence's extra tree nodes (their acceptance probabilities extra_acceptance_probs[i],
        in decreasing order) to verify besides its verified_nodes[i] (see CostModel.tree_nodes). Fixed policies
        verify them all (the engine caps trees at each sequence's share of max_verify_tokens)."""
        return [len(probs) for probs in extra_acceptance_probs]

    @abstractmethod
    def draft_lengths(self, seqs: SequenceOf[Sequence], batch_size: int,
                      catch_up_tokens: SequenceOf[int] | None = None) -> list[int]:
        """Draft length per speculating sequence; batch_size counts every sequence in the step.

        Each sequence's own acceptance history is in `seq.metrics` (per-position drafted/accepted counts).
        catch_up_tokens[i]: committed tokens the drafter must ingest before it can draft for seq i
        (`Drafter.catch_up_tokens`; None: none). The engine still caps each length by the sequence's remaining
        tokens and context.
        """


@dataclass(frozen=True)
class BatchDraftPolicy(DraftLengthPolicy):
    """Fixed k, shortened with the batch size.

    Verification is nearly free while one target forward stays memory-bound: up to `max_verify_tokens`
    rows in total (the knee of the measured T(n) curve, see `specdec.bench.runtime_bench`). With B running
    sequences each gets k = min(num_speculative_tokens, max_verify_tokens // B - 1) draft tokens, and
    speculation switches off (k = 0) once B + B·1 rows would pass the knee.
    """

    num_speculative_tokens: int
    max_verify_tokens: int = 32

    def draft_length(self, batch_size: int) -> int:
        return max(0, min(self.num_speculative_tokens, self.max_verify_tokens // max(1, batch_size) - 1))

    def draft_lengths(self, seqs: SequenceOf[Sequence], batch_size: int,
                      catch_up_tokens: SequenceOf[int] | None = None) -> list[int]:
        return [self.draft_length(batch_size)] * len(seqs)
