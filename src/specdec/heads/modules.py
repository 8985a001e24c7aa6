"""The draft-head modules, shared by training (autograd, whole sequences) and drafting (cached, ragged rows).

EAGLE (Li et al. 2024), one step: the target's final-normed hidden state h(t) and the embedding of token
t + 1 go through fc(concat(norm(embed), norm(h))) and one decoder layer (pre-norm attention + SwiGLU MLP,
its own KV cache when drafting); the output predicts h(t + 1), and the target's lm_head rows turn it into the
draft distribution of token t + 2. Drafting feeds each predicted state back with its drafted token (a chain).

Medusa (Cai et al. 2024): head i maps h(t) to h + SiLU(W_i h + b_i) and the lm_head rows give token t + 1 + i.

Both draft over a subset of the target's lm_head rows (`TargetParts.draft_lm_head`, frozen) and map the row
index back to the token id.

Training runs the heads' linear maps as fp32 nn.Linear modules (autograd); drafting runs frozen copies in the
target's weight format (`projections(weight_format)`; q8: our int8 kernel), which read a quarter of the bytes
per draft token and cost about the same for a few rows as for one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.cache.kv_cache import KVCache
from specdec.models.batch import ForwardBatch
from specdec.heads.config import HeadConfig
from specdec.kernels import QKNormRope, attention, gated_activation, qk_norm_rope, rms_norm
from specdec.models.config import ModelConfig
from specdec.models.layers import Linear, RotaryTable

Projection = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] -> [rows, out]


@dataclass(frozen=True)
class TargetParts:
    """The frozen pieces of the target a head uses, as dense fp32 (dequantized once from the loaded model)."""

    embed_source: object  # the target's embedding Linear (q8 or fp32); rows dequantized on demand
    embedding_scale: float
    draft_lm_head: torch.Tensor  # [draft vocab, hidden] fp32: lm_head rows of the draft vocabulary
    draft_token_ids: torch.Tensor  # [draft vocab] int64: target token id of each draft row
    final_logit_softcap: float | None
    lm_head_source: Linear | None = None  # the target's output layer, whose own rows drafting uses

    @classmethod
    def from_target(cls, target, draft_token_ids: torch.Tensor) -> "TargetParts":
        ids = draft_token_ids.to(torch.int64).to(target.device)
        rows = target.lm_head.embed(ids).float().clone()  # [draft vocab, hidden]
        return cls(target.embed_tokens, target.config.embedding_scale, rows, ids, target.config.final_logit_softcap,
                   target.lm_head)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [n] int64 -> [n, hidden] fp32 (scaled like the target's input embedding)."""
        return self.embed_source.embed(token_ids).float() * self.embedding_scale

    def draft_logits(self, hidden: torch.Tensor, lm_head: Projection | None = None) -> torch.Tensor:
        """hidden [..., hidden] -> logits over the draft vocabulary [..., draft vocab]; lm_head: the draft rows in a
        weight format (`draft_lm_head_in`), else the fp32 rows (training)."""
        logits = lm_head(hidden) if lm_head is not None else F.linear(hidden, self.draft_lm_head)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def draft_lm_head_in(self, weight_format: str) -> Linear:
        """The draft lm_head rows as a frozen Linear in weight_format, for drafting: the target's own rows, bit for
        bit (`Linear.rows`), when its output layer is in that format; else the fp32 rows built in it."""
        source = self.lm_head_source
        if source is not None and source.format == weight_format:
            return source.rows(self.draft_token_ids)
        return Linear.build(self.draft_lm_head, None, weight_format)


@dataclass(frozen=True)
class EagleProjections:
    """The EAGLE layer's linear maps: the trainable nn.Linear modules, or frozen `Linear` copies for drafting."""

    fc: Projection
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection

    def as_list(self) -> list[Projection]:
        return [self.fc, self.qkv, self.o, self.gate_up, self.down]


def frozen_linears(modules: list[nn.Linear], weight_format: str) -> list[Linear]:
    """Frozen copies of nn.Linear modules in weight_format ("q8": our int8 kernel; "fp32")."""
    return [Linear.build(m.weight.detach().float(), None if m.bias is None else m.bias.detach().float(), weight_format)
            for m in modules]


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.config = config
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.embed_norm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, torch.device("cpu"))
        self.qk_shape = QKNormRope(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps)

    def cache_config(self) -> ModelConfig:
        """A one-layer ModelConfig describing this head's KV cache."""
        c = self.config
        return ModelConfig(architecture="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                           intermediate_size=c.intermediate_size, num_layers=1, num_heads=c.num_heads,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=1 << 20)

    def projections(self, weight_format: str | None = None) -> EagleProjections:
        """The trainable modules (weight_format None), or frozen copies in weight_format for drafting."""
        modules = [self.fc, self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]
        return EagleProjections(*(modules if weight_format is None else frozen_linears(modules, weight_format)))

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor, proj: EagleProjections) -> torch.Tensor:
        """embeds, hidden [..., hidden] -> the layer input [..., hidden]."""
        eps = self.config.rms_norm_eps
        return proj.fc(torch.cat([rms_norm(embeds, self.embed_norm, eps), rms_norm(hidden, self.hidden_norm, eps)], -1))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, proj: EagleProjections):
        """x [rows, hidden], positions [rows] -> rotated query [rows, H, D], key, value [rows, Hkv, D]."""
        c = self.config
        qkv = proj.qkv(rms_norm(x, self.attn_norm, c.rms_norm_eps))  # [rows, (H + 2 Hkv) * D]
        value = qkv[:, self.q_size + self.kv_size :].reshape(-1, c.num_kv_heads, c.head_dim)
        if self.rotary.inv_freq.device != x.device:
            self.rotary = RotaryTable(c.head_dim, c.rope_theta, x.device)
        cos, sin = self.rotary.tables(int(positions.max()))  # each [>= max position + 1, D]
        query, key = qk_norm_rope(qkv, self.qk_shape, None, None, cos, sin, positions)
        return query, key, value

    def _mlp(self, x: torch.Tensor, proj: EagleProjections) -> torch.Tensor:
        gate_up = proj.gate_up(rms_norm(x, self.ffn_norm, self.config.rms_norm_eps))  # [rows, 2 * inter]
        return proj.down(gated_activation(gate_up, "silu"))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Training, teacher-forced: whole sequences from position 0. embeds [B, T, hidden] (token t + 1), hidden
        [B, T, hidden] (target state at t) -> predicted target state at t + 1 [B, T, hidden]. Causal; padding at the
        end."""
        return self.forward_unrolled(embeds, hidden, steps=1)[0]

    def forward_unrolled(self, embeds: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training with EAGLE-3's training-time test: the head also learns from its own predicted states, seen
        exactly as drafting sees them. Shapes as `forward`; returns one [B, T, hidden] prediction per step.

        Step 1 is teacher-forced: the pair (h(t), embed(t + 1)) at position t predicts h(t + 1). Step s > 1 feeds,
        at position t, step s-1's prediction made at t - 1 (its estimate of h(t)) with embed(t + 1), and attends
        to step-1 keys at positions <= t - (s - 1) and to step-j keys at position t - (s - j) for j = 2 .. s: the
        cache a chain draft of depth s reads (real pairs, then its own earlier drafted positions). Outputs of step
        s at positions t < s - 1 have no such history and must be masked by the caller.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        c = self.config
        proj = self.projections()
        batch, length, _ = hidden.shape
        positions = torch.arange(length, device=hidden.device).repeat(batch)
        group = c.num_heads // c.num_kv_heads
        as_heads = lambda t: t.reshape(batch, length, -1, c.head_dim).transpose(1, 2)  # noqa: E731  [B, heads, T, D]
        step_keys: list[torch.Tensor] = []  # per step [B, H, T, D]
        step_values: list[torch.Tensor] = []
        predictions: list[torch.Tensor] = []
        step_hidden = hidden
        for step in range(1, steps + 1):
            if step > 1:  # position t reads the previous step's prediction made at t - 1
                step_hidden = torch.cat([torch.zeros_like(hidden[:, :1]), predictions[-1][:, :-1]], dim=1)
            x = self._input(embeds, step_hidden, proj).reshape(batch * length, -1)  # [B*T, hidden]
            query, key, value = self._qkv(x, positions, proj)
            step_keys.append(as_heads(key).repeat_interleave(group, dim=1))
            step_values.append(as_heads(value).repeat_interleave(group, dim=1))
            if step == 1:
                context = F.scaled_dot_product_attention(as_heads(query), step_keys[0], step_values[0], is_causal=True)
            else:
                context = _draft_depth_attention(as_heads(query), step_keys, step_values, c.head_dim**-0.5)
            x = x + proj.o(context.transpose(1, 2).reshape(batch * length, self.q_size))
            x = x + self._mlp(x, proj)
            predictions.append(x.reshape(batch, length, -1))
        return predictions

    @torch.inference_mode()
    def forward_cached(self, batch: ForwardBatch, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                       projections: EagleProjections | None = None) -> torch.Tensor:
        """Drafting: the ragged rows of several requests, laid out as the target's forward lays them out (RoPE
        positions, cache positions, prefix ends and tree keys of `batch`: chains, or the nodes of a growing tree).
        embeds, hidden [rows, hidden]. Writes the rows' keys/values and returns the predicted next states
        [rows, hidden]. projections: the frozen drafting copies (`projections(weight_format)`); None: the fp32
        modules."""
        proj = projections if projections is not None else self.projections()
        x = self._input(embeds, hidden, proj)
        query, key, value = self._qkv(x, batch.positions, proj)
        cache.write(0, batch.slots, batch.cache_positions, key, value)
        key_end = batch.prefix_ends  # [rows] int32
        context = attention(query.contiguous(), cache.keys[0], cache.values[0], batch.slots.to(torch.int32),
                            torch.zeros_like(key_end), key_end, self.config.head_dim**-0.5, batch.tree_keys)
        x = x + proj.o(context.reshape(-1, self.q_size))
        return x + self._mlp(x, proj)


def _draft_depth_attention(query: torch.Tensor, step_keys: list[torch.Tensor], step_values: list[torch.Tensor],
                            scale: float) -> torch.Tensor:
    """Attention of draft step s = len(step_keys) (see EagleHead.forward_unrolled). query and each key/value
    [B, H, T, D] -> context [B, H, T, D]: position t attends step-1 keys at positions <= t - (s - 1) and the
    step-j key at t - (s - j) for j = 2 .. s (its own key when j = s)."""
    depth, length = len(step_keys), query.shape[2]
    index = torch.arange(length, device=query.device)
    real_allowed = index[None, :] <= index[:, None] - (depth - 1)  # [T (query), T (key)]
    scores = [(query @ step_keys[0].transpose(-1, -2) * scale).masked_fill(~real_allowed, float("-inf"))]
    shifted_values = []
    for j in range(2, depth + 1):
        shift = depth - j
        key = F.pad(step_keys[j - 1], (0, 0, shift, 0))[:, :, :length]  # key[t] = step j's key at t - shift
        shifted_values.append(F.pad(step_values[j - 1], (0, 0, shift, 0))[:, :, :length])
        diagonal = (query * key).sum(-1, keepdim=True) * scale  # [B, H, T, 1]
        scores.append(diagonal.masked_fill((index < shift)[:, None], float("-inf")))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)  # [B, H, T, T + depth - 1]
    context = probs[..., :length] @ step_values[0]
    for offset, value in enumerate(shifted_values):
        context = context + probs[..., length + offset : length + offset + 1] * value
    return context


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(config.num_medusa_heads))
        for block in self.blocks:  # Medusa's init: each head starts as the identity (drafts the next token)
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def projections(self, weight_format: str | None = None) -> list[Projection]:
        """The trainable blocks (weight_format None), or frozen copies in weight_format for drafting."""
        return list(self.blocks) if weight_format is None else frozen_linears(list(self.blocks), weight_format)

    def forward(self, hidden: torch.Tensor, projections: list[Projection] | None = None) -> torch.Tensor:
        """hidden [..., hidden] -> per head [num heads, ..., hidden]; head i predicts for token t + 1 + i.
        projections: the frozen drafting copies of the blocks (`projections(weight_format)`); None: the modules."""
        blocks = projections if projections is not None else self.blocks
        return torch.stack([hidden + F.silu(block(hidden)) for block in blocks])


def build_head(config: HeadConfig) -> nn.Module:
    return EagleHead(config) if config.method == "eagle" else MedusaHeads(config)
