"""The q5 weight format's rules: the file's Q5_0 layers run as q5 under weight_format="q5" (lossless), as q8 under
auto (lossless too where the file's bytes are kept, TensorStorage.exact_int8) except on the avx2 path, where auto is q5
(resolved_weight_format), as q4 under q4; a fused layer of Q5_0 and Q8_0 parts runs as a q5 part and a q8 part."""
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.cache.kv_cache import KVCache
from specdec.kernels import QuantizedWeight, avx_vnni_active, forced_isa, kernels_available, supported_isas
from specdec.kernels.ops import default_q8_layout
from specdec.models.batch import ForwardBatch
from specdec.models.layers import ConcatLinear, Linear, TensorStorage, resolved_weight_format
from specdec.models.transformer import Transformer
from tiny_models import random_int8_blocks, tiny_config, tiny_tensors

IN_FEATURES = 96  # no multiple of 256 (Q4_K's and Q6_K's rule), whole Q5_0 blocks


def _storage(names_and_types: dict[str, str], out_features: int = 8) -> tuple[TensorStorage, dict[str, torch.Tensor]]:
    storage, tensors = TensorStorage(), {}
    for seed, (name, storage_type) in enumerate(names_and_types.items()):
        storage.types[name] = storage_type
        if storage_type == "Q5_0":
            raw = random_int8_blocks(storage_type, out_features, IN_FEATURES, seed)
            storage.block_bytes[name] = torch.from_numpy(raw)
            tensors[name] = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q5_0)).view(out_features, -1)
        else:
            tensors[name] = torch.randn(out_features, IN_FEATURES) * 0.01
    return storage, tensors


@pytest.mark.parametrize("weight_format, expected", [("q5", "q5"), ("auto", "q8"), ("q4", "q4"), ("q8", "q8"),
                                                     ("q4-all", "q4")])
def test_q5_0_layers_format(weight_format, expected):
    storage, _ = _storage({"gate": "Q5_0", "up": "Q5_0"})
    assert storage.linear_format(["gate", "up"], IN_FEATURES, weight_format) == expected


def test_q5_layer_carries_the_files_values_and_q8s_bits():
    storage, tensors = _storage({"gate": "Q5_0", "up": "Q5_0"})
    names = ["gate", "up"]
    weight = torch.cat([tensors[name] for name in names])
    q5_linear = Linear.build(weight, None, "q5", storage.lossless_bytes(names, "q5"))
    # the same values as a q8 weight: Q5_0's -16..15 with its block scales, exact in int8
    exact_q8 = Linear(dense=None, quantized=q5_linear.blocks.as_q8(), bias=None)
    assert q5_linear.format == "q5" and torch.equal(q5_linear.blocks.dequantize(), weight)
    assert torch.equal(exact_q8.quantized.dequantize(), weight)
    x = torch.randn(5, IN_FEATURES)
    assert torch.equal(q5_linear(x), exact_q8(x))
    requantized = Linear.build(weight, None, "q8")  # without the file's bytes q8 rescales every block to +-127
    assert float((q5_linear(x) - requantized(x)).norm() / requantized(x).norm()) < 0.02
    assert q5_linear.nbytes() < 0.7 * requantized.nbytes()
    rows = torch.tensor([1, 9, 14])
    assert torch.equal(q5_linear.rows(rows)(x), q5_linear(x)[:, rows])


def test_q5_needs_the_files_blocks():
    with pytest.raises(ValueError, match="Q5_0 blocks"):
        Linear.build(torch.randn(8, IN_FEATURES), None, "q5")


def test_q5_0_and_q8_0_parts_of_a_fused_layer_run_side_by_side():
    """Gemma-3-270M's Q4_K_M stores q and k as Q5_0 and v as Q8_0 in half of its layers."""
    storage, tensors = _storage({"q": "Q5_0", "k": "Q5_0", "v": "Q8_0"})
    names = ["q", "k", "v"]
    parts = storage.linear_parts(names, IN_FEATURES, "q5")
    assert parts == [(["q", "k"], "q5"), (["v"], "q8")]
    assert storage.linear_parts(names, IN_FEATURES, "auto") == [(names, "q8")]
    built = ConcatLinear(tuple(
        Linear.build(torch.cat([tensors[name] for name in part]), None, fmt, storage.lossless_bytes(part, fmt))
        for part, fmt in parts))
    q5_part, q8_part = built.parts
    assert built.format == "q5+q8" and torch.equal(q5_part.blocks.dequantize(), torch.cat([tensors["q"], tensors["k"]]))
    x = torch.randn(3, IN_FEATURES)
    exact = torch.cat([Linear(dense=None, quantized=q5_part.blocks.as_q8(), bias=None)(x), q8_part(x)], dim=1)
    assert torch.equal(built(x), exact)
    assert isinstance(q8_part.quantized, QuantizedWeight)


def test_int8_storage_loads_as_q8_exactly_and_q5_gives_its_bits(monkeypatch):
    """Q8_0 and Q5_0 tensors keep their values in q8 (TensorStorage.exact_int8); a q5 layer of the same Q5_0 bytes
    gives the q8 layer's output bit for bit, so auto (q8) and q5 agree. q5 reduces in the vnni layout's order, so
    the q8 layer is packed in that layout (the amx layout, the amx path's default, reduces in another order)."""
    monkeypatch.setenv("SPECDEC_Q8_LAYOUT", "vnni")
    storage, tensors = _storage({"q": "Q5_0", "k": "Q5_0", "v": "Q8_0"})
    raw = random_int8_blocks("Q8_0", 8, IN_FEATURES, seed=7)
    storage.block_bytes["v"] = torch.from_numpy(raw)
    tensors["v"] = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q8_0)).view(8, -1)
    names = ["q", "k", "v"]
    weight = torch.cat([tensors[name] for name in names])
    exact = Linear.build(weight, None, "q8", exact_int8=storage.exact_int8(names, IN_FEATURES))
    assert torch.equal(exact.quantized.dequantize(), weight)
    x = torch.randn(6, IN_FEATURES)
    q5_part, q8_part = (
        Linear.build(torch.cat([tensors[n] for n in part]), None, fmt, storage.lossless_bytes(part, fmt),
                     storage.exact_int8(part, IN_FEATURES) if fmt == "q8" else None)
        for part, fmt in storage.linear_parts(names, IN_FEATURES, "q5"))
    assert torch.equal(ConcatLinear((q5_part, q8_part))(x), exact(x))
    # a value of -128 (outside q8's range) falls back to requantizing
    raw[0, 2] = np.uint8(0x80)
    storage.block_bytes["v"] = torch.from_numpy(raw.reshape(8, -1))
    assert storage.exact_int8(["v"], IN_FEATURES) is None
    assert storage.exact_int8(["q", "missing"], IN_FEATURES) is None


@pytest.mark.parametrize("weight_format, isa, avx_vnni, expected", [
    ("auto", "avx2", False, "q5"),  # q5 faster than q8 at every row count there, the same bits
    ("auto", "avx2", True, "auto"),  # the AVX-VNNI variant's q8: not measured against q5
    ("auto", "avx512", False, "auto"),  # q5 slower from 8 rows
    ("auto", "amx", False, "auto"),
    ("auto", "scalar", False, "auto"),
    ("auto", "torch", False, "auto"),
    ("q8", "avx2", False, "q8"),
    ("q4", "avx2", False, "q4"),
    ("q5", "avx512", False, "q5"),
    ("fp32", "avx2", False, "fp32"),
])
def test_resolved_weight_format(weight_format, isa, avx_vnni, expected):
    assert resolved_weight_format(weight_format, isa, avx_vnni) == expected


def test_resolved_weight_format_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="unknown weight format 'q3'"):
        resolved_weight_format("q3", "avx2", False)


def _tiny_q5_0_model():
    """A tiny Llama whose every linear layer the "file" stores as Q5_0 and whose embedding table as Q8_0."""
    config = tiny_config("llama")
    tensors, storage = tiny_tensors(config), TensorStorage()
    names = [f"layers.{index}.{leaf}" for index in range(config.num_layers)
             for leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    for name in ["embed_tokens", *names]:
        storage_type = "Q8_0" if name == "embed_tokens" else "Q5_0"
        out_features, in_features = tensors[name].shape
        raw = random_int8_blocks(storage_type, out_features, in_features, seed=len(storage.types))
        storage.types[name], storage.block_bytes[name] = storage_type, torch.from_numpy(raw)
        dequantized = gguf_dequantize(raw, getattr(GGMLQuantizationType, storage_type))
        tensors[name] = torch.from_numpy(dequantized).view(out_features, -1)
    return config, tensors, storage


def _logits(model: Transformer) -> torch.Tensor:
    cache = KVCache(model.config, 1, 32, model.device, dtype=model.kv_cache_dtype)
    return model.forward(ForwardBatch.build([[5, 17, 42, 5, 17, 42, 9]], [0], [0], all_logits=True), cache)


class _ShapedTensors(Mapping):
    """A checkpoint's tensors as a GGUF file's lazy mapping gives them (`shape` without dequantizing); records which
    were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors, self.read, self.row_reads = tensors, set(), []

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        self.row_reads.append((name, start, end))
        return self._tensors[name][start:end]


@pytest.mark.parametrize("weight_format", ["auto", "q5", "q8"])
def test_layers_built_from_the_files_data_are_never_dequantized(weight_format):
    """Q5_0 / Q8_0 layers and embedding table load from the file's bytes (q5) or int8 values (q8): the load reads
    only the norms, never the fp32 dequantization of those tensors, and gives the logits a load from the dequantized
    tensors gives."""
    config, tensors, storage = _tiny_q5_0_model()
    lazy = _ShapedTensors(tensors)
    model = Transformer(config, lazy, weight_format, storage=storage)
    assert lazy.read.isdisjoint(storage.types)
    assert torch.equal(_logits(model), _logits(Transformer(config, tensors, weight_format, storage=storage)))
    lazy = _ShapedTensors(tensors)
    Transformer(config, lazy, "fp32", storage=storage)  # fp32 has nothing but the dequantized weights
    assert set(storage.types) <= lazy.read


class _CountedBytes(Mapping):
    """A storage's block bytes, counting the reads of each tensor's."""

    def __init__(self, block_bytes: Mapping[str, torch.Tensor]) -> None:
        self._block_bytes, self.reads = block_bytes, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self._block_bytes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._block_bytes

    def __iter__(self):
        return iter(self._block_bytes)

    def __len__(self) -> int:
        return len(self._block_bytes)


@pytest.mark.parametrize("weight_format", ["auto", "q5", "q8", "q4"])
def test_a_load_reads_each_tensors_block_bytes_once_at_most(weight_format):
    """Block bytes a GGUF file's mapping reads when looked up (loader.GGUFBlockBytes) are read once per tensor that
    loads from them (every one here under auto, q5 and q8), never only to check a format; q4 requantizes the Q5_0
    layers and reads only the embedding table's."""
    config, tensors, storage = _tiny_q5_0_model()
    counted = _CountedBytes(storage.block_bytes)
    model = Transformer(config, tensors, weight_format, storage=TensorStorage(types=storage.types,
                                                                              block_bytes=counted))
    expected = set(storage.types) if weight_format != "q4" else {"embed_tokens"}
    assert counted.reads == {name: 1 for name in expected}
    assert torch.equal(_logits(model), _logits(Transformer(config, tensors, weight_format, storage=storage)))


def test_an_embedding_table_to_requantize_is_read_in_row_ranges():
    """An embedding table the file stores in a type q8 cannot take exactly (here fp32; a Q4_K or Q6_K table in real
    files) is quantized to q8 from row ranges, never read whole, to the very weight a whole read gives."""
    config = tiny_config("llama", vocab_size=300)
    tensors = tiny_tensors(config)
    lazy = _ShapedTensors(tensors)
    model = Transformer(config, lazy, "auto")
    assert "embed_tokens" not in lazy.read and lazy.row_reads[0] == ("embed_tokens", 0, 300)
    whole = Transformer(config, tensors, "auto")
    assert torch.equal(model.embed_tokens.quantized.qweight, whole.embed_tokens.quantized.qweight)
    assert torch.equal(_logits(model), _logits(whole))


def test_a_linear_without_its_weight_needs_the_files_data():
    with pytest.raises(ValueError, match="needs the weight, or its shape and the file's blocks or int8 values"):
        Linear.build(None, None, "q8", shape=(8, IN_FEATURES))


@pytest.mark.skipif(not kernels_available(), reason="the kernel paths need the compiled extension")
def test_auto_loads_q5_0_layers_per_path_with_the_same_logits(monkeypatch):
    """A model whose every linear layer is stored as Q5_0, loaded under auto on each kernel path the CPU runs: q5
    layers on the avx2 path (q8 where it runs its AVX-VNNI variant), q8 layers elsewhere, and the same logits bit for
    bit on every path. The amx and avx2 paths pack their q8 layers in the amx layout, which reduces in another order:
    their logits are those of the same model on the scalar path, and with the vnni layout those of every other path."""
    config, tensors, storage = _tiny_q5_0_model()
    logits = {}
    for isa in supported_isas():
        with forced_isa(isa):
            expected = "q5" if isa == "avx2" and not avx_vnni_active() else "q8"
            packs_amx = default_q8_layout() == "amx"  # its q8 layers (here q5 ones aside: the output layer)
            model = Transformer(config, tensors, "auto", storage=storage)
            logits[isa] = _logits(model)
        assert {layer.gate_up_proj.format for layer in model.layers} == {expected}, isa
        assert {layer.qkv_proj.format for layer in model.layers} == {expected}, isa
        layout = model.layers[0].gate_up_proj.quantized.layout if expected == "q8" else "vnni"
        assert layout == ("amx" if expected == "q8" and isa in ("amx", "avx2") else "vnni"), isa
        if packs_amx:
            with forced_isa("scalar"):
                assert torch.equal(_logits(model), logits[isa])
            with monkeypatch.context() as vnni_layout, forced_isa(isa):
                vnni_layout.setenv("SPECDEC_Q8_LAYOUT", "vnni")
                logits[isa] = _logits(Transformer(config, tensors, "auto", storage=storage))
    assert "avx2" in logits  # every CPU these tests run on has the avx2 path
    for isa, isa_logits in logits.items():
        assert torch.equal(isa_logits, logits["scalar"]), isa
