"""One decoder-only transformer; Llama, Qwen2 and Gemma 3 differ only by ModelConfig.

Weights come from a loader as canonical fp32 tensors (see models/loader.py) and are converted once to
the chosen weight format (models/layers.Linear). q/k/v and gate/up are fused into single linears.

Under tensor parallelism (models/parallel.py) each rank builds the same class over its slice of the checkpoint:
its heads and its part of the intermediate dimension; the partial sums of o_proj and down_proj are all-reduced.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.models.batch import ForwardBatch
from specdec.kernels import QKNormRope, attention, gated_activation, qk_norm_rope, rms_norm
from specdec.kernels.ops import quantize_weight_rows
from specdec.models.config import ModelConfig
from specdec.models.layers import ConcatLinear, Linear, RotaryTable, TensorStorage, resolved_weight_format
from specdec.models.parallel import ShardPlan, TensorParallel, TrunkCommand

if TYPE_CHECKING:  # the cache is the layer above: the model only writes and reads the one it is given
    from specdec.cache.kv_cache import KVCache


@dataclass(frozen=True)
class ForwardOutput:
    """A forward pass's logits plus the hidden state of every row (for hidden-state drafters: EAGLE, Medusa).

    hidden is the final-normed state, i.e. exactly what lm_head reads: logits = lm_head(hidden[logits_rows])
    (then Gemma's soft cap). Heads trained on it can reuse the target's lm_head unchanged.
    """

    logits: torch.Tensor  # [logit rows, vocab] fp32
    hidden: torch.Tensor  # [rows, hidden] fp32, final-normed


@dataclass(frozen=True)
class DecoderLayer:
    attn_norm: torch.Tensor  # [hidden]
    qkv_proj: Linear | ConcatLinear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o_proj: Linear | ConcatLinear  # heads * head_dim -> hidden
    ffn_norm: torch.Tensor  # [hidden]
    gate_up_proj: Linear | ConcatLinear  # hidden -> 2 * intermediate
    down_proj: Linear | ConcatLinear  # intermediate -> hidden
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    post_attn_norm: torch.Tensor | None  # [hidden]
    post_ffn_norm: torch.Tensor | None  # [hidden]


def _optional(tensors: dict[str, torch.Tensor], name: str, device: torch.device) -> torch.Tensor | None:
    tensor = tensors.get(name)
    return None if tensor is None else tensor.float().to(device)


def _shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape, without dequantizing it where the mapping knows it (a GGUF file's lazy tensors)."""
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


def _linear(tensors: Mapping[str, torch.Tensor], storage: TensorStorage, names: list[str], bias: torch.Tensor | None,
            weight_format: str, device) -> Linear | ConcatLinear:
    """One linear of the row-concatenated tensors ``names``, in the format ``storage`` resolves for them, or one
    linear per part where the file stores the names in different lossless block types (TensorStorage.linear_parts).
    A part built from the file's blocks or int8 values is never dequantized to fp32."""
    parts, row = [], 0
    in_features = _shape(tensors, names[0])[1]
    for part_names, linear_format in storage.linear_parts(names, in_features, weight_format):
        block_bytes = storage.lossless_bytes(part_names, linear_format)
        exact_int8 = storage.exact_int8(part_names, in_features) if linear_format == "q8" else None
        out_features = sum(_shape(tensors, name)[0] for name in part_names)
        weight = None
        if block_bytes is None and exact_int8 is None:
            weight = torch.cat([tensors[name].float().to(device) for name in part_names])  # [part out, in]
        part_bias = None if bias is None else bias[row : row + out_features]
        parts.append(Linear.build(weight, part_bias, linear_format, block_bytes, exact_int8,
                                  shape=(out_features, in_features)))
        row += out_features
    return parts[0] if len(parts) == 1 else ConcatLinear(tuple(parts))


def _embedding(tensors: Mapping[str, torch.Tensor], storage: TensorStorage, weight_format: str,
               dense: torch.Tensor | None, device) -> Linear:
    """The embedding table, a gather, not a weight stream: fp32 under fp32 (``dense``), else q8 under every format
    (and the lm_head it is tied to): the file's own int8 values where it stores Q8_0 / Q5_0 / Q4_0, else requantized,
    from row ranges where the mapping reads them alone (a Q4_K / Q6_K table: never all of it in fp32)."""
    if weight_format == "fp32":
        return Linear.build(dense, None, "fp32")
    shape = _shape(tensors, "embed_tokens")
    exact_int8 = storage.exact_int8(["embed_tokens"], shape[1])
    if exact_int8 is not None:
        return Linear.build(None, None, "q8", exact_int8=exact_int8, shape=shape)
    if dense is None and callable(getattr(tensors, "rows", None)):
        read_rows = lambda r0, r1: tensors.rows("embed_tokens", r0, r1).float().to(device)  # noqa: E731
        return Linear(dense=None, quantized=quantize_weight_rows(read_rows, shape, device), bias=None)
    return Linear.build(dense if dense is not None else tensors["embed_tokens"].float().to(device), None, "q8")


def _build_layer(config: ModelConfig, tensors: dict[str, torch.Tensor], storage: TensorStorage, index: int,
                 weight_format: str, device) -> DecoderLayer:
    prefix = f"layers.{index}."
    take = lambda name: tensors[prefix + name].float().to(device)  # noqa: E731
    linear = lambda leaves, bias=None: _linear(tensors, storage, [prefix + leaf for leaf in leaves], bias,  # noqa: E731
                                               weight_format, device)
    qkv_bias = torch.cat([take("q_proj.bias"), take("k_proj.bias"), take("v_proj.bias")]) if config.qkv_bias else None
    return DecoderLayer(
        attn_norm=take("attn_norm"),
        qkv_proj=linear(["q_proj", "k_proj", "v_proj"], qkv_bias),
        o_proj=linear(["o_proj"]),
        ffn_norm=take("ffn_norm"),
        gate_up_proj=linear(["gate_proj", "up_proj"]),
        down_proj=linear(["down_proj"]),
        q_norm=_optional(tensors, prefix + "q_norm", device) if config.qk_norm else None,
        k_norm=_optional(tensors, prefix + "k_norm", device) if config.qk_norm else None,
        post_attn_norm=_optional(tensors, prefix + "post_attn_norm", device) if config.post_norms else None,
        post_ffn_norm=_optional(tensors, prefix + "post_ffn_norm", device) if config.post_norms else None,
    )


class Transformer:
    """Forward pass over a ForwardBatch with a KVCache; returns logits of the requested rows."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], weight_format: str = "auto", device="cpu",
                 source: str = "", storage: TensorStorage | None = None,
                 parallel: TensorParallel | None = None) -> None:
        """weight_format: auto, q4, q4-all, q5, q8 or fp32 (models/layers.py: WEIGHT_FORMATS); storage: how the file
        stored the tensors (its Q4_K and Q6_K bytes load losslessly as q4 and q6; none: every tensor counts as fp32, so
        auto means q8).
        source: the catalogue name or path the weights came from ("" for models built in memory); it keys
        the measured cost profile of this model (engine/draft_length/).
        parallel: this process's rank in a tensor-parallel group (None: the whole model in this process); the rank
        keeps its slice of ``tensors`` (models/parallel.py), only rank 0 builds the output layer."""
        layer_format = resolved_weight_format(weight_format)  # auto is q5 on the avx2 path: the same bits
        storage = storage or TensorStorage()
        self.config = config
        self.source = source
        self.weight_format = weight_format
        self.device = torch.device(device)
        self.parallel = parallel if parallel is not None and parallel.world_size > 1 else None
        missing = self._missing_tensors(tensors)
        if missing:
            raise ValueError(f"checkpoint lacks tensors required by {config.architecture}: {', '.join(missing[:8])}")
        # this rank's part: its heads (the config its KV cache is made for) and its slices of the layers' weights
        self.shard_config = config
        if self.parallel is not None:
            plan = ShardPlan.build(config, self.parallel.world_size, self.parallel.rank, storage, layer_format)
            self.shard_config = plan.shard_config(config)
            tensors, storage = plan.tensors(tensors), plan.storage(storage)
        builds_lm_head = self.parallel is None or self.parallel.is_leader
        q4_copy = builds_lm_head and "lm_head" not in tensors and weight_format == "q4-all"
        embed = None  # [vocab, hidden] fp32, read only for fp32 and for q4-all's q4 copy of a tied table
        if weight_format == "fp32" or q4_copy:
            embed = tensors["embed_tokens"].float().to(self.device)
        self.embed_tokens = _embedding(tensors, storage, weight_format, embed, self.device)
        self.lm_head: Linear | None = None  # the workers of a tensor-parallel group compute no logits
        if builds_lm_head:
            if "lm_head" in tensors:
                self.lm_head = _linear(tensors, storage, ["lm_head"], None, layer_format, self.device)
            elif q4_copy:  # a q4 copy of the tied table: the output layer is a weight stream
                self.lm_head = Linear.build(embed, None, "q4")
            else:
                self.lm_head = self.embed_tokens
        self.norm = tensors["norm"].float().to(self.device)
        self.layers = [_build_layer(config, tensors, storage, i, layer_format, self.device)
                       for i in range(config.num_layers)]
        thetas = {config.layer_rope_theta(i) for i in range(config.num_layers)}
        self.rotary = {theta: RotaryTable(config.head_dim, theta, self.device) for theta in thetas}
        shard = self.shard_config
        self.qk_shape = QKNormRope(shard.num_heads, shard.num_kv_heads, shard.head_dim, shard.rms_norm_eps)
        # The last layer's key/value rows of qkv_proj (bit for bit the same weights): a prompt's rows that need no
        # logits only write keys/values there (see _trunk).
        q_size, kv_size = shard.num_heads * shard.head_dim, shard.num_kv_heads * shard.head_dim
        self._last_kv_proj = self.layers[-1].qkv_proj.rows(torch.arange(q_size, q_size + 2 * kv_size))

    def _missing_tensors(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        names = ["embed_tokens", "norm"]
        per_layer = [
            "attn_norm",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "ffn_norm",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
        if self.config.qkv_bias:
            per_layer += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if self.config.qk_norm:
            per_layer += ["q_norm", "k_norm"]
        if self.config.post_norms:
            per_layer += ["post_attn_norm", "post_ffn_norm"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head")
        names += [f"layers.{i}.{name}" for i in range(self.config.num_layers) for name in per_layer]
        return [name for name in names if name not in tensors]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache dtype this model runs with by default: fp16 beside int8 weights (half the cache's memory
        and reads; keys/values are rounded once when written, far below the int8 weights' own error), fp32 beside
        fp32 weights (the reference format, for parity with HF transformers)."""
        return torch.float32 if self.weight_format == "fp32" else torch.float16

    def _linears(self) -> list[Linear]:
        """Every linear this process holds (embedding table included; a tensor-parallel rank: its slices)."""
        separate_head = self.lm_head is not None and self.lm_head is not self.embed_tokens
        linears = [self.embed_tokens] + ([self.lm_head] if separate_head else [])
        for layer in self.layers:
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                linears += linear.parts
        return linears

    def linear_bytes(self) -> dict[str, int]:
        """Bytes of the linears (embedding table included) per format they run in: {"q4": ..., "q8": ...}."""
        totals: dict[str, int] = {}
        for linear in self._linears():
            totals[linear.format] = totals.get(linear.format, 0) + linear.nbytes()
        return totals

    @property
    def weight_nbytes(self) -> int:
        return sum(linear.nbytes() for linear in self._linears())

    def key_ranges(self, batch: ForwardBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per layer type, the keys each row attends: the cache positions [start, end) then the tree keys.

        Causal, and for sliding layers the window covers the last `sliding_window` logical positions
        (RoPE positions): a tree row's path keys sit at logical positions prefix_end, prefix_end + 1, ...
        """
        key_end = batch.prefix_ends  # [rows] int32
        ranges = {"full": (torch.zeros_like(key_end), key_end, batch.tree_keys)}
        if self.config.sliding_window:
            window_start = (batch.positions + 1 - self.config.sliding_window).clamp(min=0).to(torch.int32)  # [rows]
            ranges["sliding"] = (torch.minimum(window_start, key_end), key_end,
                                 _drop_leading_keys(batch.tree_keys, window_start - key_end))
        return ranges

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Writes the batch's keys/values into the cache and returns logits [logit rows, vocab] fp32."""
        return self.logits(self.forward_normed(batch, cache))

    @torch.inference_mode()
    def forward_normed(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """As forward, but stops before the output layer: the final-normed hidden state of the logit rows
        [logit rows, hidden], for a caller with its own rows of the output layer (a reduced draft vocabulary)."""
        hidden = self._trunk(batch, cache, batch.logits_rows)  # [logit rows, hidden]
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        """As forward, plus the final-normed hidden state of every row (same logits, bit for bit)."""
        hidden = rms_norm(self._trunk(batch, cache), self.norm, self.config.rms_norm_eps)  # [rows, hidden]
        return ForwardOutput(logits=self.logits(hidden[batch.logits_rows]), hidden=hidden)

    def logits(self, normed_hidden: torch.Tensor, lm_head: Linear | None = None) -> torch.Tensor:
        """normed_hidden [rows, hidden] (after the final norm) -> logits [rows, vocab] fp32; lm_head: some rows of
        the output layer instead of all of it (logits [rows, its rows])."""
        lm_head = lm_head or self.lm_head
        if lm_head is None:
            raise RuntimeError(f"rank {self.parallel.rank} of a tensor-parallel group holds no output layer: "
                               "logits are computed on rank 0")
        if normed_hidden.shape[0] == 0:  # a prefill chunk that ends no prompt
            return normed_hidden.new_empty(0, lm_head.out_features)
        logits = lm_head(normed_hidden)
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def forward_shard(self, command: TrunkCommand, cache: KVCache) -> None:
        """A worker of a tensor-parallel group: this rank's part of the forward the leader runs (the leader's
        TrunkCommand), writing this rank's heads' keys/values into its cache."""
        self._trunk(command.batch, cache, command.out_rows)

    def _trunk(self, batch: ForwardBatch, cache: KVCache, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding and every decoder layer: the residual stream [rows, hidden] before the final norm.

        out_rows [n] (the logit rows): the rows whose output is wanted, [n, hidden] returned. Every row still
        writes its keys/values in every layer, but the last layer computes its query, attention and MLP for
        these rows only — a prompt's other rows feed nothing after that (as llama.cpp's output-row selection).
        Each kernel is row-invariant, so the wanted rows come out bit for bit as in a full pass.
        The leader of a tensor-parallel group first sends the workers the same forward (forward_shard).
        """
        if self.parallel is not None and self.parallel.is_leader:
            self.parallel.send(TrunkCommand(batch, out_rows), cache)
        hidden = self.embed_tokens.embed(batch.token_ids)  # [rows, hidden]
        if self.config.embedding_scale != 1.0:
            hidden = hidden * self.config.embedding_scale
        ranges = self.key_ranges(batch)
        slots32 = batch.slots.to(torch.int32)
        max_position = int(batch.positions.max())
        last = len(self.layers) - 1
        if out_rows is not None and out_rows.shape[0] == hidden.shape[0]:
            out_rows = None  # every row is wanted (decode, verification)
        for index, layer in enumerate(self.layers):
            rows = out_rows if index == last else None
            attn_out = self._attention(
                index, layer, hidden, batch, cache, slots32, ranges[self.config.layer_type(index)], max_position, rows
            )
            hidden = (hidden if rows is None else hidden[rows]) + attn_out
            if hidden.shape[0]:
                hidden = hidden + self._mlp(layer, hidden)
        return hidden

    def _attention(self, index, layer: DecoderLayer, hidden, batch: ForwardBatch, cache: KVCache, slots32, key_range,
                   max_position: int, out_rows: torch.Tensor | None = None):
        """Attention output [rows, hidden], or [n, hidden] for out_rows [n] (the last layer only: every row's
        keys/values are still written)."""
        config = self.config
        rows = hidden.shape[0]
        normed = rms_norm(hidden, layer.attn_norm, config.rms_norm_eps)  # [rows, hidden]
        shard = self.shard_config  # this rank's heads (all of them without tensor parallelism)
        q_size, kv_size = shard.num_heads * shard.head_dim, shard.num_kv_heads * shard.head_dim
        cos, sin = self.rotary[config.layer_rope_theta(index)].tables(max_position)  # each [>= max_position + 1, D]
        if out_rows is None:
            qkv = layer.qkv_proj(normed)  # [rows, (H + 2 Hkv) * D]
        else:  # keys/values of every row; the query part left zero (its rows are not read)
            qkv = torch.cat([normed.new_zeros(rows, q_size), self._last_kv_proj(normed)], dim=1)
        # a view of qkv's columns (strided rows: the cache write reads them in place)
        value = qkv[:, q_size + kv_size :].unflatten(1, (shard.num_kv_heads, shard.head_dim))
        query, key = qk_norm_rope(qkv, self.qk_shape, layer.q_norm, layer.k_norm, cos, sin, batch.positions)
        cache.write(index, batch.slots, batch.cache_positions, key, value)
        key_start, key_end, tree_keys = key_range
        if out_rows is not None:
            if out_rows.shape[0] == 0:  # a prefill chunk that ends no prompt: its keys/values are all it gives
                return hidden.new_zeros(0, hidden.shape[1])
            query, _ = qk_norm_rope(layer.qkv_proj(normed[out_rows]), self.qk_shape, layer.q_norm, layer.k_norm,
                                    cos, sin, batch.positions[out_rows])
            slots32, key_start, key_end = slots32[out_rows], key_start[out_rows], key_end[out_rows]
            tree_keys = None if tree_keys is None else tree_keys[out_rows]
            rows = out_rows.shape[0]
        context = attention(query.contiguous(), cache.keys[index], cache.values[index], slots32, key_start, key_end,
                            config.scale, tree_keys)
        out = self._reduced(layer.o_proj(context.reshape(rows, q_size)))  # [rows, hidden]
        if layer.post_attn_norm is not None:
            out = rms_norm(out, layer.post_attn_norm, config.rms_norm_eps)
        return out

    def _mlp(self, layer: DecoderLayer, hidden):
        gate_up = layer.gate_up_proj(rms_norm(hidden, layer.ffn_norm, self.config.rms_norm_eps))  # [rows, 2 * inter]
        out = self._reduced(layer.down_proj(gated_activation(gate_up, self.config.activation)))  # [rows, hidden]
        if layer.post_ffn_norm is not None:
            out = rms_norm(out, layer.post_ffn_norm, self.config.rms_norm_eps)
        return out


    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output [rows, hidden]: the ranks' partial sums added in rank order (no-op on one
        process)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)


def _drop_leading_keys(tree_keys: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor | None:
    """tree_keys [rows, E] int32 (-1 pads) without each row's first max(0, counts[row]) keys."""
    if tree_keys is None:
        return None
    rows, width = tree_keys.shape
    padded = torch.cat([tree_keys, tree_keys.new_full((rows, 1), -1)], dim=1)  # [rows, E + 1]
    index = (torch.arange(width, device=tree_keys.device) + counts.clamp(min=0).long()[:, None]).clamp(max=width)
    return padded.gather(1, index)
