"""specdec: speculative-decoding inference engine on PyTorch.

Public API: `LLM`, `SamplingParams`, `SpeculativeConfig`, `GuidedDecoding` (imported lazily: importing the package loads
nothing heavy).
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "GuidedDecoding"]


def __getattr__(name: str):
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    if name in ("SamplingParams", "SpeculativeConfig", "GuidedDecoding"):
        from specdec import config

        return getattr(config, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
