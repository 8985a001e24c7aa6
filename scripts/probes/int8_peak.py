"""Probe: the machine's int8 dot-product peak per kernel path, and the floor it puts under a forward of 8 rows
(docs/kernels.md, "How low T(8)/T(1) can go").

    .venv/bin/python scripts/probes/int8_peak.py [--threads 1,2] [--seconds 0.5]

Each thread runs 12 independent accumulator chains of the path's 4-byte-group dot product on registers (no memory
traffic): AVX-512 VNNI `vpdpbusd` (64 multiply-adds per instruction), AVX-VNNI's 256-bit `vpdpbusd` (32), which
the avx2 kernels use where the CPU has it ("avx2-vnni"), and the AVX2 sequence they use without it (`vpmaddubsw`,
`vpmaddwd`, `vpaddd`: 32 per sequence). The best of five timed runs gives
multiply-adds per second. A forward of n rows multiplies every streamed weight with every row at least once, so
T(n) >= n * weights / peak whatever the kernel; the table prints that floor for 8 rows beside a forward's weights.
A path the CPU lacks is skipped with a note.

A second table gives, for the avx2 kernels' paths, the ceiling of their int8 tile's structure at 8 rows: the inner
loop of a tile (blocks of 4 activation rows, passes of 2 weight rows, weights and activations read from L1, as
csrc/linear_avx2.h walks them) with and without its fp32 scale epilogue, as a share of the peak above. What a
kernel call runs below that ceiling is the walk around the loop (the weight stream, tiles, activation
quantization, threads).
"""
from __future__ import annotations

import argparse
import time

from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
static int64_t chains_vnni(int64_t iters) {
  __m512i acc[12];
  __m512i w = _mm512_set1_epi8(1);
  const __m512i x = _mm512_set1_epi8(2);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    __asm__ volatile("" : "+v"(w));
  }
  __m512i t = acc[0];
  for (int i = 1; i < 12; ++i) t = _mm512_add_epi32(t, acc[i]);
  return _mm512_reduce_add_epi32(t);
}
#pragma GCC pop_options

__attribute__((target("avx2"))) static int64_t sum_lanes(__m256i t) {
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), t);
  int64_t s = 0;
  for (int i = 0; i < 8; ++i) s += lanes[i];
  return s;
}

#pragma GCC push_options
#pragma GCC target("avx2,avxvnni")
static int64_t chains_avx_vnni(int64_t iters) {
  __m256i acc[12];
  __m256i w = _mm256_set1_epi8(1);
  const __m256i x = _mm256_set1_epi8(2);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], w, x);
    __asm__ volatile("" : "+v"(w));
  }
  __m256i t = acc[0];
  for (int i = 1; i < 12; ++i) t = _mm256_add_epi32(t, acc[i]);
  return sum_lanes(t);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
static int64_t chains_avx2(int64_t iters) {
  __m256i acc[12];
  __m256i w = _mm256_set1_epi8(1);
  const __m256i x = _mm256_set1_epi8(2);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    __asm__ volatile("" : "+v"(w));
  }
  __m256i t = acc[0];
  for (int i = 1; i < 12; ++i) t = _mm256_add_epi32(t, acc[i]);
  return sum_lanes(t);
}
#pragma GCC pop_options

// The inner loop of the avx2 kernels' int8 tile at 8 activation rows (csrc/linear_avx2.h: blocks of 4 rows, passes of
// 2 weight rows, one lane half at a time): per half unit, 8 accumulators start at the lane corrections, take 8 steps
// of (2 weight vectors, 4 activation vectors, 8 dots), all read from an L1-resident buffer, and, with `epilogue`,
// end in the kernel's fp32 scale epilogue (per weight row one fp16 scale vector; per accumulator a conversion, the
// activation scale times the weight scale, a multiply-add into an fp32 accumulator in memory). Without AVX-VNNI a dot
// is the kernel's signed sequence (vpsignb, vpmaddubsw, vpmaddwd, vpaddd).
struct TileData {
  alignas(64) uint8_t w[2][1024];
  alignas(64) int8_t x[4][1024];
  alignas(64) int32_t corr[4][8];
  alignas(64) float xs[4][8];
  alignas(64) uint16_t ws[2][8];
  alignas(64) float fa[2][4][8];
};

#define TILE_LOOP_BODY(DOT)                                                                                      \
  for (int64_t it = 0; it < iters; ++it)                                                                         \
    for (int u = 0; u < 1024; u += 256) {                                                                        \
      __m256i a[4], b[4];                                                                                        \
      for (int m = 0; m < 4; ++m) a[m] = b[m] = _mm256_load_si256(reinterpret_cast<const __m256i*>(d.corr[m]));  \
      _Pragma("GCC unroll 8") for (int j = u; j < u + 256; j += 32) {                                           \
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(&d.w[0][j]));                     \
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(&d.w[1][j]));                     \
        _Pragma("GCC unroll 4") for (int m = 0; m < 4; ++m) {                                                   \
          const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(&d.x[m][j]));                    \
          DOT(a[m], w0, x);                                                                                      \
          DOT(b[m], w1, x);                                                                                      \
          __asm__("" : "+x"(a[m]), "+x"(b[m]));                                                                  \
        }                                                                                                        \
      }                                                                                                          \
      if (epilogue) {                                                                                            \
        const __m256 s0 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d.ws[0])));            \
        const __m256 s1 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d.ws[1])));            \
        _Pragma("GCC unroll 4") for (int m = 0; m < 4; ++m) {                                                   \
          const __m256 xs = _mm256_load_ps(d.xs[m]);                                                             \
          _mm256_store_ps(d.fa[0][m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m]), _mm256_mul_ps(xs, s0),           \
                                                      _mm256_load_ps(d.fa[0][m])));                              \
          _mm256_store_ps(d.fa[1][m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(b[m]), _mm256_mul_ps(xs, s1),           \
                                                      _mm256_load_ps(d.fa[1][m])));                              \
        }                                                                                                        \
      } else {                                                                                                   \
        for (int m = 0; m < 4; ++m) __asm__ volatile("" : : "x"(a[m]), "x"(b[m]));                               \
      }                                                                                                          \
    }

static void fill(TileData& d) {
  for (int i = 0; i < 1024; ++i) {
    for (int n = 0; n < 2; ++n) d.w[n][i] = static_cast<uint8_t>(i * 7 + n * 13);
    for (int m = 0; m < 4; ++m) d.x[m][i] = static_cast<int8_t>((i * 5 + m * 11) % 255 - 127);
  }
  for (int m = 0; m < 4; ++m)
    for (int l = 0; l < 8; ++l) d.corr[m][l] = 0, d.xs[m][l] = 0.01f;
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 8; ++l) d.ws[n][l] = 0x2000;  // an fp16 scale
  for (int n = 0; n < 2; ++n)
    for (int m = 0; m < 4; ++m)
      for (int l = 0; l < 8; ++l) d.fa[n][m][l] = 0.f;
}

#pragma GCC push_options
#pragma GCC target("avx2,avxvnni,fma,f16c")
#define DOT_VNNI(acc, w, x) acc = _mm256_dpbusd_avx_epi32(acc, w, x)
static float tile_avx_vnni(int64_t iters, bool epilogue) {
  TileData d;
  fill(d);
  TILE_LOOP_BODY(DOT_VNNI)
  return d.fa[1][3][7];
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// the signed dot of the avx2 path: |w| times x with w's sign, pairs into int16, then into the int32 lanes
#define DOT_AVX2(acc, w, x) \
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), \
                                                _mm256_set1_epi16(1)))
static float tile_avx2(int64_t iters, bool epilogue) {
  TileData d;
  fill(d);
  TILE_LOOP_BODY(DOT_AVX2)
  return d.fa[1][3][7];
}
#pragma GCC pop_options

// iters rounds of the tile loop (8192 multiply-adds each) on each of `threads` threads
double run_tile(std::string path, int64_t iters, int64_t threads, bool epilogue) {
  double total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
  for (int64_t t = 0; t < threads; ++t)
    total += path == "avx2-vnni" ? tile_avx_vnni(iters, epilogue) : tile_avx2(iters, epilogue);
  return total;
}

// iters rounds of 12 chained dot-product instructions (or sequences) on each of `threads` threads
int64_t run_chains(std::string path, int64_t iters, int64_t threads) {
  int64_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
  for (int64_t t = 0; t < threads; ++t)
    total += path == "avx512" ? chains_vnni(iters) : path == "avx2-vnni" ? chains_avx_vnni(iters) : chains_avx2(iters);
  return total;
}
"""

MACS_PER_ROUND = {"avx512": 12 * 64, "avx2-vnni": 12 * 32, "avx2": 12 * 32}  # multiply-adds of one round of 12 chains
# weights a decode forward multiplies (the streamed linears; the embedding table is a gather), `specdec generate`'s
# kernel line at the default format
MODEL_WEIGHTS = {"Gemma-3-270M": 268e6, "Qwen2.5-Coder-0.5B": 494e6, "Qwen2.5-Coder-1.5B": 1544e6}


def supported_paths() -> list[str]:
    flags = open("/proc/cpuinfo").read()
    paths = []
    if " avx512_vnni" in flags:
        paths.append("avx512")
    if " avx_vnni" in flags:
        paths.append("avx2-vnni")
    if " avx2" in flags:
        paths.append("avx2")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--seconds", type=float, default=0.5, help="rough length of one timed run")
    args = parser.parse_args()
    ext = load_inline(name="specdec_int8_peak_probe", cpp_sources=CPP, functions=["run_chains", "run_tile"],
                      extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
    paths = supported_paths()
    for missing in sorted(set(MACS_PER_ROUND) - set(paths)):
        print(f"({missing}: this CPU lacks it, skipped)")
    print("| path | threads | int8 multiply-adds per s | T(8) floor: " + " | ".join(MODEL_WEIGHTS) + " |")
    print("|---" * (3 + len(MODEL_WEIGHTS)) + "|")
    thread_counts = [int(t) for t in args.threads.split(",")]
    peaks: dict[tuple[str, int], float] = {}
    for path in paths:
        for threads in thread_counts:
            peak = _rate(lambda iters: ext.run_chains(path, iters, threads), MACS_PER_ROUND[path] * threads,
                         args.seconds)
            peaks[path, threads] = peak
            floors = " | ".join(f"{8 * weights / peak * 1e3:.1f} ms" for weights in MODEL_WEIGHTS.values())
            print(f"| {path} | {threads} | {peak / 1e9:.0f} G | {floors} |")
    tile_paths = [path for path in paths if path in ("avx2-vnni", "avx2")]
    if not tile_paths:
        return
    print("\n| path | threads | tile loop, 8 rows: dots only | with the scale epilogue |\n|---|---|---|---|")
    for path in tile_paths:
        for threads in thread_counts:
            rates = [_rate(lambda iters: ext.run_tile(path, iters, threads, epilogue), TILE_MACS * threads,
                           args.seconds) for epilogue in (False, True)]
            cells = " | ".join(f"{rate / 1e9:.0f} G ({rate / peaks[path, threads]:.0%} of the peak)" for rate in rates)
            print(f"| {path} | {threads} | {cells} |")


TILE_MACS = 2 * 4 * 1024  # multiply-adds of one round of the tile loop (2 weight rows x 4 activation rows x 1024)


def _rate(run, macs_per_iter: int, seconds: float) -> float:
    """Multiply-adds per second of run(iters): the run grown to about `seconds`, the best of five timed runs."""
    iters = 1000
    while True:
        start = time.perf_counter()
        run(iters)
        if time.perf_counter() - start > seconds / 4:
            break
        iters *= 4
    best = min(_timed(run, iters) for _ in range(5))
    return macs_per_iter * iters / best


def _timed(run, iters: int) -> float:
    start = time.perf_counter()
    run(iters)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
