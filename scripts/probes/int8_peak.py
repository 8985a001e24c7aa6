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
    ext = load_inline(name="specdec_int8_peak_probe", cpp_sources=CPP, functions=["run_chains"],
                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    paths = supported_paths()
    for missing in sorted(set(MACS_PER_ROUND) - set(paths)):
        print(f"({missing}: this CPU lacks it, skipped)")
    print("| path | threads | int8 multiply-adds per s | T(8) floor: " + " | ".join(MODEL_WEIGHTS) + " |")
    print("|---" * (3 + len(MODEL_WEIGHTS)) + "|")
    for path in paths:
        for threads in (int(t) for t in args.threads.split(",")):
            iters = 1000
            while True:  # grow the run to about --seconds
                start = time.perf_counter()
                ext.run_chains(path, iters, threads)
                if time.perf_counter() - start > args.seconds / 4:
                    break
                iters *= 4
            best = min(_timed(ext, path, iters, threads) for _ in range(5))
            peak = MACS_PER_ROUND[path] * iters * threads / best
            floors = " | ".join(f"{8 * weights / peak * 1e3:.1f} ms" for weights in MODEL_WEIGHTS.values())
            print(f"| {path} | {threads} | {peak / 1e9:.0f} G | {floors} |")


def _timed(ext, path: str, iters: int, threads: int) -> float:
    start = time.perf_counter()
    ext.run_chains(path, iters, threads)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
