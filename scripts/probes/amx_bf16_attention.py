"""Probe: attention scores on AMX-BF16 tiles against the FMA tiles of our attention kernel (docs/kernels.md,
"tried and not adopted").

    .venv/bin/python scripts/probes/amx_bf16_attention.py [--threads 1]

Two questions, on a CPU with AMX-BF16 (it says so and stops elsewhere):
1. What does TDPBF16PS compute? Random 16 x 16 tiles (bf16 operands spread over 2^±s) against two emulations:
   a chain of rounded fused multiply-adds in the SDM's operand order, and the exact sum rounded once. Without a
   match, no scalar path can reproduce its bits.
2. What would it cost? Scores of P query heads x L keys (one kv head, an fp16 key cache, hot), as the kernel's
   pass 1 computes them (4 heads x 4 keys per tile of 16 fp32 accumulators, a fixed reduction tree), against
   TDPBF16PS with exact bf16 splits (key = hi + lo, query = three parts, five products, two key blocks in flight),
   with their largest error against float64 relative to the largest score; and TDPBF16PS once more with the
   keys split beforehand (what a key cache kept as bf16 hi / lo planes would cost to read).

Not part of the package: a measurement to rerun, and the reason the kernel keeps its FMA tiles.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from fractions import Fraction

import numpy as np
import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};
bool amx_permitted() { static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0; return ok; }
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}
inline __m512 load_half16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 upper_half_bits(__m512 x) { return _mm512_and_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0xFFFF0000))); }
// two vectors of values exact in bf16 -> 32 bf16 (first vector in the low half)
inline __m512i pack_bf16(__m512 first, __m512 second) { return (__m512i)_mm512_cvtne2ps_pbh(second, first); }

// --- the committed kernel's pass-1 tile (a copy, for a like-for-like timing): 4 heads x 4 keys, 16 fp32
// accumulators, then one fixed 16-way reduction tree for the 16 scores
inline __m512 reduce16(const __m512* v) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
inline void fma_tile(const float* const* q, const uint16_t* k, int64_t D, float scale, float* const* s) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qv[4];
    for (int p = 0; p < 4; ++p) qv[p] = _mm512_loadu_ps(q[p] + d);
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = load_half16(k + j * D + d);
      for (int p = 0; p < 4; ++p) acc[4 * j + p] = _mm512_fmadd_ps(qv[p], kv, acc[4 * j + p]);
    }
  }
  const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  for (int p = 0; p < 4; ++p) _mm_storeu_ps(s[p], _mm512_extractf32x4_ps(r, p));
}

// --- AMX: keys as tile rows (A), query heads as tile columns (B, pairs of dims per dword)
inline void split_keys(const uint16_t* K, int64_t j0, int64_t D, uint16_t* A) {  // A [D/32][2 parts][16][32]
  for (int j = 0; j < 16; ++j)
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512 x0 = load_half16(K + (j0 + j) * D + c * 32), x1 = load_half16(K + (j0 + j) * D + c * 32 + 16);
      const __m512 h0 = upper_half_bits(x0), h1 = upper_half_bits(x1);
      _mm512_store_si512(A + ((c * 2 + 0) * 16 + j) * 32, pack_bf16(h0, h1));
      _mm512_store_si512(A + ((c * 2 + 1) * 16 + j) * 32, pack_bf16(_mm512_sub_ps(x0, h0), _mm512_sub_ps(x1, h1)));
    }
}
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}
// C [16 keys][16 heads] -> scores [head][j0 ..]
inline void store_scores(const float* C, int64_t P, float scale, float* s, int64_t L, int64_t j0) {
  if (P <= 4) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int64_t n = 0; n < P; ++n)
      _mm512_storeu_ps(s + n * L + j0, _mm512_mul_ps(_mm512_i32gather_ps(column, C + n, 4), _mm512_set1_ps(scale)));
    return;
  }
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(C + 16 * i);
  transpose16(r);
  for (int64_t n = 0; n < P; ++n) _mm512_storeu_ps(s + n * L + j0, _mm512_mul_ps(r[n], _mm512_set1_ps(scale)));
}
}  // namespace

// q [P, D] fp32 (P % 4 == 0), k [L, D] fp16 bits (L % 4 == 0) -> scores [P, L], `reps` times
torch::Tensor scores_fma(torch::Tensor q, torch::Tensor k, double scale, int64_t reps) {
  const int64_t P = q.size(0), D = q.size(1), L = k.size(0);
  auto s = torch::empty({P, L});
  const float* qp = q.data_ptr<float>();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  float* sp = s.data_ptr<float>();
  for (int64_t rep = 0; rep < reps; ++rep)
    for (int64_t j0 = 0; j0 < L; j0 += 128)  // the kernel's key blocks of 32 KB of fp32 keys at D = 64
      for (int64_t r0 = 0; r0 < P; r0 += 4) {
        const float* qs[4] = {qp + r0 * D, qp + (r0 + 1) * D, qp + (r0 + 2) * D, qp + (r0 + 3) * D};
        for (int64_t j = j0; j < std::min(L, j0 + 128); j += 4) {
          float* ss[4] = {sp + r0 * L + j, sp + (r0 + 1) * L + j, sp + (r0 + 2) * L + j, sp + (r0 + 3) * L + j};
          fma_tile(qs, kp + j * D, D, (float)scale, ss);
        }
      }
  return s;
}

// every key block split once: [L / 16][D / 32][2 parts][16 keys][32] bf16 bits (what a key cache stored as bf16
// hi / lo planes would hold)
torch::Tensor split_all_keys(torch::Tensor k) {
  const int64_t L = k.size(0), D = k.size(1);
  auto out = torch::empty({L / 16, D / 32, 2, 16, 32}, torch::kInt16);
  for (int64_t j0 = 0; j0 < L; j0 += 16)
    split_keys((const uint16_t*)k.data_ptr(), j0, D, (uint16_t*)out.data_ptr() + j0 * D * 2);
  return out;
}

// q [P <= 16, D] fp32 (D % 32 == 0), k [L, D] fp16 bits (L % 16 == 0) -> scores [P, L], `reps` times; with
// `presplit` (split_all_keys(k)) the keys are read as split instead of split here
torch::Tensor scores_amx(torch::Tensor q, torch::Tensor k, double scale, int64_t reps,
                         c10::optional<torch::Tensor> presplit) {
  TORCH_CHECK(amx_permitted(), "AMX tile state not granted");
  const int64_t P = q.size(0), D = q.size(1), L = k.size(0), NC = D / 32;
  auto s = torch::empty({P, L});
  const float* qp = q.data_ptr<float>();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  float* sp = s.data_ptr<float>();
  std::vector<uint32_t> b_mem(3 * NC * 256 + 16);
  uint32_t* B = (uint32_t*)(((uintptr_t)b_mem.data() + 63) & ~uintptr_t(63));  // [3 parts][NC][16 dim pairs][16 heads]
  const int64_t a_block = NC * 2 * 16 * 32;
  std::vector<uint16_t> a_mem(2 * a_block + 32);
  uint16_t* const a_own = (uint16_t*)(((uintptr_t)a_mem.data() + 63) & ~uintptr_t(63));  // two key blocks
  uint16_t* A = a_own;
  alignas(64) float C[2][16][16];
  configure_tiles();
  for (int64_t rep = 0; rep < reps; ++rep) {
    std::memset(B, 0, 3 * NC * 256 * 4);
    for (int64_t n = 0; n < P; ++n)
      for (int64_t c = 0; c < NC; ++c) {
        __m512 x0 = _mm512_loadu_ps(qp + n * D + c * 32), x1 = _mm512_loadu_ps(qp + n * D + c * 32 + 16);
        for (int part = 0; part < 3; ++part) {
          const __m512 h0 = upper_half_bits(x0), h1 = upper_half_bits(x1);
          alignas(64) uint32_t pairs[16];
          _mm512_store_si512(pairs, pack_bf16(h0, h1));
          for (int kk = 0; kk < 16; ++kk) B[((part * NC + c) * 16 + kk) * 16 + n] = pairs[kk];
          x0 = _mm512_sub_ps(x0, h0);
          x1 = _mm512_sub_ps(x1, h1);
        }
      }
    for (int64_t j0 = 0; j0 < L; j0 += 32) {
      const bool two = j0 + 16 < L;
      if (presplit.has_value()) {
        A = (uint16_t*)presplit->data_ptr() + j0 * D * 2;  // two consecutive blocks, a_block apart
      } else {
        A = a_own;
        split_keys(kp, j0, D, A);
        if (two) split_keys(kp, j0 + 16, D, A + a_block);
      }
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < NC; ++c) {  // products (q1,hi) (q1,lo) (q2,hi) (q2,lo) (q3,hi) per 32 dims
        _tile_loadd(2, A + c * 1024, 64);
        _tile_loadd(3, A + c * 1024 + 512, 64);
        if (two) { _tile_loadd(5, A + a_block + c * 1024, 64); _tile_loadd(6, A + a_block + c * 1024 + 512, 64); }
        _tile_loadd(4, B + (0 * NC + c) * 256, 64);
        _tile_loadd(7, B + (1 * NC + c) * 256, 64);
        _tile_dpbf16ps(0, 2, 4); if (two) _tile_dpbf16ps(1, 5, 4);
        _tile_dpbf16ps(0, 3, 4); if (two) _tile_dpbf16ps(1, 6, 4);
        _tile_dpbf16ps(0, 2, 7); if (two) _tile_dpbf16ps(1, 5, 7);
        _tile_dpbf16ps(0, 3, 7); if (two) _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(4, B + (2 * NC + c) * 256, 64);
        _tile_dpbf16ps(0, 2, 4); if (two) _tile_dpbf16ps(1, 5, 4);
      }
      _tile_stored(0, C[0], 64);
      store_scores(&C[0][0][0], P, (float)scale, sp, L, j0);
      if (two) { _tile_stored(1, C[1], 64); store_scores(&C[1][0][0], P, (float)scale, sp, L, j0 + 16); }
    }
  }
  _tile_release();
  return s;
}

// c [16, 16] fp32 + a [16 rows, 32 bf16] x b [16 dim pairs, 16 columns x 2 bf16], one TDPBF16PS
torch::Tensor tile_dot(torch::Tensor a, torch::Tensor b, torch::Tensor c) {
  TORCH_CHECK(amx_permitted(), "AMX tile state not granted");
  auto out = c.clone();
  configure_tiles();
  _tile_loadd(0, out.data_ptr(), 64);
  _tile_loadd(1, a.data_ptr(), 64);
  _tile_loadd(2, b.data_ptr(), 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out.data_ptr(), 64);
  _tile_release();
  return out;
}
#pragma GCC pop_options
"""


def has_amx_bf16() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "amx_bf16" in flags and "avx512_bf16" in flags


def round_to_fp32(value: Fraction) -> np.float32:
    """value rounded to the nearest fp32 (ties to even), exactly."""
    near = np.float32(float(value))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.array(c).view(np.int32)) & 1))


def semantics(ext, rounds: int = 12) -> None:
    generator = torch.Generator().manual_seed(1)
    for spread in (4, 12, 24):
        mismatches = {"fma chain": 0, "exact sum, one rounding": 0}
        worst = dict.fromkeys(mismatches, 0)
        for _ in range(rounds):
            def operand():
                scale = torch.exp2(torch.randint(-spread, spread, (16, 32), generator=generator).float())
                return (torch.randn(16, 32, generator=generator) * scale).to(torch.bfloat16)
            a_bf16, b_bf16 = operand(), operand()  # a [row, 32 values]; b [dim pair kk, column n x 2]
            acc_init = torch.randn(16, 16, generator=generator) * 10
            hardware = ext.tile_dot(a_bf16.view(torch.int16), b_bf16.view(torch.int16), acc_init).numpy()
            a_values, b_values = a_bf16.float().numpy(), b_bf16.float().numpy()
            for row in range(16):
                for col in range(16):
                    chain, exact = np.float32(acc_init[row, col]), Fraction(float(acc_init[row, col]))
                    for kk in range(16):
                        for i in (0, 1):
                            product = (Fraction(float(a_values[row, 2 * kk + i]))
                                       * Fraction(float(b_values[kk, 2 * col + i])))
                            chain = round_to_fp32(Fraction(float(chain)) + product)
                            exact += product
                    for name, emulated in (("fma chain", chain), ("exact sum, one rounding", round_to_fp32(exact))):
                        if emulated != hardware[row, col]:
                            mismatches[name] += 1
                            ulps = abs(int(np.array(emulated).view(np.int32))
                                       - int(np.array(hardware[row, col]).view(np.int32)))
                            worst[name] = max(worst[name], ulps)
        total = rounds * 256
        print(f"operands over 2^±{spread}: " + "; ".join(
            f"{name}: {mismatches[name]}/{total} outputs differ (up to {worst[name]} ulps)" for name in mismatches))


def timings(ext, repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    print("| head dim | keys | query heads | FMA tiles, µs | AMX-BF16, µs | AMX / FMA | AMX, keys split beforehand, µs "
          "| rel. error FMA | rel. error AMX |")
    print("|---|---|---|---|---|---|---|---|---|")
    for head_dim, keys, head_counts in ((64, 272, (3, 4, 8, 12, 16)), (128, 528, (6, 12, 16)), (256, 272, (4, 8, 16))):
        key_cache = torch.randn(keys, head_dim, generator=generator).half()
        key_planes = ext.split_all_keys(key_cache.view(torch.int16))
        for heads in head_counts:
            query = torch.randn(heads, head_dim, generator=generator) * 2
            padded = torch.cat([query, query.new_zeros((-heads) % 4, head_dim)])
            scale = head_dim ** -0.5
            reference = (query.double() @ key_cache.double().T) * scale  # [heads, keys]
            rel_error = lambda s: ((s.double() - reference).abs().max() / reference.abs().max()).item()
            fma_error = rel_error(ext.scores_fma(padded, key_cache.view(torch.int16), scale, 1)[:heads])
            amx_error = rel_error(ext.scores_amx(query, key_cache.view(torch.int16), scale, 1, None))
            assert torch.equal(ext.scores_amx(query, key_cache.view(torch.int16), scale, 1, key_planes),
                               ext.scores_amx(query, key_cache.view(torch.int16), scale, 1, None))
            calls = 100
            times = {"fma": [], "amx": [], "presplit": []}
            for _ in range(repeats):  # alternating, so that a slow spell of the machine hits both
                keys16 = key_cache.view(torch.int16)
                for name, run in (("fma", lambda: ext.scores_fma(padded, keys16, scale, calls)),
                                  ("amx", lambda: ext.scores_amx(query, keys16, scale, calls, None)),
                                  ("presplit", lambda: ext.scores_amx(query, key_cache.view(torch.int16), scale, calls,
                                                                      key_planes))):
                    start = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - start) / calls * 1e6)
            fma_us, amx_us, presplit_us = (statistics.median(times[name]) for name in ("fma", "amx", "presplit"))
            print(f"| {head_dim} | {keys} | {heads} | {fma_us:.2f} | {amx_us:.2f} | {amx_us / fma_us:.2f} | "
                  f"{presplit_us:.2f} | {fma_error:.1e} | {amx_error:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    if not has_amx_bf16():
        print("this CPU has no AMX-BF16; nothing to measure")
        return
    torch.set_num_threads(args.threads)
    ext = load_inline(name="specdec_amx_bf16_probe", cpp_sources=CPP, extra_cflags=["-O3", "-ffp-contract=off"],
                      functions=["scores_fma", "scores_amx", "split_all_keys", "tile_dot"])
    semantics(ext)
    timings(ext, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
