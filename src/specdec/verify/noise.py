"""A sampled request's random numbers: a counter-based stream keyed by (request seed, purpose, output index).

Plain decoding draws output token t from the target's processed distribution at t with one uniform number,
u_t = uniform(seed, TARGET, t) (the inverse of the cumulative distribution, `verify.sampling.sample_token`). The
number depends only on the seed and t, never on how many numbers were drawn before, so a speculative step can
ask for the numbers of any positions it covers without consuming anything: with exact acceptance the verifier
draws every position's token with plain decoding's u_t, and the output is plain decoding's output whatever the
batch, the draft length, the drafter or the tree.

Rejection sampling needs more numbers per position; each purpose has a stream of its own, so that the numbers
one emitted token depends on are independent of each other and of every other position's:

  TARGET    u_t: plain decoding's draw at t; exact acceptance's draws; rejection sampling's bonus token
  DRAFT     a sampling drafter's draw at t under rejection acceptance (under exact acceptance it draws with u_t)
  ACCEPT    rejection sampling's acceptance test of the draft token at t
  RESIDUAL  rejection sampling's recovered token at t, drawn from the residual distribution

A position's numbers may be looked at in a step that does not reach it (drafts after a rejected one); whether
a step reaches t depends only on earlier positions' numbers, so t's numbers are still fresh when t is emitted.

The generator is SplitMix64 (Steele, Lea and Flood 2014): the n-th number of the stream (seed, purpose) is
mix(key + (n + 1) * gamma) with key = mix(mix(seed) + purpose), and its top 53 bits give a uniform float in [0, 1).
"""
from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from specdec.config import ACCEPTANCE_METHODS

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_UNIT = 2.0**-53  # one step of a 53-bit fraction


class NoiseStream(enum.IntEnum):
    """What a random number is for (the module docstring's table)."""

    TARGET = 0
    DRAFT = 1
    ACCEPT = 2
    RESIDUAL = 3


def splitmix64(value: int) -> int:
    """SplitMix64's output function of one 64-bit state advance: value + gamma, then the finalizer."""
    mixed = (value + _GOLDEN_GAMMA) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mixed ^ (mixed >> 31)


def stream_key(seed: int, stream: NoiseStream) -> int:
    """The 64-bit key of one purpose's stream for a seed (any int: it is taken modulo 2**64)."""
    return splitmix64((splitmix64(seed & _MASK64) + int(stream)) & _MASK64)


def counter_uniform(key: int, index: int) -> float:
    """The index-th uniform number in [0, 1) of the stream with this key."""
    return (splitmix64((key + index * _GOLDEN_GAMMA) & _MASK64) >> 11) * _UNIT


def random_seed() -> int:
    """A seed for a request that gave none: 63 random bits from the operating system."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class RequestNoise:
    """One sampled request's random numbers, by output index (0 = the first generated token).

    acceptance: "exact" (a sampling drafter draws with the target's u_t) or "rejection" (it draws from its own
    stream, which rejection sampling needs: a draft and its acceptance test must not share a number).
    """

    seed: int
    acceptance: str = "exact"
    _keys: dict[NoiseStream, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_METHODS:
            raise ValueError(f"acceptance must be one of {', '.join(map(repr, ACCEPTANCE_METHODS))}, "
                             f"got {self.acceptance!r}")
        object.__setattr__(self, "_keys", {stream: stream_key(self.seed, stream) for stream in NoiseStream})

    @property
    def exact(self) -> bool:
        return self.acceptance == "exact"

    def uniform(self, stream: NoiseStream, output_index: int) -> float:
        return counter_uniform(self._keys[stream], output_index)

    def uniforms(self, stream: NoiseStream, start: int, count: int) -> list[float]:
        """The numbers of output indices start .. start + count - 1."""
        key = self._keys[stream]
        return [counter_uniform(key, index) for index in range(start, start + count)]

    def target(self, output_index: int) -> float:
        """u_t: the number plain decoding draws output token t with."""
        return self.uniform(NoiseStream.TARGET, output_index)

    def draft(self, output_index: int) -> float:
        """The number a sampling drafter draws its draft for output token t with."""
        return self.uniform(NoiseStream.TARGET if self.exact else NoiseStream.DRAFT, output_index)
