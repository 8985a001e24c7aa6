// specdec's CPU kernels: the int8 weight-only linear in two weight layouts, the 4- and 6-bit linears, range (and tree)
// attention, and the row-wise ops of a transformer layer, each with one fixed reduction order per output element
// that depends neither on the number of rows, nor on the other rows, nor on the thread count (row invariance).
//
// One binary holds every kernel path (scalar, avx2, avx512, amx); the path is chosen at run time, once per call
// at the top of each entry point (csrc/common.h: active_isa). All paths perform the same operations in the same
// order, so they give the same bits:
//   csrc/common.h          kernel paths and their selection, scratch, the vnni layout's units, threading helpers
//   csrc/scalar.h          the scalar path: the executable specification of every kernel
//   csrc/simd_avx512.h     the op set of 16 fp32 lanes on AVX-512 ...
//   csrc/simd_avx2.h       ... and on AVX2 + FMA + F16C (two ymm)
//   csrc/vector_kernels.h  attention and the row-wise kernels, written once over that op set
//   csrc/linear_avx512.h   the int8 linear, vnni layout, AVX-512 VNNI: one unit of K, a tile's sums
//   csrc/linear_walk.h     ... the walk over tiles, row blocks and K slices, the same for every vector path
//   csrc/linear_avx2.h     the int8 linear, vnni layout, AVX2 (and again with AVX-VNNI where the CPU has it)
//   csrc/linear_amx.h      the int8 linear, amx layout (AMX tiles, and AVX-512 VNNI for few rows)
//   csrc/linear_amx_avx2.h ... and on AVX2 (again with AVX-VNNI, as linear_avx2.h)
//   csrc/q4_scalar.h       the 4-bit linear (q4, GGUF Q4_K blocks): its layout, reduction order and scalar path
//   csrc/q4_avx512.h, q4_avx2.h   ... its vector paths (the amx path runs the avx512 one; q4_avx2.h is compiled
//                          again with AVX-VNNI, as linear_avx2.h)
//   csrc/q6_scalar.h       the 6-bit linear (q6, GGUF Q6_K blocks): its layout, reduction order and scalar path
//   csrc/q6_avx512.h, q6_avx2.h   ... its vector paths (as q4's)
//   csrc/q5_scalar.h       the 5-bit linear (q5, GGUF Q5_0 blocks): its layout and scalar path, bitwise the int8 linear
//   csrc/q5_avx2.h         ... its avx2 path: the int8 linear's walk with a unit decoding the 5-bit values in registers
//   csrc/q5_avx512.h, q5_walk.h   ... its avx512 path: each tile unpacked into the vnni layout, then the int8 linear's walk
//   csrc/block_walk.h      the walk of the q4 and q6 linears over tiles and row blocks, for every vector path
//   csrc/linear.h, q4_linear.h, q6_linear.h, q5_linear.h, attention.h, rowwise.h   the entry points
// This file includes them in order (the vector paths inside their own namespace and target) and binds them.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#if !(defined(__GNUC__) && defined(__x86_64__))
#error "specdec's kernels are written for x86-64 (GCC or Clang); elsewhere specdec runs its torch fallback"
#endif
#define SPECDEC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

#include "csrc/common.h"
#include "csrc/scalar.h"
#include "csrc/q4_scalar.h"
#include "csrc/q6_scalar.h"
#include "csrc/q5_scalar.h"
#include "csrc/q4_quantize.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "csrc/simd_avx2.h"
#include "csrc/vector_kernels.h"
#include "csrc/linear_avx2.h"
#include "csrc/linear_walk.h"
#include "csrc/linear_amx_avx2.h"
#include "csrc/q5_avx2.h"
#include "csrc/q4_avx2.h"
#include "csrc/q6_avx2.h"
#include "csrc/block_walk.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avx2_vnni {
#define SPECDEC_AVX_VNNI 1
#include "csrc/simd_avx2.h"
#include "csrc/linear_avx2.h"
#include "csrc/linear_walk.h"
#include "csrc/linear_amx_avx2.h"
#include "csrc/q5_avx2.h"
#include "csrc/q4_avx2.h"
#include "csrc/q6_avx2.h"
#include "csrc/block_walk.h"
#undef SPECDEC_AVX_VNNI
}  // namespace avx2_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,avx2,f16c")
namespace avx512 {
#include "csrc/simd_avx512.h"
#include "csrc/vector_kernels.h"
#include "csrc/linear_avx512.h"
#include "csrc/linear_walk.h"
#include "csrc/q5_avx512.h"
#include "csrc/q5_walk.h"
#include "csrc/q4_avx512.h"
#include "csrc/q6_avx512.h"
#include "csrc/block_walk.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,avx2,f16c,amx-tile,amx-int8")
namespace amx {
#include "csrc/linear_amx.h"
}  // namespace amx
#pragma GCC pop_options

#include "csrc/linear.h"
#include "csrc/q4_linear.h"
#include "csrc/q6_linear.h"
#include "csrc/q5_linear.h"
#include "csrc/attention.h"
#include "csrc/rowwise.h"

// ---- kernel path selection

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i)
    if (cpu_supports(Isa(i))) names.push_back(kIsaNames[i]);
  return names;
}

std::string isa() { return kIsaNames[static_cast<int>(active_isa())]; }

// Chooses the path every later call runs; one the CPU lacks is an error, never a silent fallback.
void set_isa(const std::string& name) {
  for (int i = 0; i < 4; ++i)
    if (name == kIsaNames[i]) {
      TORCH_CHECK(cpu_supports(Isa(i)), "specdec kernels: this CPU cannot run the ", name, " path");
      selected_isa().store(i);
      return;
    }
  TORCH_CHECK(false, "specdec kernels: unknown path '", name, "' (scalar, avx2, avx512, amx)");
}

// how many distinct threads at::parallel_for hands n single-item chunks to (a build without OpenMP: 1)
int64_t parallel_threads(int64_t n) {
  std::mutex mutex;
  std::set<int> seen;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(tid);
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "int8 weight x Q8_0 activation linear (row invariant)");
  m.def("q4_linear", &q4_linear, "4-bit weight (Q4_K blocks) x Q8_0 activation linear (row invariant)");
  m.def("q6_linear", &q6_linear, "6-bit weight (Q6_K blocks) x Q8_0 activation linear (row invariant)");
  m.def("q5_linear", &q5_linear, "5-bit weight (Q5_0 blocks) x Q8_0 activation linear, bitwise q8_linear's");
  m.def("q4_fit_sub_blocks", &q4_fit_sub_blocks, "quantize_q4's scale and min search per sub-block of 32 weights");
  m.def("avx_vnni", &cpu_has_avx_vnni, "whether the avx2 path runs its AVX-VNNI variant (CPU, SPECDEC_AVX_VNNI)");
  m.def("attention", &attention, "range attention (row invariant), optionally followed by extra keys per row",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("key_start"),
        py::arg("key_end"), py::arg("scale"), py::arg("extra_keys") = py::none());
  m.def("attention_split", &attention_split, "pairs per attention work item for groups of (row, head) pairs");
  m.def("rms_norm", &rms_norm, "row-wise RMS norm (row invariant)");
  m.def("qk_norm_rope", &qk_norm_rope, "split q/k from fused qkv, optional QK-norm, rotate-half RoPE");
  m.def("gated_activation", &gated_activation, "act(gate) * up from a fused gate_up projection (elementwise)");
  m.def("embedding_rows", &embedding_rows, "dequantized rows of a q8 weight (an embedding lookup)");
  m.def("embedding_rows_amx", &embedding_rows_amx, "dequantized rows of a q8 weight in the AMX layout");
  m.def("kv_write", &kv_write, "write keys/values at (slot, position) of fp32 or fp16 caches");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax, the first index of the maximum (torch.argmax's rule)");
  m.def("q8_linear_amx", &q8_linear_amx_layout, "int8 linear on the AMX weight layout (row invariant)");
  m.def("parallel_threads", &parallel_threads, "distinct threads at::parallel_for uses for n items");
  m.def("isa", &isa, "the kernel path calls run: scalar, avx2, avx512 or amx");
  m.def("supported_isas", &supported_isas, "the kernel paths this CPU can run, slowest first");
  m.def("set_isa", &set_isa, "run later calls on this kernel path (one the CPU supports)");
}
