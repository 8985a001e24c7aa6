"""specdec: speculative-decoding inference engine on PyTorch.

Public API: `LLM`, `SamplingParams`, `SpeculativeConfig` (imported lazily: importing the package loads nothing heavy).
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    if name in ("SamplingParams", "SpeculativeConfig"):
        from specdec import config

        return getattr(config, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
