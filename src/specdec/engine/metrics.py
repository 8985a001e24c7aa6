"""Speculative-decoding counters, defined once for the engine, the benchmarks and the server."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeMetrics:
    """Counters over verify steps (one step = one request verified once).

    Counters:
      verify_steps             number of verify steps recorded.
      drafted_tokens           sum over steps of k (draft tokens proposed).
      accepted_tokens          sum over steps of accepted_count (the recovered/bonus token is not counted).
      drafted_per_position[i]  steps that drafted a token at position i (k > i).
      accepted_per_position[i] steps whose draft token i was accepted (accepted_count > i).
      draft_time_s / target_time_s / verify_time_s   wall time in the drafter, the target forward, the verifier.

    Derived (0.0 when the denominator is 0):
      acceptance_rate            α = accepted_tokens / drafted_tokens
      mean_accepted_length       τ = 1 + accepted_tokens / verify_steps = tokens emitted per verify step,
                                 including the recovered or bonus token
      position_acceptance_rates  [accepted_per_position[i] / drafted_per_position[i] for each position i]

    Token trees: k is the tree's depth (its longest branch) and position i is depth i; accepted_count is the
    length of the accepted path. So α of a tree counts drafted depths, not nodes (a tree of 20 nodes and
    depth 5 whose path of 3 is accepted records 5 drafted, 3 accepted).
    """

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record_step(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted} of {num_drafted}")
        self.verify_steps += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self._grow_positions(num_drafted)
        for position in range(num_drafted):
            self.drafted_per_position[position] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def _grow_positions(self, num_positions: int) -> None:
        missing = num_positions - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)

    def merge(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        """Add ``other``'s counters into this one (in place); returns self."""
        self.verify_steps += other.verify_steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self._grow_positions(len(other.drafted_per_position))
        for position, count in enumerate(other.drafted_per_position):
            self.drafted_per_position[position] += count
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count
        self.draft_time_s += other.draft_time_s
        self.target_time_s += other.target_time_s
        self.verify_time_s += other.verify_time_s
        return self

    def __add__(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        if not isinstance(other, SpecDecodeMetrics):
            return NotImplemented
        return self.copy().merge(other)

    def copy(self) -> SpecDecodeMetrics:
        return dataclasses.replace(
            self,
            accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def position_acceptance_rates(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "position_acceptance_rates": self.position_acceptance_rates,
        }
