"""Row-invariant CPU kernels: int8 weight-only linear and range attention.

The compiled extension (``q8_kernels.cpp`` with ``csrc/*.h``) is built when the package is installed
(``setup.py``: ``specdec.kernels._q8``); where its sources were edited since (an editable install) or it is missing,
it is compiled with ``torch.utils.cpp_extension.load`` on first use (or by :func:`build_kernels`) into
``$XDG_CACHE_HOME/specdec/kernels/<digest>`` (see ``kernels/build.py``).

Guarantees of the CPU kernels. One binary holds four paths -- scalar (portable, the executable
specification), avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 VNNI) and amx (AMX-INT8 tiles) -- and runs the best
the CPU has (``SPECDEC_KERNEL_ISA=scalar|avx2|avx512|amx`` forces one the CPU supports, and refuses one it does
not). All paths perform the same operations in the same order on a weight layout and give the same bits (see
:func:`default_q8_layout` for the layouts):

* every output element is computed with a fixed reduction order that does not
  depend on the number of rows M, on the contents of the other rows, or on the
  number of threads -> a row's result is bitwise identical alone or in a block;
* a q8_linear call streams the weight once for all rows (M <= ~100), so a call
  with 8 rows costs about the same as with 1 row.

The fallback (tensors on CUDA, or extension unavailable) uses plain torch ops
(F.linear on a cached dequantized weight; a masked softmax attention).  It is
numerically close but NOT bitwise row invariant and does not quantize the
activations.

Set ``SPECDEC_DISABLE_KERNELS=1`` to force the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.kernels import build as _kernel_build

__all__ = [
    "QuantizedWeight",
    "argmax_rows",
    "quantize_weight",
    "q8_linear",
    "attention",
    "embedding",
    "rms_norm",
    "qk_norm_rope",
    "gated_activation",
    "kernels_available",
    "build_kernels",
    "kernel_isa",
    "supported_isas",
    "forced_isa",
    "kernel_build_id",
]

GROUP = 512  # 16 blocks of 32, interleaved (see q8_kernels.cpp)
CHUNK = 64  # K is padded to a multiple of CHUNK
BLOCK = 32  # activation quantization block


# --------------------------------------------------------------------------- build / load


def _build_dir() -> tuple[str, str]:
    """The development build's directory for the sources on disk, and their digest (flags: build_spec.py)."""
    digest = _kernel_build.source_digest()
    return str(_kernel_build.jit_build_dir(digest)), digest


_build_failures: list[str] = []  # why the extension could not be loaded (kernel_report's reason)


@functools.cache
def _build(verbose: bool = False):
    try:
        return _kernel_build.load_extension(verbose)
    except Exception as exc:
        _build_failures.append(f"{type(exc).__name__}: {exc}")
        raise


def build_kernels(verbose: bool = False):
    """Load the extension, compiling it first when the installed build is missing or older than the sources on disk
    (editable install); raises on failure. The module's ``build_origin`` says which ("installed" or a directory)."""
    return _build(verbose)


def build_failure() -> str | None:
    """Why the last attempt to build or load the extension in this process failed (None: it did not fail)."""
    return _build_failures[-1] if _build_failures else None


@functools.cache
def _load():
    """The loaded extension module with its ISA path chosen (``SPECDEC_KERNEL_ISA`` or the best the CPU runs), or
    None (disabled / build failed). A forced path the CPU cannot run raises: it is never replaced silently."""
    if os.environ.get("SPECDEC_DISABLE_KERNELS", "") not in ("", "0"):
        return None
    try:
        ext = _build()
    except Exception as exc:  # pragma: no cover - depends on the toolchain
        warnings.warn(f"specdec kernels unavailable, using torch fallback: {exc}", RuntimeWarning, stacklevel=2)
        return None
    forced = os.environ.get("SPECDEC_KERNEL_ISA", "")
    if forced:
        _check_isa(ext, forced, "SPECDEC_KERNEL_ISA")
        ext.set_isa(forced)
    return ext


KERNEL_ISAS = ("scalar", "avx2", "avx512", "amx")  # the kernel paths, slowest first; each gives the same bits


def _check_isa(ext, name: str, origin: str) -> None:
    if name not in KERNEL_ISAS:
        raise ValueError(f"{origin}={name!r}: choose one of {', '.join(KERNEL_ISAS)}")
    supported = list(ext.supported_isas())
    if name not in supported:
        raise RuntimeError(f"{origin}={name!r}: this CPU cannot run the {name} kernels "
                           f"(it runs {', '.join(supported)})")


def kernels_available() -> bool:
    """True if the compiled extension is loaded on this machine (builds it on first call)."""
    return _load() is not None


def kernel_isa() -> str:
    """The kernel path this process runs: 'amx', 'avx512', 'avx2', 'scalar' (the portable compiled path), or
    'torch' (the fallback: not row invariant)."""
    ext = _load()
    return "torch" if ext is None else ext.isa()


def avx_vnni_active() -> bool:
    """Whether this process runs the avx2 path's AVX-VNNI (`vpdpbusd`, VEX) variant: the avx2 path on a CPU with
    AVX-VNNI, unless ``SPECDEC_AVX_VNNI=0``."""
    ext = _load()
    return ext is not None and ext.isa() == "avx2" and bool(ext.avx_vnni())


def supported_isas() -> tuple[str, ...]:
    """The kernel paths this CPU can run, slowest first ('scalar' always; () without the extension)."""
    ext = _load()
    return () if ext is None else tuple(ext.supported_isas())


@contextlib.contextmanager
def forced_isa(name: str):
    """Runs the block on kernel path ``name`` (tests and A/B benchmarks), then restores the previous one.
    Weights packed before keep their layout: both layouts run on every path."""
    ext = _load()
    if ext is None:
        raise RuntimeError("the CPU kernels are not built")
    _check_isa(ext, name, "forced_isa")
    previous = ext.isa()
    ext.set_isa(name)
    try:
        yield
    finally:
        ext.set_isa(previous)


def kernel_build_id() -> str:
    """Which kernels run: 'q8-<hash of source, torch version and flags>-<isa>' of the extension this process
    loaded ('-avx2-vnni' where the avx2 path runs its AVX-VNNI variant), else 'torch' (fallback). Measured cost
    profiles are keyed by it, so a changed kernel or another ISA path is profiled again. It names the loaded build,
    not the source on disk: a process that outlives an edit of the source must not file what its old kernels
    measure under the new build's key."""
    ext = _load()
    if ext is None:
        return "torch"
    digest = getattr(ext, "build_digest", None) or ext.__name__.removeprefix("specdec_q8_")
    return "q8-" + digest + "-" + ext.isa() + ("-vnni" if avx_vnni_active() else "")


def parallel_threads(n: int) -> int:
    """Testing hook: how many distinct threads the extension's parallel loops use for n items (0: no extension)."""
    ext = _load()
    return 0 if ext is None else int(ext.parallel_threads(int(n)))


# --------------------------------------------------------------------------- weight layout


def _units(kp: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each unit of a row padded to kp: 512-column groups of 16 blocks, then the
    tail's blocks in units of 8, 4, 2 (largest first; see q8_kernels.cpp)."""
    groups = kp // GROUP
    units = [(16 * g, 16) for g in range(groups)]
    first, rest = 16 * groups, (kp % GROUP) // BLOCK
    for blocks in (8, 4, 2):
        if rest >= blocks:
            units.append((first, blocks))
            first, rest = first + blocks, rest - blocks
    return units


@functools.cache
def _pack_index(kp: int) -> torch.Tensor:
    """packed[:, p] = natural[:, idx[p]] for a row padded to kp (multiple of 64).

    In a unit of nb blocks, block i spreads over s = 16 / nb lanes of each 64-byte vector: packed byte
    j * 64 + lane * 4 + b of the unit holds value j * 4 * s + (lane % s) * 4 + b of block lane // s."""
    idx = torch.empty(kp, dtype=torch.long)
    for first, blocks in _units(kp):
        lanes_per_block = 16 // blocks
        j = torch.arange(blocks // 2).view(-1, 1, 1)
        lane = torch.arange(16).view(1, 16, 1)
        b = torch.arange(4).view(1, 1, 4)
        block = first + lane // lanes_per_block
        value = j * 4 * lanes_per_block + (lane % lanes_per_block) * 4 + b
        idx[first * BLOCK : (first + blocks) * BLOCK] = (block * BLOCK + value).reshape(-1)
    return idx


def _interleave_blocks(natural: torch.Tensor) -> torch.Tensor:
    """[N, Kp] -> the same bytes in packed column order: ``natural[:, _pack_index(Kp)]``, as one transpose per unit
    (a unit of nb blocks is [nb blocks][nb/2 vectors][16/nb lanes][4 bytes], packed [vectors][blocks][lanes][4]),
    which costs a fraction of the gather."""
    n, kp = natural.shape
    packed = torch.empty_like(natural)
    groups = kp // GROUP
    if groups:
        packed[:, : groups * GROUP] = natural[:, : groups * GROUP].view(n, groups, 16, 8, 4).transpose(2, 3).reshape(
            n, groups * GROUP)
    for first, blocks in _units(kp)[groups:]:
        columns = slice(first * BLOCK, (first + blocks) * BLOCK)
        packed[:, columns] = natural[:, columns].view(n, blocks, blocks // 2, 16 // blocks, 4).transpose(1, 2).reshape(
            n, blocks * BLOCK)
    return packed


@functools.cache
def _unpack_index(kp: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """natural[:, k] = packed[:, inv[k]]."""
    idx = _pack_index(kp)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(kp, dtype=torch.long)
    return inv.to(device)


NR = 4  # weight rows per kernel tile
AMX_ROWS = 16  # output rows per AMX weight tile
Q8_LAYOUTS = ("vnni", "amx")


def amx_available() -> bool:
    """True if this CPU has AMX-INT8 and the OS granted this process its tile state (needs the extension)."""
    return "amx" in supported_isas()


def default_q8_layout() -> str:
    """The weight layout `quantize_weight` packs for: "amx" when the kernels run on the amx path (one tile
    instruction per 16 output rows and block of 32 inputs) or the avx2 path (one scale epilogue per block and no
    horizontal sums: faster there at 1 to 64 rows, docs/kernels.md), else "vnni". ``SPECDEC_Q8_LAYOUT=vnni|amx``
    overrides it (to compare the two on one machine; both layouts run on every path)."""
    chosen = os.environ.get("SPECDEC_Q8_LAYOUT", "")
    if chosen:
        if chosen not in Q8_LAYOUTS:
            raise ValueError(f"SPECDEC_Q8_LAYOUT={chosen!r}: choose one of {', '.join(Q8_LAYOUTS)}")
        return chosen
    return "amx" if kernel_isa() in ("amx", "avx2") else "vnni"


def _pack_amx(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural signed int8 q [N, Kp] and fp16 block scales [N, Kp/32] -> the AMX layout (see q8_kernels.cpp):
    qweight int8 [Np, Kp] in memory order [Np/16][Kp/32 blocks][8][16 rows][4], tile_scale fp16 [Np/16, Kp/32, 16]."""
    n, kp = q.shape
    np_ = -(-n // AMX_ROWS) * AMX_ROWS
    if np_ != n:
        q = torch.cat([q, q.new_zeros(np_ - n, kp)])
        scale = torch.cat([scale, scale.new_zeros(np_ - n, scale.shape[1])])
    tiles, blocks = np_ // AMX_ROWS, kp // BLOCK
    packed = q.view(tiles, AMX_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(np_, kp)
    tile_scale = scale.view(tiles, AMX_ROWS, blocks).transpose(1, 2).contiguous()
    return packed, tile_scale


def _tile(packed: torch.Tensor) -> torch.Tensor:
    """Per-row packed [N, Kp] -> tile-interleaved memory (same shape, see QuantizedWeight)."""
    n, kp = packed.shape
    nf = n // NR * NR
    out = torch.empty_like(packed)
    out[:nf] = packed[:nf].view(nf // NR, NR, kp // CHUNK, CHUNK).transpose(1, 2).reshape(nf, kp)
    out[nf:] = packed[nf:]
    return out


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Symmetric int8 weight with one fp16 scale per output row and block of 32 inputs.

    ``qweight`` is ``[out_features, in_padded]`` **uint8** holding ``q + 128``
    (q in [-127, 127]) in the kernel's packed order, so that the kernel reads
    the weight as one sequential stream:

    * columns: K is zero padded (byte 128) to a multiple of 64; inside every
      run of 512 columns the columns are interleaved so that one 64-byte
      vector holds 4 values of each of 16 blocks of 32 (see
      ``q8_kernels.cpp``); the trailing ``in_padded % 512`` columns form units
      of 8, 4 and 2 blocks, interleaved the same way over 2, 4, 8 lanes per block;
    * rows: every tile of 4 consecutive rows is stored chunk-interleaved
      (memory order [tile][Kp/64 chunks][4 rows][64 bytes]); the last
      ``N % 4`` rows are stored plainly.  So ``qweight[i]`` is NOT row i:
      use :meth:`int8` for natural-order signed values and :meth:`from_int8`
      to build one from natural int8 data.
    ``scale`` is ``[out_features, in_padded // 32]`` **fp16**, one scale per row and
    block of 32 input columns (natural block order; the same blocks as the Q8_0
    activation quantization); ``w[n, k] ~= q[n, k] * scale[n, k // 32]`` (the
    product is exact in fp32).  Padding blocks have scale 0.

    ``layout`` "amx" (see :func:`default_q8_layout`): ``qweight`` is **int8** ``[N rounded up to 16, in_padded]``
    holding q itself, one 512-byte AMX tile per 16 rows and block of 32 (see ``q8_kernels.cpp``), and
    ``tile_scale`` ``[N/16, in_padded/32, 16]`` fp16 holds the same scales as ``scale`` in the kernel's order.
    The two layouts reduce in different fixed orders, so their outputs differ in the last bits; each is row
    invariant.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    in_features: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    layout: str = "vnni"
    tile_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    def clone(self) -> "QuantizedWeight":
        """A copy in new memory (benchmarks cycle through copies so that every call reads its weight from DRAM)."""
        tile_scale = None if self.tile_scale is None else self.tile_scale.clone()
        return QuantizedWeight(self.qweight.clone(), self.scale.clone(), self.in_features, layout=self.layout,
                               tile_scale=tile_scale)

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams: the packed weight and the scales the kernel reads."""
        scale = self.scale if self.tile_scale is None else self.tile_scale
        return self.qweight.numel() * self.qweight.element_size() + scale.numel() * scale.element_size()

    @property
    def in_padded(self) -> int:
        return self.qweight.shape[1]

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, layout: str | None = None) -> "QuantizedWeight":
        """Pack natural-order int8 ``q`` [N, K] (values in [-127, 127]) and per-block scales
        ``scale`` [N, ceil(K/32)] (or [N, Kp/32]; any float dtype, stored as fp16) in ``layout``
        (default: :func:`default_q8_layout`)."""
        n, k = q.shape
        kp = -(-k // CHUNK) * CHUNK
        nb = -(-k // BLOCK)
        if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] not in (nb, kp // BLOCK):
            raise ValueError(f"scale must be [{n}, {nb}] (one per row and block of {BLOCK}), got {tuple(scale.shape)}")
        sc = torch.zeros(n, kp // BLOCK, dtype=torch.float16, device=q.device)
        sc[:, :nb] = scale[:, :nb].to(device=q.device, dtype=torch.float16)
        natural = torch.zeros(n, kp, dtype=torch.int8, device=q.device)
        natural[:, :k] = q
        return cls._pack(natural, sc, k, layout)

    @classmethod
    def _pack(
        cls, natural: torch.Tensor, scale: torch.Tensor, in_features: int, layout: str | None
    ) -> "QuantizedWeight":
        """natural int8 [N, Kp] (zero padded), scale fp16 [N, Kp/32] -> the packed weight in layout."""
        layout = layout or default_q8_layout()
        if layout == "amx":
            packed, tile_scale = _pack_amx(natural, scale)
            return cls(packed, scale, in_features, layout="amx", tile_scale=tile_scale)
        if layout != "vnni":
            raise ValueError(f"unknown q8 layout {layout!r}; choose one of {', '.join(Q8_LAYOUTS)}")
        u8 = natural.view(torch.uint8) ^ 0x80  # q + 128 (two's complement with the top bit flipped)
        return cls(_tile(_interleave_blocks(u8)), scale, in_features)

    def int8(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Natural-order signed weights [N (or len(rows)), in_features] int8."""
        if self.layout == "amx":
            if rows is None:
                rows = torch.arange(self.out_features, device=self.qweight.device)
            rows = rows.to(device=self.qweight.device, dtype=torch.long)
            kp = self.in_padded
            tiles = self.qweight.view(-1, kp // BLOCK, 8, AMX_ROWS, 4)
            picked = tiles[rows // AMX_ROWS, :, :, rows % AMX_ROWS, :]  # [rows, blocks, 8, 4]
            return picked.reshape(rows.numel(), kp)[:, : self.in_features]
        n, kp = self.qweight.shape
        nf = n // NR * NR
        if rows is None:
            rows = torch.arange(n, device=self.qweight.device)
        rows = rows.to(device=self.qweight.device, dtype=torch.long)
        tiles = self.qweight[:nf].view(nf // NR, kp // CHUNK, NR, CHUNK)
        full = rows < nf
        qw = torch.empty(rows.numel(), kp, dtype=torch.uint8, device=self.qweight.device)
        if bool(full.any()):
            r = rows[full]
            qw[full] = tiles[r // NR, :, r % NR, :].reshape(-1, kp)
        if not bool(full.all()):
            qw[~full] = self.qweight[rows[~full]]
        return (qw.index_select(1, self.unpack_index()).to(torch.int16) - 128).to(torch.int8)

    def unpack_index(self) -> torch.Tensor:
        """[in_features] int64: the packed column of every natural column (cached per device)."""
        key = ("unpack", self.qweight.device)
        index = self._cache.get(key)
        if index is None:
            index = _unpack_index(self.in_padded, self.qweight.device)[: self.in_features].contiguous()
            self._cache[key] = index
        return index

    def _scales(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per-element fp32 scales [N (or len(rows)), in_features]."""
        s = self.scale if rows is None else self.scale.index_select(0, rows)
        return s.to(torch.float32).repeat_interleave(BLOCK, dim=1)[:, : self.in_features]

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] fp32 (exactly q * scale)."""
        return self.int8().to(torch.float32) * self._scales()


def dense_weight(weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The torch fallbacks' weight: ``weight.dequantize()`` [out, in] in ``dtype`` on ``device``, cached in
    ``weight._cache`` per dtype and device (any quantized weight: QuantizedWeight, Q4Weight, Q6Weight)."""
    key = (dtype, device)
    dense = weight._cache.get(key)
    if dense is None:
        dense = weight.dequantize().to(device=device, dtype=dtype)
        weight._cache[key] = dense
    return dense


def quantize_weight(weight: torch.Tensor, layout: str | None = None) -> QuantizedWeight:
    """Symmetric int8 per row and block of 32 inputs with fp16 scales, packed in ``layout`` (default:
    :func:`default_q8_layout`).

    The fp16 scale is chosen first: the nearest fp16 to amax/127, moved up one
    step if amax / scale would exceed 127 (so no value is clipped); then
    q = round(w / scale) (half to even), clamped to [-127, 127].  So
    |w - q * scale| <= scale / 2 for every element.  Blocks with amax below
    ~7.7e-3 get subnormal fp16 scales (coarser, absolute error <= 2**-25).
    """
    assert weight.dim() == 2, "weight must be [out_features, in_features]"
    w = weight.detach()
    return quantize_weight_rows(lambda r0, r1: w[r0:r1], tuple(w.shape), w.device, layout)


def quantize_weight_rows(read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int],
                         device: torch.device | str = "cpu", layout: str | None = None) -> QuantizedWeight:
    """:func:`quantize_weight` of a weight of ``shape`` [out, in] read a few thousand rows at a time
    (``read_rows(r0, r1)`` -> rows [r0, r1), fp32): the same weight bit for bit, without the whole of it in fp32."""
    n, k = shape
    kp = -(-k // CHUNK) * CHUNK
    nbp = kp // BLOCK
    scale = torch.zeros(n, nbp, dtype=torch.float16, device=device)
    natural = torch.zeros(n, kp, dtype=torch.int8, device=device)
    step = max(1, (1 << 24) // max(1, kp))  # bound the fp32 temporaries
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        wr = torch.zeros(r1 - r0, kp, dtype=torch.float32, device=device)
        wr[:, :k] = read_rows(r0, r1)
        wb = wr.view(r1 - r0, nbp, BLOCK)
        amax = wb.abs().amax(dim=2)
        s16 = (amax / 127.0).to(torch.float16)
        if not bool(torch.isfinite(s16).all()):
            raise ValueError("weight too large for fp16 block scales (|w| > 8.3e6) or not finite")
        up = amax / s16.to(torch.float32) > 127.0  # also catches scales that underflowed to 0
        s16 = torch.where(up, (s16.view(torch.int16) + 1).view(torch.float16), s16)
        s = s16.to(torch.float32)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(wb / safe[:, :, None]).clamp_(-127, 127).view(r1 - r0, kp)
        natural[r0:r1, :k] = q[:, :k].to(torch.int8)
        scale[r0:r1] = s16
    return QuantizedWeight._pack(natural, scale, k, layout)


# --------------------------------------------------------------------------- ops


def q8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] fp32.  Bitwise row invariant on the CPU kernel.

    Hot path: one cached-extension lookup, ``x.is_cpu`` and ``x.dim()``; all
    other checks (dtype, contiguity, shapes) are done in C++.
    """
    if x.is_cpu:
        ext = _load()
        if ext is not None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if weight.layout == "amx":
                y = ext.q8_linear_amx(rows, weight.qweight, weight.tile_scale, bias, weight.in_features,
                                      weight.out_features)
            else:
                y = ext.q8_linear(rows, weight.qweight, weight.scale, bias, weight.in_features)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
    return _q8_linear_torch(x, weight, bias)


def _q8_linear_torch(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    w = dense_weight(weight, dtype, x.device)
    y = F.linear(x.to(dtype), w, None if bias is None else bias.to(device=x.device, dtype=dtype))
    return y.to(torch.float32)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    scale: float,
    extra_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Range attention, optionally followed by a list of extra keys per row (tree attention).

    q [M, Hq, D]; k_cache, v_cache [S, Hkv, L, D], both fp32 or both fp16 (read as exact fp32 values, so the
    arithmetic is the same for both); slots, key_start, key_end int32 [M];
    extra_keys None or int32 [M, E]: cache positions, -1 = none (padding after a row's positions).
    Row m attends the logical key sequence ``key_start[m] .. key_end[m]-1`` followed by
    ``extra_keys[m, :]`` of slot ``slots[m]``; head h uses kv head ``h // (Hq // Hkv)``.  On the CPU
    kernel a row's result is bitwise the one the same keys give stored contiguously (a tree row equals
    the chain row of its path).  Returns [M, Hq, D] fp32 (zeros for an empty key sequence).
    """
    if q.is_cpu:
        ext = _load()
        if ext is not None:
            return ext.attention(q, k_cache, v_cache, slots, key_start, key_end, float(scale), extra_keys)
    return _attention_torch(q, k_cache, v_cache, slots, key_start, key_end, scale, extra_keys)


def attention_split(group_pairs: list[int], threads: int) -> list[int]:
    """How the CPU attention kernel cuts the (row, head) pairs of each (slot, kv head) group into work items for
    `threads` threads: the pairs of every item, in order. Only who computes a pair depends on it, never its result."""
    ext = _load()
    if ext is None:
        raise RuntimeError("the CPU kernels are not built")
    return list(ext.attention_split(list(group_pairs), threads))


def _attention_torch(q, k_cache, v_cache, slots, key_start, key_end, scale, extra_keys=None) -> torch.Tensor:
    m, hq, d = q.shape
    _, hkv, length, _ = k_cache.shape
    g = hq // hkv
    slots = slots.to(device=q.device, dtype=torch.long)
    n = int((key_end - key_start).max().item()) if m else 0
    pos = key_start.to(device=q.device, dtype=torch.long)[:, None] + torch.arange(max(n, 0), device=q.device)
    valid = pos < key_end.to(device=q.device, dtype=torch.long)[:, None]  # [M, n]
    if extra_keys is not None and extra_keys.shape[1]:
        extra = extra_keys.to(device=q.device, dtype=torch.long)  # [M, E]
        pos, valid = torch.cat([pos, extra.clamp(min=0)], dim=1), torch.cat([valid, extra >= 0], dim=1)
    if pos.shape[1] == 0 or not bool(valid.any()):
        return torch.zeros(m, hq, d, dtype=torch.float32, device=q.device)
    pos = pos.clamp(max=length - 1)
    # gather [M, Hkv, n, D], then fp32 (an fp16 cache converts exactly; only the gathered keys are converted)
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    k = k_cache[slots[:, None, None], heads, pos[:, None, :]].float()
    v = v_cache[slots[:, None, None], heads, pos[:, None, :]].float()
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,mhnd->mhn", q.float(), k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # empty ranges
    return torch.einsum("mhn,mhnd->mhd", p, v)


def embedding(token_ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """[n] token ids -> [n, in_features] fp32 dequantized rows (q * scale, exact as in ``dequantize``).

    On the CPU one kernel call gathers and dequantizes the rows (``embedding_rows``); the torch expression (CUDA,
    no extension) takes ~15 indexing ops, 0.4 ms of a 12 ms Gemma decode step."""
    ids = token_ids.reshape(-1).to(device=weight.qweight.device, dtype=torch.long)
    if weight.qweight.is_cpu:
        ext = _load()
        if ext is not None:
            if weight.layout == "amx":
                rows = ext.embedding_rows_amx(weight.qweight, weight.scale, ids, weight.in_features)
            else:
                rows = ext.embedding_rows(weight.qweight, weight.scale, ids, weight.unpack_index())
            return rows.view(*token_ids.shape, weight.in_features)
    rows = weight.int8(ids).to(torch.float32) * weight._scales(ids)
    return rows.view(*token_ids.shape, weight.in_features)


def kv_write(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> None:
    """key_cache, value_cache [slots, kv_heads, max_len, head_dim] fp32 or fp16; slots, positions [n];
    keys, values [n, kv_heads, head_dim]: cache[slots[i], :, positions[i]] = keys[i] rounded to the cache dtype
    (to nearest even, as ``tensor.to(torch.float16)``). One kernel call on the CPU instead of two indexed
    assignments (13 µs per layer, whatever the rows)."""
    if key_cache.is_cpu and not _needs_grad(keys, values):
        ext = _load()
        if ext is not None:
            ext.kv_write(key_cache, value_cache, slots, positions, keys, values)
            return
    key_cache[slots, :, positions] = keys.to(key_cache.dtype)
    value_cache[slots, :, positions] = values.to(value_cache.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row with torch.argmax's rule (the first index of the maximum; NaN rows as torch answers them):
    logits [n, vocab] fp32 -> ids [n] int64.

    The CPU kernel shares each row's pieces between the threads; torch.argmax walks a few long rows on one
    thread (1.2 ms for a Gemma verify block's 9 x 262144 logits).
    """
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 \
            and not _needs_grad(logits):
        ext = _load()
        if ext is not None:
            return ext.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden [..., dim] fp32, weight [dim] (the effective multiplier) -> [..., dim].

    Each row is normalised on its own with a fixed reduction order (16 lane sums, a fixed tree) on the
    CPU kernel; the fallback (CUDA, no extension, or autograd-tracked inputs) is the usual torch expression.
    """
    if hidden.is_cpu and hidden.dtype == torch.float32 and not _needs_grad(hidden, weight):
        ext = _load()
        if ext is not None:
            return ext.rms_norm(hidden, weight, float(eps))
    return _rms_norm_torch(hidden, weight, eps)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """The kernels have no backward: tensors that autograd tracks (training draft heads) take the torch path."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def _rms_norm_torch(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return hidden * torch.rsqrt(variance + eps) * weight


@dataclass(frozen=True)
class QKNormRope:
    """The fixed shape of one attention layer's query/key preparation."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def qk_norm_rope(
    qkv: torch.Tensor,
    shape: QKNormRope,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [tokens, (H + 2 Hkv) * D] -> (query [tokens, H, D], key [tokens, Hkv, D]).

    Splits query and key off the fused projection, applies the optional per-head RMS norm (QK-norm) and
    rotate-half RoPE at ``positions`` [tokens] from the tables ``cos``, ``sin`` [max positions, D], in
    one call on the CPU kernel (each token x head row on its own, row invariant); autograd-tracked inputs take
    the differentiable torch path.
    """
    if qkv.is_cpu and qkv.dtype == torch.float32 and not _needs_grad(qkv):
        ext = _load()
        if ext is not None:
            query, key = ext.qk_norm_rope(qkv, shape.num_heads, shape.num_kv_heads, shape.head_dim, q_norm, k_norm,
                                          float(shape.eps), cos, sin, positions)
            return query, key
    return _qk_norm_rope_torch(qkv, shape, q_norm, k_norm, cos, sin, positions)


def _qk_norm_rope_torch(qkv, shape: QKNormRope, q_norm, k_norm, cos, sin, positions):
    tokens, heads, kv_heads, dim = qkv.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
    query = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    key = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    if q_norm is not None:
        query = _rms_norm_torch(query, q_norm, shape.eps)
        key = _rms_norm_torch(key, k_norm, shape.eps)
    cos_rows, sin_rows = cos[positions][:, None, :], sin[positions][:, None, :]  # [tokens, 1, D]

    def rotate(states: torch.Tensor) -> torch.Tensor:
        half = dim // 2
        rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
        return states * cos_rows + rotated * sin_rows

    return rotate(query), rotate(key)


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (gate, then up) -> act(gate) * up [rows, inter]; activation "silu" or "gelu_tanh".

    The CPU kernel writes both activations as x * sigmoid(z) (GELU-tanh: z = 2·sqrt(2/π)·(x + 0.044715·x³)),
    vectorised, with the same per-element operations on every path; the fallback is torch's.
    """
    if gate_up.is_cpu and gate_up.dtype == torch.float32 and not _needs_grad(gate_up):
        ext = _load()
        if ext is not None:
            return ext.gated_activation(gate_up, activation)
    return _gated_activation_torch(gate_up, activation)


def _gated_activation_torch(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown activation {activation!r}; known: silu, gelu_tanh")
