"""Probe: where the avx2 int8 linear's time goes, part by part, with weights cached and streamed
(docs/kernels.md, "Where an avx2 tile's time goes at 8 rows").

    .venv/bin/python scripts/probes/avx2_walk_parts.py [--threads 2] [--rows 1,4,8] [--rounds 15]

Builds the avx2 path's walk of the vnni layout (csrc/linear_walk.h over csrc/linear_avx2.h, the AVX-VNNI variant
where the CPU has it) from this checkout's sources several times, each variant from a copy of csrc/ with one part
taken out by a text patch (the patched copies live in a temporary directory; the checkout is not changed):

    kernel          the sources as they are
    no epilogue     the fp32 scale epilogue left out (the int32 dots still computed)
    no prefetch     no software prefetch of the next tile
    prefetch +3     the software prefetch 4 tiles ahead instead of 1

Each variant's walk runs on the same random quantized weights and activations, straight from C++ (no activation
quantization, no Python, no torch threads: the weight rows split in equal halves over OpenMP threads). Shapes
640x1024 and 1536x1024 stay in the caches ("cached"); 640x65536 and 1536x8960 cycle through 4 copies of the
weight, read from DRAM as in a forward ("streamed"). The variants run interleaved, round after round, and the
table gives each one's median time per call and its ratio to the kernel's. Only timing: the variants without a part
give wrong numbers. The last table puts the streamed kernel beside its two bounds: the same work with the weights
cached (compute alone, scaled by the rows of the shape) and one row streamed (memory alone).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import load

CSRC = Path(__file__).resolve().parents[2] / "src" / "specdec" / "kernels" / "csrc"

HARNESS = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>
#define SPECDEC_X86 1
#include <cpuid.h>
#include <immintrin.h>
namespace {
#include "csrc/common.h"
#include "csrc/scalar.h"
#pragma GCC push_options
#if USE_VNNI
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define SPECDEC_AVX_VNNI 1
#else
#pragma GCC target("avx2,fma,f16c")
#endif
namespace walk {
#include "csrc/simd_avx2.h"
#include "csrc/linear_avx2.h"
#include "csrc/linear_walk.h"
}
#pragma GCC pop_options
}
// Median ns per call of the walk over weight rows [0, N) x activation rows [0, M) (the rows split over `threads`
// OpenMP threads in equal halves of whole tiles), cycling through `copies` copies of the weight.
std::vector<double> times(int64_t K, int64_t N, int64_t M, int64_t iters, int64_t copies, int64_t threads,
                          int64_t rounds) {
  const int64_t Kp = (K + 63) / 64 * 64;
  const Layout L(Kp);
  std::vector<uint8_t> W(copies * N * Kp);
  for (size_t i = 0; i < W.size(); ++i) W[i] = uint8_t((i * 2654435761u) >> 13);
  std::vector<uint16_t> ws(copies * N * (Kp / 32), 0x2000);
  std::vector<int8_t> X(M * Kp);
  for (size_t i = 0; i < X.size(); ++i) X[i] = int8_t(int64_t(i * 7919 % 255) - 127);
  std::vector<int32_t> corr(M * L.U * 16, 5);
  std::vector<float> xs(M * L.U * 16, 0.01f);
  std::vector<float> y(M * N);
  const int64_t part = (N / 4 + threads - 1) / threads * 4;
  std::vector<double> ns;
  for (int64_t r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t c = it % copies;
#pragma omp parallel for num_threads(threads)
      for (int64_t t = 0; t < threads; ++t)
        walk::linear_block(W.data() + c * N * Kp, X.data(), corr.data(), xs.data(), L, ws.data() + c * N * (Kp / 32),
                           nullptr, y.data(), N, t * part, std::min(N, (t + 1) * part), 0, M, Kp);
    }
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  return ns;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("times", &times); }
"""

EPILOGUE = "      add_scaled_lanes<NR, NP, MR, NB>(ia, wscale, ldw, b0, xs, ldc, u, h, n0, fa);"
NO_EPILOGUE = ("      for (int q = 0; q < NP; ++q)\n"
               "        for (int m = 0; m < MR; ++m) asm volatile(\"\" : : \"x\"(ia[q][m]));")
PREFETCH = "const uint8_t* pf = n + 2 * NR <= n1 ? W + (n + NR) * row_bytes : nullptr;"

# variant name -> (file, original text, replacement)
VARIANTS = {
    "kernel": None,
    "no epilogue": ("linear_avx2.h", EPILOGUE, NO_EPILOGUE),
    "no prefetch": ("linear_walk.h", PREFETCH, "const uint8_t* pf = nullptr;"),
    "prefetch +3": ("linear_walk.h", PREFETCH,
                    "const uint8_t* pf = n + 5 * NR <= n1 ? W + (n + 4 * NR) * row_bytes : nullptr;"),
}
SHAPES = [("cached", 640, 1024, 1), ("cached", 1536, 1024, 1), ("streamed", 640, 65536, 4),
          ("streamed", 1536, 8960, 4)]


def build(root: Path, name: str, patch, vnni: bool):
    """The harness over a copy of csrc/ with `patch` applied."""
    work = root / name.replace(" ", "_").replace("+", "p")
    shutil.copytree(CSRC, work / "csrc")
    if patch is not None:
        file, old, new = patch
        text = (work / "csrc" / file).read_text()
        if old not in text:
            raise SystemExit(f"{file}: the text this probe patches has changed; update the probe")
        (work / "csrc" / file).write_text(text.replace(old, new))
    (work / "harness.cpp").write_text(HARNESS)
    return load(name=f"specdec_walk_{work.name}_{int(vnni)}", sources=[str(work / "harness.cpp")],
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", f"-DUSE_VNNI={int(vnni)}"],
                extra_ldflags=["-fopenmp"], build_directory=str(work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    flags = open("/proc/cpuinfo").read()
    if " avx2" not in flags:
        raise SystemExit("this CPU has no AVX2")
    vnni = " avx_vnni" in flags
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as root:
        modules = {name: build(Path(root), name, patch, vnni) for name, patch in VARIANTS.items()}
        print(f"avx2 path ({'AVX-VNNI' if vnni else 'plain AVX2'}), {args.threads} threads, medians of "
              f"{args.rounds} interleaved rounds\n")
        print("| weights | shape | rows | " + " | ".join(modules) + " |")
        print("|---" * (3 + len(modules)) + "|")
        kernel: dict[tuple[int, int, int], float] = {}
        for kind, k, n, copies in SHAPES:
            for m in rows:
                iters = max(3, int(4e7 / (k * n * m)))
                samples: dict[str, list[float]] = {name: [] for name in modules}
                order = list(modules.items())
                for r in range(args.rounds):
                    for name, module in (order if r % 2 == 0 else order[::-1]):
                        samples[name] += module.times(k, n, m, iters, copies, args.threads, 1)
                medians = {name: statistics.median(v) / 1e3 for name, v in samples.items()}
                kernel[k, n, m] = medians["kernel"]
                cells = " | ".join(f"{us:.1f} µs ({us / medians['kernel']:.2f})" for us in medians.values())
                print(f"| {kind} | {k}x{n} | {m} | {cells} |")
        print("\n| shape | rows | streamed | compute alone (cached, scaled) | memory alone (1 row streamed) |"
              "\n|---|---|---|---|---|")
        for _, k, n, _ in SHAPES:
            if n < 4096:
                continue
            for m in rows:
                cached = kernel[k, 1024, m] * n / 1024
                print(f"| {k}x{n} | {m} | {kernel[k, n, m] / 1e3:.2f} ms | {cached / 1e3:.2f} ms | "
                      f"{kernel[k, n, 1] / 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
