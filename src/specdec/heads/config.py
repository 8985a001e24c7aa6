"""A draft head's configuration and its files: ``NAME.safetensors`` (weights) + ``NAME.json`` (this config).

The head is tied to one target: it reads the target's hidden states, embeds tokens with the target's
embedding and drafts through rows of the target's lm_head, so its config records the target's shape and a
fingerprint of its weights, and loading it for another target fails with the reason.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

HEAD_METHODS = ("eagle", "medusa")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadConfig:
    """method: "eagle" (one decoder layer predicting the next hidden state) or "medusa" (residual heads).

    hidden_size / vocab_size / target_fingerprint: the target's, checked when the head is loaded.
    draft_vocab_size: the lm_head rows the head drafts over (the most frequent tokens of the training data,
        FR-Spec style; = vocab_size for the full head); their ids are stored with the weights.
    num_heads, num_kv_heads, head_dim, intermediate_size, rope_theta: the EAGLE decoder layer's shape.
    num_medusa_heads: Medusa heads; head i (1-based) predicts the token i + 1 positions after the hidden state.
    embedding_scale, final_logit_softcap, rms_norm_eps: copied from the target so the head sees what it sees.
    """

    method: str
    target_name: str
    target_fingerprint: str
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    embedding_scale: float = 1.0
    final_logit_softcap: float | None = None
    rms_norm_eps: float = 1e-6
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    num_medusa_heads: int = 0

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"unknown draft-head method {self.method!r}; known: {', '.join(HEAD_METHODS)}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.method == "eagle" and min(self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size) < 1:
            raise ValueError("an EAGLE head needs num_heads, num_kv_heads, head_dim and intermediate_size >= 1")
        if self.method == "eagle" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.method == "medusa" and self.num_medusa_heads < 1:
            raise ValueError(f"Medusa needs num_medusa_heads >= 1, got {self.num_medusa_heads}")

    def check_target(self, target, path: str = "") -> None:
        """Raises ValueError unless `target` (a Transformer) is the model this head was trained on."""
        where = f"draft head {path or self.method!r}"
        config = target.config
        if (self.hidden_size, self.vocab_size) != (config.hidden_size, config.vocab_size):
            raise ValueError(f"{where} was trained for hidden size {self.hidden_size} and vocabulary {self.vocab_size} "
                             f"({self.target_name}); the target has {config.hidden_size} and {config.vocab_size}")
        fingerprint = target_fingerprint(target)
        if fingerprint != self.target_fingerprint:
            raise ValueError(f"{where} was trained on {self.target_name} (fingerprint {self.target_fingerprint}); "
                             f"the target's weights differ (fingerprint {fingerprint}): retrain it with "
                             "`specdec train-draft` for this model")


@dataclass(frozen=True)
class HeadFile:
    """A loaded head file: its config, weights (module state dict) and the draft vocabulary."""

    config: HeadConfig
    state: dict[str, torch.Tensor]  # module parameters, fp32
    draft_token_ids: torch.Tensor  # [draft_vocab_size] int64: draft row i drafts target token draft_token_ids[i]
    training: dict[str, Any]  # how it was trained (data size, steps, time, losses), for reports


def target_fingerprint(target) -> str:
    """16 hex digits over the target's config and a few fp32 norm weights (the same for q8 and fp32 formats)."""
    digest = hashlib.sha256()
    config = dataclasses.asdict(target.config)
    config.pop("name", None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for tensor in (target.norm, target.layers[0].attn_norm, target.layers[-1].ffn_norm):
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def sidecar_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def save_head(path: str | Path, config: HeadConfig, state: dict[str, torch.Tensor], draft_token_ids: torch.Tensor,
              training: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"head.{name}": tensor.detach().float().cpu().contiguous() for name, tensor in state.items()}
    tensors["draft_token_ids"] = draft_token_ids.to(torch.int64).cpu().contiguous()
    save_file(tensors, str(path), metadata={"format_version": str(FORMAT_VERSION), "method": config.method})
    meta = {"format_version": FORMAT_VERSION, "config": dataclasses.asdict(config), "training": training}
    sidecar_path(path).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def load_head(path: str | Path) -> HeadFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such draft-head file: {path} (train one with `specdec train-draft`)")
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise FileNotFoundError(f"draft head {path} lacks its JSON config {sidecar}")
    meta = json.loads(sidecar.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"draft head {path} has format version {meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    config = HeadConfig(**meta["config"])
    tensors = load_file(str(path))
    state = {name.removeprefix("head."): tensor for name, tensor in tensors.items() if name.startswith("head.")}
    return HeadFile(config, state, tensors["draft_token_ids"], meta.get("training", {}))
