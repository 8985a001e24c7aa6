"""Probe: how fast one core reads memory from one sequential stream, and from several walked side by side
(docs/kernels.md, tried and not adopted).

    .venv/bin/python scripts/probes/read_streams.py [--threads 1,2] [--streams 1,2,3,4,8]

Each thread walks its share of a 192 MB buffer cut into S equal parts, 256 bytes of each part in turn, with one
vpdpbusd per 64-byte load (as a one-row int8 product does) and a prefetch 4 KB ahead in each part; the fastest of
six passes over fresh buffers is reported. Needs AVX-512 VNNI.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
static int64_t read_part(const uint8_t* p, int64_t n, int64_t streams) {
  const int64_t part = n / streams / 256 * 256;
  __m512i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i x = _mm512_set1_epi8(3);
  for (int64_t off = 0; off < part; off += 256)
    for (int64_t s = 0; s < streams; ++s) {
      const uint8_t* q = p + s * part + off;
      for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)q + 4096 + 64 * l, _MM_HINT_T0);
      for (int l = 0; l < 4; ++l)
        acc[(s * 4 + l) & 7] = _mm512_dpbusd_epi32(acc[(s * 4 + l) & 7], _mm512_loadu_si512(q + 64 * l), x);
    }
  __m512i t = acc[0];
  for (int i = 1; i < 8; ++i) t = _mm512_add_epi32(t, acc[i]);
  return _mm512_reduce_add_epi32(t);
}
// the buffer split evenly over `threads` threads, each walking its share as `streams` streams
int64_t read_streams(torch::Tensor buffer, int64_t streams, int64_t threads) {
  const uint8_t* p = buffer.data_ptr<uint8_t>();
  const int64_t share = buffer.numel() / threads;
  int64_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
  for (int64_t t = 0; t < threads; ++t) total += read_part(p + t * share, share, streams);
  return total;
}
#pragma GCC pop_options
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--streams", default="1,2,3,4,8")
    args = parser.parse_args()
    ext = load_inline(name="specdec_read_streams_probe", cpp_sources=CPP, functions=["read_streams"],
                      extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    buffers = [torch.randint(0, 255, (192 * 2**20,), dtype=torch.uint8) for _ in range(3)]
    stream_counts = [int(s) for s in args.streams.split(",")]
    print("| threads | " + " | ".join(f"{s} stream{'s' if s > 1 else ''}" for s in stream_counts) + " |")
    print("|---" * (len(stream_counts) + 1) + "|")
    for threads in (int(t) for t in args.threads.split(",")):
        cells = []
        for streams in stream_counts:
            rates = []
            for i in range(6):  # a different buffer each pass, so that none is read from the cache
                buffer = buffers[i % len(buffers)]
                start = time.perf_counter()
                ext.read_streams(buffer, streams, threads)
                rates.append(buffer.numel() / (time.perf_counter() - start) / 1e9)
            cells.append(f"{max(rates):.1f} GB/s (median {statistics.median(rates):.1f})")
        print(f"| {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
