"""Loading checkpoints: GGUF files and Hugging Face directories, into one canonical fp32 layout.

Canonical tensor names (linear weights are ``[out_features, in_features]`` like ``torch.nn.Linear``,
rotary weights in HF's rotate-half layout, norm weights hold the effective multiplier):

    embed_tokens                       [vocab, hidden]
    layers.{i}.attn_norm               [hidden]
    layers.{i}.q_proj / k_proj / v_proj / o_proj   (+ ``.bias`` where the checkpoint has one)
    layers.{i}.q_norm / k_norm         [head_dim]   (qk_norm)
    layers.{i}.post_attn_norm          [hidden]     (Gemma)
    layers.{i}.ffn_norm                [hidden]
    layers.{i}.gate_proj / up_proj / down_proj
    layers.{i}.post_ffn_norm           [hidden]     (Gemma)
    norm                               [hidden]
    lm_head                            [vocab, hidden]  (only when not tied to embed_tokens)
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specdec.models.layers import BLOCK_STORAGE, TensorStorage
from specdec.models.tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message says which file and why."""


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]  # canonical name -> fp32 tensor (GGUF: dequantized when read)
    tokenizer: Tokenizer
    storage: TensorStorage = field(default_factory=TensorStorage)  # how the file stored them


def load_checkpoint(path: str | os.PathLike[str], keep_block_bytes: bool = False) -> Checkpoint:
    """Load a ``.gguf`` file or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).

    keep_block_bytes: also keep a GGUF's Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 tensors as their raw bytes
    (``checkpoint.storage``), from which the q4, q6, q8 and q5 formats load them losslessly."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such model file or directory: {path}")
    if path.is_dir():
        return load_hf_dir(path)
    return load_gguf(path, keep_block_bytes)


# ----------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"

# GGUF tensor leaf name -> canonical leaf name.
_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "post_ffw_norm": "post_ffn_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_GGUF_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GGUF_GLOBAL_PATTERN = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Gemma 3 (as llama.cpp hard-codes it): every 6th layer is global, local layers use rope base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def load_gguf(path: str | os.PathLike[str], keep_block_bytes: bool = False) -> Checkpoint:
    """Load a GGUF file: config from its metadata, fp32 tensors in canonical names, its tokenizer, and how the
    file stored each tensor (with the raw bytes of its block-quantized tensors when ``keep_block_bytes``)."""
    path = Path(path).expanduser()
    gguf_file = read_gguf_file(path)
    metadata = _GGUFMetadata(gguf_file.metadata, path)
    config = _gguf_config(metadata, gguf_file.tensors, path)
    _check_gguf_quant_types(gguf_file.tensors, path)
    tokenizer = _gguf_tokenizer(gguf_file.metadata, path)
    tensors = GGUFTensors(gguf_file, config, path)
    _check_tensor_set(tensors, config, path)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer,
                      storage=_gguf_storage(gguf_file, config, path, keep_block_bytes))


def _gguf_storage(gguf_file: GGUFFile, config: ModelConfig, path: Path, keep_block_bytes: bool) -> TensorStorage:
    """Each tensor's GGUF type, and (keep_block_bytes) the bytes of every 2-D Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 tensor,
    read from the file when looked up (GGUFBlockBytes)."""
    types = {_canonical_gguf_name(info.name, path): _ggml_type_name(info.ggml_type) for info in gguf_file.tensors}
    if not keep_block_bytes:
        return TensorStorage(types=types)
    return TensorStorage(types=types, block_bytes=GGUFBlockBytes(gguf_file, config, path))


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a ``.gguf`` file or Hugging Face directory alone, without reading the weights."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _hf_tokenizer(path)
    return _gguf_tokenizer(read_gguf_file(path).metadata, path)


def _gguf_tokenizer(metadata, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf(metadata)
    except ValueError as error:
        raise ModelLoadError(f"{path}: cannot build the tokenizer: {error}") from error


def _hf_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_hf_dir(path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {error}") from error


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order (outermost first): [out_features, in_features] for a linear weight
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # key -> int / float / bool / str / list
    tensors: list[GGUFTensorInfo]

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw bytes, shaped [..., bytes_per_row] as gguf.quants.dequantize expects (memory-mapped)."""
        data = np.memmap(self.path, dtype=np.uint8, mode="c", offset=info.offset, shape=(info.n_bytes,))
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return data.reshape(*info.shape[:-1], info.n_bytes // rows)


def read_gguf_file(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF header (metadata and tensor table) without touching tensor data.

    Much faster than ``gguf.GGUFReader`` on 250k-token vocabularies; raises ModelLoadError on damaged files.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        header = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        parsed = _GGUFHeaderParser(memoryview(header), path).parse()
    except _Truncated as error:
        raise ModelLoadError(f"{path} is truncated or corrupt: {error}") from None
    finally:
        del header
    metadata, tensors = parsed
    for info in tensors:
        if info.offset + info.n_bytes > file_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {info.name} ends at byte {info.offset + info.n_bytes} "
                f"but the file has {file_size} bytes"
            )
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


class _Truncated(Exception):
    pass


_GGUF_SCALARS = {  # GGUF value type -> (struct format, size)
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_MAX_GGUF_ITEMS = 1 << 28  # sanity bound on counts read from the header
_UINT64 = struct.Struct("<Q")


class _GGUFHeaderParser:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self._buffer = buffer
        self._position = 4
        self._path = path

    def parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        import gguf

        version = self._scalar(4)
        if version not in (2, 3):
            raise _Truncated(f"unsupported GGUF version {version} (or a big-endian file)")
        tensor_count = self._count(self._scalar(10))
        kv_count = self._count(self._scalar(10))
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._scalar(4))
        raw_infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise _Truncated(f"invalid general.alignment {alignment!r}")
        data_start = -(-self._position // alignment) * alignment
        tensors = []
        for name, shape, ggml_type, offset in raw_infos:
            try:
                block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ModelLoadError(
                    f"{self._path}: tensor {name} uses unknown quantization type id {ggml_type}"
                ) from None
            n_elements = math.prod(shape)
            if n_elements == 0:
                raise _Truncated(f"tensor {name} has an empty shape {shape}")
            if shape[-1] % block_size:
                raise _Truncated(f"tensor {name} row length {shape[-1]} is not a multiple of block {block_size}")
            n_bytes = n_elements // block_size * type_size
            tensors.append(GGUFTensorInfo(name, ggml_type, shape, data_start + offset, n_bytes))
        return metadata, tensors

    def _take(self, size: int) -> memoryview:
        end = self._position + size
        if end > len(self._buffer):
            raise _Truncated(f"header ends early (needs byte {end}, file has {len(self._buffer)})")
        chunk = self._buffer[self._position:end]
        self._position = end
        return chunk

    def _scalar(self, value_type: int) -> Any:
        fmt, size = _GGUF_SCALARS[value_type]
        return struct.unpack(fmt, self._take(size))[0]

    def _count(self, count: int) -> int:
        if count > _MAX_GGUF_ITEMS:
            raise _Truncated(f"implausible count {count} in the header")
        return count

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row, each a uint64 byte count then UTF-8 bytes, in one tight loop (a tokenizer's
        vocabulary: ~150k)."""
        buffer, position, file_size = self._buffer, self._position, len(self._buffer)
        read_size = _UINT64.unpack_from
        strings = []
        for _ in range(count):
            if position + 8 > file_size:
                raise _Truncated(f"header ends early (needs byte {position + 8}, file has {file_size})")
            size = self._count(read_size(buffer, position)[0])
            start, position = position + 8, position + 8 + size
            if position > file_size:
                raise _Truncated(f"header ends early (needs byte {position}, file has {file_size})")
            strings.append(str(buffer[start:position], "utf-8", "replace"))
        self._position = position
        return strings

    def _value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self._string()
        if value_type == _GGUF_ARRAY:
            item_type = self._scalar(4)
            count = self._count(self._scalar(10))
            if item_type == _GGUF_STRING:
                return self._strings(count)
            if item_type in _GGUF_SCALARS:
                fmt, size = _GGUF_SCALARS[item_type]
                return np.frombuffer(self._take(size * count), dtype=np.dtype(fmt)).tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _GGUF_SCALARS:
            raise _Truncated(f"unknown metadata value type {value_type}")
        return self._scalar(value_type)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar(4)
        if not 1 <= n_dims <= 4:
            raise _Truncated(f"tensor {name!r} has {n_dims} dimensions")
        dims = [self._count(self._scalar(10)) for _ in range(n_dims)]
        ggml_type = self._scalar(4)
        offset = self._scalar(10)
        return name, tuple(reversed(dims)), ggml_type, offset


class _GGUFMetadata:
    """Access to GGUF key/value metadata with precise errors."""

    def __init__(self, values: dict[str, Any], path: Path) -> None:
        self._values = values
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def require(self, key: str) -> Any:
        value = self._values.get(key)
        if value is None:
            raise ModelLoadError(f"{self._path}: GGUF metadata lacks required key {key!r}")
        return value


def _gguf_config(metadata: _GGUFMetadata, tensor_infos: list[GGUFTensorInfo], path: Path) -> ModelConfig:
    arch = metadata.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden_size = int(metadata.require(f"{arch}.embedding_length"))
    num_heads = int(metadata.require(f"{arch}.attention.head_count"))
    num_layers = int(metadata.require(f"{arch}.block_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    value_dim = int(metadata.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ModelLoadError(
            f"{path}: key_length {head_dim}, value_length {value_dim} and rope dimension {rope_dim} must be equal"
        )
    rope_scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_scaling not in ("none", None):
        raise ModelLoadError(f"{path}: rope scaling {rope_scaling!r} is not supported")

    tensor_names = {tensor.name for tensor in tensor_infos}
    embed = next((t for t in tensor_infos if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    common = dict(
        architecture=arch,
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden_size,
        intermediate_size=int(metadata.require(f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(metadata.require(f"{arch}.context_length")),
        rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        name=str(metadata.get("general.name", path.stem)),
    )
    if arch == "gemma3":
        common.update(_gemma3_extras(metadata, num_layers, hidden_size, num_heads, head_dim, path))
    return _make_config(common, path)


def _gemma3_extras(
    metadata: _GGUFMetadata, num_layers: int, hidden_size: int, num_heads: int, head_dim: int, path: Path
) -> dict[str, Any]:
    sliding_window = metadata.get("gemma3.attention.sliding_window")
    if sliding_window is None:
        raise ModelLoadError(f"{path}: gemma3 file lacks gemma3.attention.sliding_window")
    layer_types = tuple(
        "full" if (layer + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding" for layer in range(num_layers)
    )
    # query_pre_attn_scalar is not stored in GGUF; llama.cpp uses head_dim except for the 27B (62 layers),
    # whose HF config sets query_pre_attn_scalar = hidden_size / num_heads.
    query_pre_attn_scalar = hidden_size / num_heads if num_layers == 62 else head_dim
    return dict(
        sliding_window=int(sliding_window),
        layer_types=layer_types,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        attention_scale=query_pre_attn_scalar**-0.5,
        qk_norm=True,
        post_norms=True,
        embedding_scale=math.sqrt(hidden_size),
        activation="gelu_tanh",
    )


def _make_config(fields: dict[str, Any], path: Path) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as error:
        raise ModelLoadError(f"{path}: invalid model configuration: {error}") from error


def _check_gguf_quant_types(tensor_infos: list[GGUFTensorInfo], path: Path) -> None:
    supported = _dequantizable_types()
    for info in tensor_infos:
        if info.ggml_type not in supported:
            raise ModelLoadError(
                f"{path}: tensor {info.name} uses quantization type {_ggml_type_name(info.ggml_type)}, "
                f"which cannot be dequantized; supported: {', '.join(sorted(t.name for t in supported))}"
            )


def _dequantizable_types() -> set:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the block types gguf-py implements

    return set(_type_traits) | {GGMLQuantizationType.F32, GGMLQuantizationType.F16}


def _ggml_type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"


class GGUFTensors(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors in canonical names, dequantized to fp32 when read: each read is a new tensor, which
    its reader frees when done. A model is built one tensor at a time, so loading never holds the whole model in
    fp32 (Qwen2.5-Coder-1.5B: 7.1 GB) beside its quantized weights."""

    def __init__(self, gguf_file: GGUFFile, config: ModelConfig, path: Path) -> None:
        self._file, self._config, self._path = gguf_file, config, path
        self._infos = {_canonical_gguf_name(info.name, path): info for info in gguf_file.tensors}  # file order
        self._llama_heads = _llama_qk_heads(config) if config.architecture == "llama" else {}

    def __getitem__(self, name: str) -> torch.Tensor:
        value = _dequantize_gguf_tensor(self._file, self._infos[name], self._path)
        heads = self._llama_heads.get(name)
        return value if heads is None else unpermute_rope_rows(value, heads)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a 2-D tensor, fp32, dequantized alone: bit for bit those rows of ``self[name]`` (each
        row is its own blocks), without the whole tensor in fp32 (an embedding table: 933 MB for the 1.5B)."""
        info = self._infos[name]
        if len(info.shape) != 2 or name in self._llama_heads:  # llama's q/k rows are reordered: the whole tensor
            return self[name][start:end]
        row_bytes = info.n_bytes // info.shape[0]
        part = GGUFTensorInfo(info.name, info.ggml_type, (end - start, info.shape[1]), info.offset + start * row_bytes,
                              (end - start) * row_bytes)
        return _dequantize_gguf_tensor(self._file, part, self._path)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._infos[name].shape)


class GGUFBlockBytes(Mapping[str, torch.Tensor]):
    """A GGUF file's 2-D Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 tensors as their raw bytes, [out, in/256 * 144 (Q4_K) or 210
    (Q6_K)], [out, in/32 * 34 (Q8_0), 22 (Q5_0) or 18 (Q4_0)] uint8, in canonical names, with llama's q/k rows
    unpermuted as the fp32 tensors are (a row permutation: lossless on blocks). Each read copies the tensor's bytes out
    of the file into a new tensor, which its reader frees when its layer is built: loading never holds every tensor's
    bytes beside the layers built from them (Qwen2.5-Coder-1.5B: 1.1 GB)."""

    def __init__(self, gguf_file: GGUFFile, config: ModelConfig, path: Path) -> None:
        self._file = gguf_file
        self._infos = {}
        for info in gguf_file.tensors:
            if _ggml_type_name(info.ggml_type) in BLOCK_STORAGE and len(info.shape) == 2:
                self._infos[_canonical_gguf_name(info.name, path)] = info
        self._llama_heads = _llama_qk_heads(config) if config.architecture == "llama" else {}

    def __getitem__(self, name: str) -> torch.Tensor:
        raw = torch.from_numpy(np.array(self._file.tensor_bytes(self._infos[name])))  # a copy: the mapping is closed
        heads = self._llama_heads.get(name)
        return raw if heads is None else unpermute_rope_rows(raw, heads)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


def _canonical_gguf_name(gguf_name: str, path: Path) -> str:
    layer_match = _GGUF_LAYER_PATTERN.match(gguf_name)
    if layer_match:
        layer, leaf, kind = layer_match.groups()
        canonical_leaf = _GGUF_LAYER_NAMES.get(leaf)
        if canonical_leaf is not None:
            return f"layers.{layer}.{canonical_leaf}" + (".bias" if kind == "bias" else "")
    global_match = _GGUF_GLOBAL_PATTERN.match(gguf_name)
    if global_match:
        leaf, kind = global_match.groups()
        canonical = _GGUF_GLOBAL_NAMES.get(leaf)
        if canonical is not None:
            return canonical + (".bias" if kind == "bias" else "")
    raise ModelLoadError(f"{path}: unexpected tensor {gguf_name!r} (not part of the supported architectures)")


def _dequantize_gguf_tensor(gguf_file: GGUFFile, info: GGUFTensorInfo, path: Path) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ggml_type = GGMLQuantizationType(info.ggml_type)
    raw = gguf_file.tensor_bytes(info)  # [..., bytes_per_row] uint8, memory-mapped
    try:
        if ggml_type.name in _TORCH_DEQUANTIZERS:
            return _dequantize_with_torch(raw, ggml_type.name, info.shape)
        values = dequantize(raw, ggml_type).reshape(info.shape)  # float32 numpy
        if not values.flags.owndata or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32, order="C")  # detach from the memory-mapped file
    except (ValueError, NotImplementedError, OSError, RuntimeError) as error:
        raise ModelLoadError(f"{path}: cannot dequantize tensor {info.name} ({ggml_type.name}): {error}") from error
    return torch.from_numpy(values)


# ----------------------------------------------------------------------------------------------------------------
# Fast dequantization of the common block types with torch (multi-threaded; gguf-py's numpy code is the
# reference, see test_loader). Layouts follow ggml-quants.c.
# ----------------------------------------------------------------------------------------------------------------

_DEQUANT_CHUNK_VALUES = 1 << 19  # values per chunk: temporaries stay small enough for malloc to reuse them


def _dequantize_with_torch(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    block_elements, block_bytes, decode_into = _TORCH_DEQUANTIZERS[type_name]
    flat = torch.from_numpy(np.asarray(raw).reshape(-1))  # zero-copy view of the mapped file
    n_blocks = flat.numel() // block_bytes
    blocks = flat[: n_blocks * block_bytes].view(n_blocks, block_bytes)  # [n_blocks, block_bytes] uint8
    out = torch.empty(n_blocks, block_elements, dtype=torch.float32)  # [n_blocks, block_elements]
    chunk_blocks = max(1, _DEQUANT_CHUNK_VALUES // block_elements)
    for start in range(0, n_blocks, chunk_blocks):
        decode_into(blocks[start:start + chunk_blocks], out[start:start + chunk_blocks])
    return out.view(shape)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as fp32: [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles_into(packed: torch.Tensor, out: torch.Tensor) -> None:
    """packed [n, k] bytes -> out [n, 2k] floats: all low nibbles, then all high nibbles (ggml's order)."""
    k = packed.shape[1]
    out[:, :k].copy_(packed & 0x0F)
    out[:, k:].copy_(packed >> 4)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, q int8[32]
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, qs[16]
    _nibbles_into(blocks[:, 2:], out)
    out.sub_(8.0).mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, m f16, qs[16]
    _nibbles_into(blocks[:, 4:], out)
    out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _add_fifth_bits(qh_bytes: torch.Tensor, out: torch.Tensor) -> None:
    """out [n, 32] += 16 * bit j of the little-endian uint32 in qh_bytes [n, 4]."""
    bit_index = torch.arange(8, dtype=torch.uint8)
    bits = (qh_bytes.unsqueeze(-1) >> bit_index) & 1  # [n, 4, 8]
    out.add_(bits.reshape(-1, 32), alpha=16)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, qh u32, qs[16]
    _nibbles_into(blocks[:, 6:], out)
    _add_fifth_bits(blocks[:, 2:6], out)
    out.sub_(16.0).mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, m f16, qh u32, qs[16]
    _nibbles_into(blocks[:, 8:], out)
    _add_fifth_bits(blocks[:, 4:8], out)
    out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d * 6-bit scale and dmin * 6-bit min per 32-value sub-block, [n, 8, 1] each."""
    scales = blocks[:, 4:16]
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return (_f16(blocks, 0) * sc).unsqueeze(-1), (_f16(blocks, 2) * mins).unsqueeze(-1)


def _k_nibbles_into(qs: torch.Tensor, out: torch.Tensor) -> None:
    """qs [n, 128] -> out [n, 4, 2, 32]: per 32-byte chunk, low nibbles then high nibbles."""
    chunks = qs.reshape(-1, 4, 32)
    out[:, :, 0].copy_(chunks & 0x0F)
    out[:, :, 1].copy_(chunks >> 4)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d f16, dmin f16, scales[12], qs[128]
    n = blocks.shape[0]
    scale, offset = _k_scales_mins(blocks)
    _k_nibbles_into(blocks[:, 16:], out.view(n, 4, 2, 32))
    values = out.view(n, 8, 32)
    values.mul_(scale).sub_(offset)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d, dmin, scales[12], qh[32], qs[128]
    n = blocks.shape[0]
    scale, offset = _k_scales_mins(blocks)
    _k_nibbles_into(blocks[:, 48:], out.view(n, 4, 2, 32))
    values = out.view(n, 8, 32)
    bit_index = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    values.add_((blocks[:, 16:48].reshape(n, 1, 32) >> bit_index) & 1, alpha=16)  # fifth bits [n, 8, 32]
    values.mul_(scale).sub_(offset)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:  # ql[128], qh[64], scales int8[16], d f16
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32)  # per 128-value half: two 32-byte rows
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    values = out.view(n, 2, 4, 32)  # per half: 4 groups of 32 values
    values[:, :, 0:2].copy_(ql & 0x0F)
    values[:, :, 2:4].copy_(ql >> 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    values.add_((qh >> shifts) & 0x03, alpha=16).sub_(32.0)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)  # [n, 16], one per 16 values
    out.view(n, 16, 16).mul_((_f16(blocks, 208) * scales).unsqueeze(-1))


# type name -> (values per block, bytes per block, decoder)
_TORCH_DEQUANTIZERS = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
}


def _llama_qk_heads(config: ModelConfig) -> dict[str, int]:
    """The q/k tensors whose rows llama.cpp interleaved (canonical name -> heads): see unpermute_rope_rows."""
    return {f"layers.{layer}.{leaf}{suffix}": heads
            for layer in range(config.num_layers)
            for leaf, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads))
            for suffix in ("", ".bias")}


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: rows per head go from interleaved pairs to [first half, second half].

    weight: [num_heads * head_dim, ...] -> same shape.
    """
    rows = weight.shape[0]
    half_head = rows // num_heads // 2
    interleaved = weight.reshape(num_heads, half_head, 2, *weight.shape[1:])  # [heads, d/2, 2, ...]
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()


def _check_tensor_set(tensors: Mapping[str, torch.Tensor], config: ModelConfig, path: Path | str) -> None:
    expected = {"embed_tokens": (config.vocab_size, config.hidden_size), "norm": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        expected["lm_head"] = (config.vocab_size, config.hidden_size)
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    for layer in range(config.num_layers):
        prefix = f"layers.{layer}."
        expected.update({
            prefix + "attn_norm": (config.hidden_size,),
            prefix + "q_proj": (q_rows, config.hidden_size),
            prefix + "k_proj": (kv_rows, config.hidden_size),
            prefix + "v_proj": (kv_rows, config.hidden_size),
            prefix + "o_proj": (config.hidden_size, q_rows),
            prefix + "ffn_norm": (config.hidden_size,),
            prefix + "gate_proj": (config.intermediate_size, config.hidden_size),
            prefix + "up_proj": (config.intermediate_size, config.hidden_size),
            prefix + "down_proj": (config.hidden_size, config.intermediate_size),
        })
        if config.qkv_bias:
            expected.update({prefix + "q_proj.bias": (q_rows,), prefix + "k_proj.bias": (kv_rows,),
                             prefix + "v_proj.bias": (kv_rows,)})
        if config.qk_norm:
            expected.update({prefix + "q_norm": (config.head_dim,), prefix + "k_norm": (config.head_dim,)})
        if config.post_norms:
            expected.update({prefix + "post_attn_norm": (config.hidden_size,),
                             prefix + "post_ffn_norm": (config.hidden_size,)})
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    shape_of = tensors.shape if isinstance(tensors, GGUFTensors) else (lambda name: tuple(tensors[name].shape))
    for name, shape in expected.items():
        if shape_of(name) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {shape_of(name)}, expected {shape}")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directory
# ----------------------------------------------------------------------------------------------------------------

_HF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
_HF_LAYER_LEAVES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
    "post_feedforward_layernorm": "post_ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
}
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HF_LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER_LEAVES_BY_CANONICAL = {canonical: leaf for leaf, canonical in _HF_LAYER_LEAVES.items()}
_CANONICAL_LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.([a-z_]+)(\.bias)?$")
# Gemma's RMSNorm multiplies by (1 + w): HF files store w, canonical tensors (and GGUF files) the multiplier.
GEMMA_NORM_OFFSET = 1.0


def load_hf_dir(path: str | os.PathLike[str]) -> Checkpoint:
    """Load a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"no such model directory: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error
    hf_config = hf_config.get("text_config", hf_config) if hf_config.get("model_type") == "gemma3" else hf_config
    config = _hf_config(hf_config, path)
    raw = _read_safetensors(path)
    storage = TensorStorage()
    tensors = _canonical_hf_tensors(raw, config, path, storage)
    _check_tensor_set(tensors, config, path)
    return Checkpoint(config=config, tensors=tensors, tokenizer=_hf_tokenizer(path), storage=storage)


def _hf_config(hf: dict[str, Any], path: Path) -> ModelConfig:
    model_type = hf.get("model_type")
    arch = _HF_ARCHITECTURES.get(model_type)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {model_type!r}; supported: {', '.join(sorted(_HF_ARCHITECTURES))}"
        )
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_hf_rope_theta(hf, "full_attention", path),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
            name=str(hf.get("_name_or_path") or path.name),
        )
    except KeyError as error:
        raise ModelLoadError(f"{path}/config.json lacks required field {error.args[0]!r}") from error
    if arch == "gemma3":
        fields.update(_hf_gemma3_extras(hf, fields, path))
    return _make_config(fields, path)


def _hf_rope_theta(hf: dict[str, Any], layer_kind: str, path: Path) -> float:
    """rope base from either the pre-v5 fields or transformers v5's ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    if layer_kind in params:  # per layer type (Gemma 3 in transformers v5)
        params = params[layer_kind]
    rope_type = params.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"{path}: rope scaling {rope_type!r} is not supported")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if layer_kind == "sliding_attention" and "rope_local_base_freq" in hf:
        return float(hf["rope_local_base_freq"])
    return float(hf.get("rope_theta", 10000.0))


def _hf_gemma3_extras(hf: dict[str, Any], fields: dict[str, Any], path: Path) -> dict[str, Any]:
    num_layers = fields["num_layers"]
    hf_layer_types = hf.get("layer_types")
    if hf_layer_types:
        layer_types = tuple("sliding" if kind == "sliding_attention" else "full" for kind in hf_layer_types)
    else:
        pattern = int(hf.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
        layer_types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{path}: unsupported Gemma 3 activation {activation!r}")
    return dict(
        sliding_window=int(hf.get("sliding_window") or 4096),
        layer_types=layer_types,
        rope_local_theta=_hf_rope_theta(hf, "sliding_attention", path),
        attention_scale=float(hf.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
        qk_norm=True,
        post_norms=True,
        embedding_scale=math.sqrt(fields["hidden_size"]),
        activation="gelu_tanh",
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw.update(load_file(file))
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file} is truncated or corrupt: {error}") from error
    return raw


_SAFETENSORS_STORAGE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _canonical_hf_tensors(raw: dict[str, torch.Tensor], config: ModelConfig, path: Path,
                          storage: TensorStorage | None = None) -> dict[str, torch.Tensor]:
    """Canonical fp32 tensors; ``storage.types`` gets each one's dtype in the file (F32, F16, BF16)."""
    is_gemma = config.architecture == "gemma3"
    tensors: dict[str, torch.Tensor] = {}
    for hf_name in list(raw):
        stored_dtype = raw[hf_name].dtype
        value = raw.pop(hf_name).to(torch.float32)  # pop: free the original dtype copy as we go
        name = _canonical_hf_name(hf_name, is_gemma)
        if name is None:
            if hf_name.startswith(("vision", "multi_modal", "model.vision", "model.multi_modal")):
                continue
            raise ModelLoadError(f"{path}: unexpected tensor {hf_name!r}")
        if is_gemma and _is_norm(name):
            value = value + GEMMA_NORM_OFFSET
        tensors[name] = value.contiguous()
        if storage is not None:
            storage.types[name] = _SAFETENSORS_STORAGE.get(stored_dtype, str(stored_dtype))
    if config.tie_word_embeddings:
        tensors.pop("lm_head", None)
    return tensors


def _canonical_hf_name(hf_name: str, is_gemma: bool) -> str | None:
    if hf_name == "lm_head.weight":
        return "lm_head"
    stripped = next((hf_name[len(p):] for p in _HF_PREFIXES if hf_name.startswith(p)), None)
    if stripped is None:
        return None
    if stripped == "embed_tokens.weight":
        return "embed_tokens"
    if stripped == "norm.weight":
        return "norm"
    match = _HF_LAYER_PATTERN.match(stripped)
    if not match:
        return None
    layer, leaf, kind = match.groups()
    if leaf == "post_attention_layernorm":
        canonical_leaf = "post_attn_norm" if is_gemma else "ffn_norm"
    else:
        canonical_leaf = _HF_LAYER_LEAVES.get(leaf)
    if canonical_leaf is None:
        return None
    return f"layers.{layer}.{canonical_leaf}" + (".bias" if kind == "bias" else "")


def hf_tensor_name(name: str, architecture: str) -> str:
    """The Hugging Face name of a canonical tensor (inverse of the names ``load_hf_dir`` reads)."""
    if name == "lm_head":
        return "lm_head.weight"
    if name in ("embed_tokens", "norm"):
        return f"model.{name}.weight"
    match = _CANONICAL_LAYER_PATTERN.match(name)
    if match:
        layer, canonical_leaf, bias = match.groups()
        if canonical_leaf == ("post_attn_norm" if architecture == "gemma3" else "ffn_norm"):
            leaf = "post_attention_layernorm"
        else:
            leaf = _HF_LAYER_LEAVES_BY_CANONICAL.get(canonical_leaf)
        if leaf is not None and (architecture == "gemma3" or not leaf.endswith("_feedforward_layernorm")):
            return f"model.layers.{layer}.{leaf}" + (".bias" if bias else ".weight")
    raise ValueError(f"canonical tensor {name!r} has no Hugging Face name for architecture {architecture!r}")


def hf_tensor_value(name: str, value: torch.Tensor, architecture: str) -> torch.Tensor:
    """A canonical tensor as the Hugging Face file stores it (inverse of ``load_hf_dir``'s transform)."""
    return value - GEMMA_NORM_OFFSET if architecture == "gemma3" and _is_norm(name) else value


def _is_norm(name: str) -> bool:
    return name == "norm" or name.endswith("_norm")
