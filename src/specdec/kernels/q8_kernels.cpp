// specdec q8 kernels: int8 weight-only linear (Q8_0-style activations) and
// range attention, with a reduction order per output element that does not
// depend on the number of rows M, on the other rows, or on the thread count.
//
// Weight layout ("packed", see ops.py): qweight [N, Kp] uint8, value = q + 128,
// Kp = K rounded up to a multiple of 64 (zero padded, i.e. byte 128).
// A row is a sequence of "units" of nb blocks of 32 values (nb*32 bytes):
//   * G = Kp / 512 groups of nb = 16 blocks, then
//   * the tail of Tb = (Kp % 512) / 32 blocks (even) split into units of
//     nb = 8, 4, 2 blocks (the binary digits of Tb, largest first).
// A unit is read as nb/2 zmm (64 bytes each); block i of the unit spreads over
// s = 16/nb lanes.  Byte j*64 + l*4 + b of the unit (j < nb/2, lane l, b < 4)
// holds value j*4*s + (l % s)*4 + b of block l / s.  So nb/2 vpdpbusd
// accumulate the exact int32 dot of each block in its s lanes, and every unit
// pays one scale epilogue: groups are lane-per-block (value 4*j + b), a unit
// of 2 blocks is plain natural order (lanes 0-7 block A, 8-15 block B).
// Rows are stored in tiles of 4: memory order [tile][Kp/64 chunks][4 rows][64 B],
// so one tile is read as a single sequential stream (the hardware prefetcher
// handles one long stream much better than 4 short ones); the last N % 4 rows
// are stored as plain rows.
// Weight scales: wscale [N, Kp/32] fp16, one per weight row and block of 32
// input values (natural block order), i.e. the same blocks as the activations.
// Lane l of a unit uses the scale of the unit's block l / s.
// Activations are quantized per row and block of 32 (scale = amax/127, round
// to nearest even) into the same layout.  For every unit the accumulator is
// initialised with -128 * sum(x_block) in the first lane of each block, which cancels
// the +128 bias of the unsigned weights exactly.  Then
//   facc[lane] = fma(float(iacc[lane]), xscale[lane] * wscale[lane], facc[lane])
// (the product rounded to fp32 first, -ffp-contract=off) and
// y = hsum16(facc) (+ bias[n]), hsum16 a fixed tree.
// The scalar path performs exactly the same operations lane by lane, so both
// paths give bitwise identical results.
//
// A second weight layout, "amx" (16-row tiles for AMX-INT8, chosen where the CPU has it), has its own fixed
// reduction order: see "int8 linear, AMX layout" below.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SPECDEC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kGroup = 512;
constexpr int64_t kChunk = 64;

bool g_force_scalar = false;

bool cpu_has_avx512vnni() {
#ifdef SPECDEC_X86
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

inline bool use_avx() { return !g_force_scalar && cpu_has_avx512vnni(); }

// exact fp16 -> fp32 (identical to vcvtph2ps)
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// --------------------------------------------------------------------------
// fixed-order helpers (scalar emulation of the SIMD trees)

inline float hsum16_scalar(const float* a) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  float t0 = t4[0] + t4[2];
  float t1 = t4[1] + t4[3];
  return t0 + t1;
}

// Cephes-style expf, same operation sequence as exp16_avx.
constexpr float kExpLo = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f,
                kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;

inline float exp_scalar(float x) {
  const float xc = std::max(x, kExpLo);
  const float fx = std::nearbyint(xc * kLog2e);
  float r = std::fma(fx, -kC1, xc);
  r = std::fma(fx, -kC2, r);
  const float r2 = r * r;
  float y = kP0;
  y = std::fma(y, r, kP1);
  y = std::fma(y, r, kP2);
  y = std::fma(y, r, kP3);
  y = std::fma(y, r, kP4);
  y = std::fma(y, r, kP5);
  y = std::fma(y, r2, r);
  y = y + 1.0f;
  const int32_t n = static_cast<int32_t>(fx);
  const int32_t bits = (n + 127) << 23;
  float p2;
  std::memcpy(&p2, &bits, 4);
  y = y * p2;
  return x < kExpLo ? 0.0f : y;
}

// --------------------------------------------------------------------------
// thread-local 64-byte aligned scratch

struct Scratch {
  std::unique_ptr<uint8_t[]> mem;
  size_t cap = 0;
  uint8_t* get(size_t bytes) {
    if (bytes + 64 > cap) {
      cap = std::max(bytes + 64, cap * 2);
      mem.reset(new uint8_t[cap]);
    }
    uintptr_t p = reinterpret_cast<uintptr_t>(mem.get());
    return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
  }
};

inline size_t align64(size_t v) { return (v + 63) & ~size_t(63); }

// The units of a row padded to Kp (see the top of the file): unit u covers blocks
// [b0(u), b0(u) + nb(u)), i.e. bytes [32 * b0(u), 32 * (b0(u) + nb(u))) of the packed row.
struct Layout {
  int64_t Kp, G, T, U;
  int tail_nb[3] = {0, 0, 0};
  explicit Layout(int64_t kp) : Kp(kp), G(kp / kGroup), T(0) {
    int64_t rest = (kp % kGroup) / 32;  // tail blocks, even
    for (int nb = 8; nb >= 2; nb /= 2)
      if (rest >= nb) {
        tail_nb[T++] = nb;
        rest -= nb;
      }
    U = G + T;
  }
  int nb(int64_t u) const { return u < G ? 16 : tail_nb[u - G]; }
  int64_t b0(int64_t u) const {
    if (u <= G) return u * 16;
    int64_t b = G * 16;
    for (int64_t t = 0; t < u - G; ++t) b += tail_nb[t];
    return b;
  }
};

constexpr int64_t kParallelRowValues = 8192;
// Runs rows(r0, r1) over [0, R) on the intra-op threads once the call has 2 rows or more and touches at least
// kParallelRowValues values (a prefill, or a verify block's activation; a decode step's row stays on one
// thread). Each row is computed alone, so the split has no influence on the result.
template <class Rows>
void parallel_rows(int64_t R, int64_t values, const Rows& rows) {
  if (values < kParallelRowValues || R < 2) {
    rows(0, R);
  } else {
    at::parallel_for(0, R, 1, rows);
  }
}

// Quantizes the nb blocks of 32 values starting at block b0 of one activation row xr (K values, zero beyond
// K): block l's values in natural order go to q[32 l .. 32 l + 32), its scale d = amax / 127 to d[l] and the
// sum of its int8 values to sum[l] (round to nearest even, clamp to +-127). d and sum have room for 16.
using QuantizeUnit = void (*)(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum);

// values of block k0 / 32 that lie within the row's K (the rest of the block is zero padding)
inline int64_t values_in_block(int64_t K, int64_t k0) { return std::max<int64_t>(0, std::min<int64_t>(32, K - k0)); }

void quantize_unit_scalar(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum) {
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const int64_t kn = values_in_block(K, k0);
    float amax = 0.0f;
    for (int64_t i = 0; i < kn; ++i) amax = std::max(amax, std::fabs(xr[k0 + i]));
    d[l] = amax / 127.0f;
    const float id = d[l] > 0.0f ? 1.0f / d[l] : 0.0f;
    sum[l] = 0;
    for (int i = 0; i < 32; ++i) {
      int v = 0;
      if (i < kn) {
        float r = std::nearbyint(xr[k0 + i] * id);
        r = std::min(127.0f, std::max(-127.0f, r));
        v = static_cast<int>(r);
      }
      q[32 * l + i] = static_cast<int8_t>(v);
      sum[l] += v;
    }
  }
}

// A unit of nb = 16 / S blocks from natural order (block l at q[32 l ..)) into the packed layout: 4-byte group
// (j * 16 + l * S + r) of the unit <- group (j * S + r) of block l. S is a constant so that each copy is one
// move (with S a variable the compiler merged them into a call of memcpy per block and group).
template <int S>
inline void scatter_unit(const int8_t* q, int8_t* qu) {
  constexpr int nb = 16 / S;
  for (int l = 0; l < nb; ++l)
    for (int j = 0; j < nb / 2; ++j) std::memcpy(qu + (j * 16 + l * S) * 4, q + 32 * l + j * S * 4, 4 * S);
}

// Quantize activation rows [m0, m1) into the packed layout, one unit at a time.
void quantize_rows(QuantizeUnit quantize_unit, const float* x, int64_t K, const Layout& L, int64_t m0, int64_t m1,
                   int8_t* xq, int32_t* corr, float* xs) {
  const int64_t ldc = L.U * 16;
  alignas(64) int8_t q[16 * 32];
  float d[16];
  int32_t sum[16];
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = xq + m * L.Kp;
    int32_t* cr = corr + m * ldc;
    float* sr = xs + m * ldc;
    std::memset(cr, 0, sizeof(int32_t) * ldc);
    for (int64_t u = 0; u < L.U; ++u) {
      const int nb = L.nb(u);
      const int s = 16 / nb;  // lanes per block
      const int64_t b0 = L.b0(u);
      quantize_unit(xr, K, b0, nb, q, d, sum);
      for (int l = 0; l < nb; ++l) {
        cr[u * 16 + l * s] = -128 * sum[l];
        for (int r = 0; r < s; ++r) sr[u * 16 + l * s + r] = d[l];
      }
      int8_t* qu = qr + b0 * 32;
      switch (s) {
        case 1: scatter_unit<1>(q, qu); break;
        case 2: scatter_unit<2>(q, qu); break;
        case 4: scatter_unit<4>(q, qu); break;
        default: scatter_unit<8>(q, qu); break;
      }
    }
  }
}

// --------------------------------------------------------------------------
// scalar linear tile (one weight row x one activation row)

// w: first chunk of the row, cs: byte distance between consecutive 64-byte chunks
// ws: the row's fp16 block scales [Kp/32]
void dot_row_scalar(const uint8_t* w, int64_t cs, const int8_t* x, const int32_t* corr, const float* xs, const Layout& L,
                    const uint16_t* ws, const float* bias, float* y) {
  float fa[16] = {0};
  int32_t ia[16];
  for (int64_t u = 0; u < L.U; ++u) {
    const int nb = L.nb(u);
    const int64_t b0 = L.b0(u);
    float wl[16];
    for (int l = 0; l < 16; ++l) wl[l] = half_to_float(ws[b0 + l / (16 / nb)]);
    const int steps = nb / 2;
    const int64_t off = b0 * 32;
    for (int l = 0; l < 16; ++l) ia[l] = corr[u * 16 + l];
    for (int j = 0; j < steps; ++j) {
      const uint8_t* wp = w + (off / 64 + j) * cs;
      const int8_t* xp = x + off + j * 64;
      for (int l = 0; l < 16; ++l) {
        int32_t s = 0;
        for (int b = 0; b < 4; ++b) s += int32_t(wp[l * 4 + b]) * int32_t(xp[l * 4 + b]);
        ia[l] += s;
      }
    }
    for (int l = 0; l < 16; ++l) {
      const float s = xs[u * 16 + l] * wl[l];
      fa[l] = std::fma(static_cast<float>(ia[l]), s, fa[l]);
    }
  }
  float v = hsum16_scalar(fa);
  if (bias) v = v + *bias;
  *y = v;
}

// A K/V cache element as fp32: an fp32 cache as it is, an fp16 cache (stored as its uint16_t bits) converted
// exactly (every fp16 value is an fp32 value), so the attention arithmetic is the same fp32 sequence for both.
inline float kv_value(float v) { return v; }
inline float kv_value(uint16_t h) { return half_to_float(h); }

// scalar attention for one (row, head) over n keys; key j is at cache position key_pos(j) of K / V
// (which point at position 0 of the (slot, kv head)).  The operation sequence depends only on the
// keys' order, not on where they are stored: a tree row whose keys are a prefix range plus its
// ancestors gives bitwise the result of the same keys stored contiguously.  T: the cache element type.
template <class KeyPos, class T>
void attn_keys_scalar(const float* q, const T* K, const T* V, int64_t n, KeyPos key_pos, int64_t D,
                      float scale, float* out, float* sbuf) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    float acc[16] = {0};
    const T* k = K + key_pos(j) * D;
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      for (int l = 0; l < 16 && d0 + l < D; ++l) acc[l] = std::fma(q[d0 + l], kv_value(k[d0 + l]), acc[l]);
    const float s = hsum16_scalar(acc) * scale;
    sbuf[j] = s;
    mx = std::max(mx, s);
  }
  float ps[16] = {0};
  for (int64_t j0 = 0; j0 < n; j0 += 16)
    for (int l = 0; l < 16 && j0 + l < n; ++l) {
      const float e = exp_scalar(sbuf[j0 + l] - mx);
      sbuf[j0 + l] = e;
      ps[l] = ps[l] + e;
    }
  const float sum = hsum16_scalar(ps);
  for (int64_t d = 0; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(sbuf[j], kv_value(V[key_pos(j) * D + d]), acc);
    out[d] = acc / sum;
  }
}

// scalar attention for one (row, head) over the contiguous keys [a, b)
template <class T>
void attn_row_scalar(const float* q, const T* K, const T* V, int64_t a, int64_t b, int64_t D, float scale,
                     float* out, float* sbuf) {
  attn_keys_scalar(q, K, V, b - a, [a](int64_t j) { return a + j; }, D, scale, out, sbuf);
}

// scalar attention for one (row, head) over the logical keys [a, b) then extra[0 .. ne)
template <class T>
void attn_tree_row_scalar(const float* q, const T* K, const T* V, int64_t a, int64_t b, const int32_t* extra,
                          int64_t ne, int64_t D, float scale, float* out, float* sbuf) {
  const int64_t np = b - a;
  attn_keys_scalar(q, K, V, np + ne, [a, np, extra](int64_t j) { return j < np ? a + j : int64_t(extra[j - np]); },
                   D, scale, out, sbuf);
}

// Gated activation of one element: act(gate) * up with act = GELU (tanh form) or SiLU, both written
// as x * sigmoid(z) = x / (1 + exp(-z)) (GELU-tanh: z = 2 * sqrt(2/pi) * (x + 0.044715 x^3));
// exp's argument is clamped at 88 so a very negative x gives 0 rather than an overflow.
constexpr float kGeluC = 0.7978845608028654f;
constexpr float kGeluA = 0.044715f;
constexpr float kExpHi = 88.0f;

inline float gated_scalar(float x, float up, bool gelu) {
  float t;
  if (gelu) {
    const float inner = x + kGeluA * (x * x * x);
    t = -2.0f * (kGeluC * inner);
  } else {
    t = -x;
  }
  t = std::min(t, kExpHi);
  return (x / (1.0f + exp_scalar(t))) * up;
}

}  // namespace

// --------------------------------------------------------------------------
// One piece of a row's argmax: its largest value, the first index holding it (offset added) and whether a NaN
// was seen (the caller then leaves the row to torch.argmax, whose NaN rule it keeps).
struct ArgmaxPart {
  float value;
  int64_t index;
  bool nan;
};

// Folds x[j, n) into part in index order: a NaN is noted, a strictly greater value replaces the maximum.
inline void argmax_scan(const float* x, int64_t j, int64_t n, ArgmaxPart& part) {
  for (; j < n; ++j) {
    if (std::isnan(x[j])) {
      part.nan = true;
    } else if (x[j] > part.value) {
      part.value = x[j];
      part.index = j;
    }
  }
}

ArgmaxPart argmax_range_scalar(const float* x, int64_t n, int64_t offset) {
  ArgmaxPart part{x[0], 0, std::isnan(x[0])};
  argmax_scan(x, 1, n, part);
  part.index += offset;
  return part;
}

// AVX-512 VNNI path

#ifdef SPECDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,avx2,f16c")
namespace {

inline float hsum16_avx(__m512 a) {
  const __m256 lo = _mm512_castps512_ps256(a);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// [hsum16_avx(a), hsum16_avx(b), hsum16_avx(c), hsum16_avx(d)] bitwise: the same tree of additions per
// vector, four vectors at a time (t8 = lo256 + hi256, t4 = t8[0:4] + t8[4:8], t2 = t4[0:2] + t4[2:4],
// t1 = t2[0] + t2[1]), with each vector's partial sums gathered into one register by shuffles.
inline __m128 hsum16x4_avx(__m512 a, __m512 b, __m512 c, __m512 d) {
  // t8 of a | t8 of b, and of c | d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lane i: t4 of vector i
  const __m512 t4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  // element 0 of lane i: t4[0] + t4[2], element 1: t4[1] + t4[3]
  const __m512 t2 = _mm512_add_ps(t4, _mm512_permute_ps(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  // element 0 of lane i: t2[0] + t2[1]
  const __m512 t1 = _mm512_add_ps(t2, _mm512_permute_ps(t2, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), t1));
}

inline __m512 exp16_avx(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(kExpLo));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-kC1), xc);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(-kC2), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, r2, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_cvttps_epi32(fx);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLo), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(y, under, _mm512_setzero_ps());
}

// NR weight rows x MR activation rows, full K.
// wscale: fp16 block scales of the first row of the tile, row stride Kp/32
// One unit of NB blocks starting at block b0 (unit index u): NB/2 vpdpbusd per (weight row, activation row)
// give the exact int32 dots of its blocks, then one scale epilogue adds them into fa.
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void unit_avx(const uint8_t* W, const int8_t* X, const int32_t* corr,
                                                    const float* xs, int64_t Kp, int64_t ldc, int64_t ldw, int64_t u,
                                                    int64_t b0, const uint16_t* wscale, const uint8_t* pf,
                                                    __m512 (&fa)[NR][MR]) {
  __m512i ia[NR][MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512i c = _mm512_loadu_si512(corr + m * ldc + u * 16);
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) ia[n][m] = c;
  }
  // W is the tile base: chunk q of row n is at W + (q * NR + n) * 64
  const uint8_t* wp = W + b0 * 32 * NR;
  const int8_t* xp = X + b0 * 32;
#pragma GCC unroll 8
  for (int j = 0; j < NB / 2; ++j) {
    __m512i w[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) w[n] = _mm512_loadu_si512(wp + (j * NR + n) * 64);
    if (pf) {
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + b0 * 32 * NR + (j * NR + n) * 64), _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(xp + m * Kp + j * 64);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) ia[n][m] = _mm512_dpbusd_epi32(ia[n][m], w[n], xv);
    }
  }
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n) {
    __m512 wsv;
    if constexpr (NB == 16) {
      wsv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wscale + n * ldw + b0)));
    } else {  // lane l takes the scale of block l / (16 / NB)
      constexpr int shift = NB == 8 ? 1 : NB == 4 ? 2 : 3;
      const __m512i block_of_lane =
          _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), shift);
      const uint16_t* src = wscale + n * ldw + b0;  // exactly NB halves: read no further
      __m128i h;
      if constexpr (NB == 8) {
        h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      } else if constexpr (NB == 4) {
        h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
      } else {
        int32_t two;
        std::memcpy(&two, src, sizeof(two));
        h = _mm_cvtsi32_si128(two);
      }
      wsv = _mm512_permutexvar_ps(block_of_lane, _mm512_castps256_ps512(_mm256_cvtph_ps(h)));
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(xs + m * ldc + u * 16), wsv);
      fa[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[n][m]), s, fa[n][m]);
    }
  }
}

// NR weight rows x MR activation rows over the units [u0, u1) of K. The accumulators start at zero when u0 == 0
// and from partial[n * MR ... ] (the sums of the units before u0, stored exactly) otherwise; when u1 == L.U the
// tile ends: y = hsum16(fa) (+ bias); otherwise fa is stored back into partial. The units are added into fa in
// the same order however K is split, so a K-split tile is bitwise the unsplit one. Sliced = false: the whole
// of K (u0 = 0, u1 = L.U, no partial), compiled without the slice bookkeeping.
// Always inlined: left to itself the compiler made it a call per tile, 3-6 % of a one-row call over Gemma's
// output layer (65536 tiles of 2.5 KB).
template <int NR, int MR, bool Sliced>
__attribute__((always_inline)) inline void tile_avx(const uint8_t* W, const int8_t* X, const int32_t* corr,
                                                    const float* xs, const Layout& L, const uint16_t* wscale,
                                                    const float* bias, float* y, int64_t ldy, const uint8_t* pf,
                                                    int64_t u0, int64_t u1, __m512* partial) {
  if constexpr (!Sliced) {
    u0 = 0;
    u1 = L.U;
  }
  const int64_t Kp = L.Kp;
  const int64_t ldc = L.U * 16;
  const int64_t ldw = Kp / 32;
  // the scales of the next tile (contiguous after this tile's) are a separate
  // small stream: fetch them early so their misses overlap this tile's work
  if (u0 == 0)
    for (int64_t o = 0; o < NR * ldw * 2; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wscale + NR * ldw) + o, _MM_HINT_T0);
  __m512 fa[NR][MR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[n][m] = (!Sliced || u0 == 0) ? _mm512_setzero_ps() : partial[n * MR + m];

  for (int64_t u = u0; u < std::min(u1, L.G); ++u)
    unit_avx<NR, MR, 16>(W, X, corr, xs, Kp, ldc, ldw, u, u * 16, wscale, pf, fa);
  for (int64_t t = 0; t < L.T; ++t) {
    const int64_t u = L.G + t;
    if (u < u0 || u >= u1) continue;
    switch (L.tail_nb[t]) {
      case 8: unit_avx<NR, MR, 8>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      case 4: unit_avx<NR, MR, 4>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      default: unit_avx<NR, MR, 2>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
    }
  }
  if (Sliced && u1 < L.U) {
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) partial[n * MR + m] = fa[n][m];
    return;
  }
  if constexpr (NR == 4) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      __m128 v = hsum16x4_avx(fa[0][m], fa[1][m], fa[2][m], fa[3][m]);
      if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias));
      _mm_storeu_ps(y + m * ldy, v);
    }
  } else {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        float v = hsum16_avx(fa[n][m]);
        if (bias) v = v + bias[n];
        y[m * ldy + n] = v;
      }
  }
}

// mr activation rows (1..3) of a tile; partial == nullptr: the whole of K (u0, u1 unused), else the units
// [u0, u1) of a K-sliced walk (see tile_avx).
template <int NR>
inline void tile_avx_mr(int mr, const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs,
                        const Layout& L, const uint16_t* wscale, const float* bias, float* y, int64_t ldy,
                        const uint8_t* pf = nullptr, int64_t u0 = 0, int64_t u1 = 0, __m512* partial = nullptr) {
  if (partial == nullptr) {
    switch (mr) {
      case 1: tile_avx<NR, 1, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
      case 2: tile_avx<NR, 2, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
      default: tile_avx<NR, 3, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
    }
    return;
  }
  switch (mr) {
    case 1: tile_avx<NR, 1, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
    case 2: tile_avx<NR, 2, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
    default: tile_avx<NR, 3, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
  }
}

// Weight bytes of one K slice of a 4-row tile: a tile wider than this is walked slice by slice, every
// activation row block over one slice before the next, so that the slice stays in L1 while it is reused.
constexpr int64_t kSliceBytes = 8 * 1024;
constexpr int64_t kMaxSlicedRows = 48;  // activation rows of one block on the sliced path (see q8_linear's mb)

// process weight rows [n0, n1) x activation rows [m0, m1)
void linear_block_avx(const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                      const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                      int64_t m0, int64_t m1) {
  const int64_t ldc = L.U * 16;
  constexpr int NR = 4;
  constexpr int MR = 3;
  // units per K slice: whole groups of 16 blocks (512 bytes per row); the tail units go with the last slice
  const int64_t slice_units = NR * L.Kp > kSliceBytes && m1 - m0 > 1 && m1 - m0 <= kMaxSlicedRows
                                  ? std::max<int64_t>(1, kSliceBytes / (NR * kGroup))
                                  : L.U;
  alignas(64) __m512 partial[kMaxSlicedRows * NR];
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    if (nr < NR) {  // the last N % 4 rows are plain rows
      for (int64_t m = m0; m < m1; m += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        for (int64_t i = n; i < n + nr; ++i)
          tile_avx_mr<1>(mr, W + i * L.Kp, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + i * (L.Kp / 32),
                         bias ? bias + i : nullptr, y + m * N + i, N);
      }
      continue;
    }
    // Full tiles are tile-interleaved. Every row block prefetches the next tile into L2 (the same lines again
    // after the first block: measured, with 8 activation rows this lets memory keep streaming while the row
    // blocks compute, where prefetching from the first block only left memory idle for most of the tile;
    // T0 hint or more tiles ahead are slower).
    const uint8_t* pf = n + 2 * NR <= n1 ? W + (n + NR) * L.Kp : nullptr;
    for (int64_t u0 = 0; u0 < L.U; u0 += slice_units) {
      const int64_t u1 = u0 + slice_units >= L.G ? L.U : u0 + slice_units;
      for (int64_t m = m0; m < m1; m += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        tile_avx_mr<NR>(mr, W + n * L.Kp, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + n * (L.Kp / 32),
                        bias ? bias + n : nullptr, y + m * N + n, N, pf, u0, u1,
                        slice_units < L.U ? partial + (m - m0) * NR : nullptr);
      }
      if (u1 == L.U) break;
    }
  }
}

// quantize_unit_scalar's operations (amax of |x| -- exact in any order --, d = amax / 127, id = 1 / d,
// nearest-even rounding of x * id, clamp to +-127, exact int sum), 16 values per instruction, in two passes
// so that the blocks' reductions and divisions overlap instead of forming one chain per block.
void quantize_unit_avx(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum) {
  const __m512 lim = _mm512_set1_ps(127.0f);
  const __m512 nlim = _mm512_set1_ps(-127.0f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __mmask16 lo[16], hi[16];
  alignas(64) float amax[16] = {0};
  alignas(64) float id[16];
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const int64_t kn = values_in_block(K, k0);
    lo[l] = kn >= 16 ? __mmask16(0xffff) : __mmask16((1u << kn) - 1);
    hi[l] = kn >= 32 ? __mmask16(0xffff) : kn > 16 ? __mmask16((1u << (kn - 16)) - 1) : __mmask16(0);
    const __m512 v0 = _mm512_maskz_loadu_ps(lo[l], xr + k0);
    const __m512 v1 = _mm512_maskz_loadu_ps(hi[l], xr + k0 + 16);
    amax[l] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  }
  const __m512 dv = _mm512_div_ps(_mm512_load_ps(amax), _mm512_set1_ps(127.0f));  // lane-wise as the scalar divide
  const __mmask16 positive = _mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_GT_OQ);
  _mm512_store_ps(id, _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0f), dv));
  _mm512_storeu_ps(d, dv);
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const __m512 idv = _mm512_set1_ps(id[l]);
    const __m512 v0 = _mm512_maskz_loadu_ps(lo[l], xr + k0);
    const __m512 v1 = _mm512_maskz_loadu_ps(hi[l], xr + k0 + 16);
    const __m512 r0 = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(v0, idv), kNearest)));
    const __m512 r1 = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(v1, idv), kNearest)));
    const __m512i i0 = _mm512_cvtps_epi32(r0);
    const __m512i i1 = _mm512_cvtps_epi32(r1);
    sum[l] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * l), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * l + 16), _mm512_cvtepi32_epi8(i1));
  }
}

// ---- attention
// K/V pointers are to the cache's element type T: float, or uint16_t for an fp16 cache, whose 16 values
// load16_avx converts exactly to fp32 (vcvtph2ps); the arithmetic after the load is the same for both.

inline __m512 load16_avx(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_avx(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int NK, class T>
inline void scores_avx(const float* q, const T* k, int64_t D, float scale, float* s) {
  __m512 acc[NK];
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < NK; ++i) acc[i] = _mm512_fmadd_ps(qv, load16_avx(k + i * D + d), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) s[i] = hsum16_avx(acc[i]) * scale;
}

// acc[c*16 ..] += sum_{j in [0, n)} p[j] * V[j, c*16 ..] sequentially in j (NC chunks of 16)
template <int NC, class T>
inline void pv_block_avx(const float* p, const T* V, int64_t n, int64_t D, float* acc_mem) {
  __m512 acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(acc_mem + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const T* v = V + j * D;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pj, load16_avx(v + c * 16), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_mem + c * 16, acc[c]);
}

template <class T>
inline void pv_avx(const float* p, const T* V, int64_t n, int64_t D, float* acc_mem) {
  const int64_t nc = D / 16;
  for (int64_t c = 0; c < nc; c += 8) {
    const int64_t cc = std::min<int64_t>(8, nc - c);
    const T* Vc = V + c * 16;
    float* a = acc_mem + c * 16;
    switch (cc) {
      case 1: pv_block_avx<1>(p, Vc, n, D, a); break;
      case 2: pv_block_avx<2>(p, Vc, n, D, a); break;
      case 3: pv_block_avx<3>(p, Vc, n, D, a); break;
      case 4: pv_block_avx<4>(p, Vc, n, D, a); break;
      case 5: pv_block_avx<5>(p, Vc, n, D, a); break;
      case 6: pv_block_avx<6>(p, Vc, n, D, a); break;
      case 7: pv_block_avx<7>(p, Vc, n, D, a); break;
      default: pv_block_avx<8>(p, Vc, n, D, a); break;
    }
  }
}

// One attention work item: P (row, head) pairs that use the same kv head of the
// same slot.  Pair r has query qs[r], key range [a[r], b[r]) (absolute cache
// positions, non-empty) and output outs[r]; K, V point at position 0 of the
// (slot, kv head).  K/V are walked once in blocks of keys that stay in L1/L2
// while every pair uses them.  Every (pair) result is computed with exactly the
// operation sequence of attn_row_scalar (per pair: score = hsum16 tree of the
// per-lane fma chain over d, times scale; softmax with the per-pair 16-lane
// sums; output = sequential fma over the keys in ascending order, / sum), so a
// pair's result does not depend on which other pairs share its item.
// scratch: P * lds floats of scores, then P * D accumulators.

// 16 accumulators -> 16 sums, each with the tree of hsum16_scalar:
// lane 4k + i of the result = hsum16(v[4i + k]).
inline __m512 reduce16_avx(const __m512* v) {
  __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores of 4 pairs x 4 consecutive keys starting at k; pair p's 4 scores go to s[p][0..3]
template <class T>
inline void scores_tile_avx(const float* const* q, const T* k, int64_t D, float scale, float* const* s) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qv[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) qv[p] = _mm512_loadu_ps(q[p] + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = load16_avx(k + j * D + d);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) acc[4 * j + p] = _mm512_fmadd_ps(qv[p], kv, acc[4 * j + p]);
    }
  }
  // lane 4p + j = hsum(acc[4j + p]) = score(pair p, key j)
  const __m512 r = _mm512_mul_ps(reduce16_avx(acc), _mm512_set1_ps(scale));
  _mm_storeu_ps(s[0], _mm512_castps512_ps128(r));
  _mm_storeu_ps(s[1], _mm512_extractf32x4_ps(r, 1));
  _mm_storeu_ps(s[2], _mm512_extractf32x4_ps(r, 2));
  _mm_storeu_ps(s[3], _mm512_extractf32x4_ps(r, 3));
}

// one pair, keys [j0, j1) -> s (indexed by absolute key)
template <class T>
inline void scores_one_avx(const float* q, const T* K, int64_t j0, int64_t j1, int64_t D, float scale, float* s) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) scores_avx<4>(q, K + j * D, D, scale, s + j);
  for (; j < j1; ++j) scores_avx<1>(q, K + j * D, D, scale, s + j);
}

// 4 pairs, keys [j0, j1), NC chunks of 16 columns starting at column c0:
// acc_p[c] += sum_j p_p[j] * V[j, c] sequentially in j
template <int NC, class T>
inline void pv_tile_avx(const float* const* p, const T* V, int64_t j0, int64_t j1, int64_t D, int64_t c0,
                        float* const* acc_mem) {
  __m512 acc[4][NC];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(acc_mem[r] + c0 + c * 16);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 v[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) v[c] = load16_avx(V + j * D + c0 + c * 16);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pj, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_mem[r] + c0 + c * 16, acc[r][c]);
}

template <class T>
inline void pv_tile4_avx(const float* const* p, const T* V, int64_t j0, int64_t j1, int64_t D,
                         float* const* acc_mem) {
  const int64_t nc = D / 16;
  for (int64_t c = 0; c < nc; c += 4) {
    switch (std::min<int64_t>(4, nc - c)) {
      case 1: pv_tile_avx<1>(p, V, j0, j1, D, c * 16, acc_mem); break;
      case 2: pv_tile_avx<2>(p, V, j0, j1, D, c * 16, acc_mem); break;
      case 3: pv_tile_avx<3>(p, V, j0, j1, D, c * 16, acc_mem); break;
      default: pv_tile_avx<4>(p, V, j0, j1, D, c * 16, acc_mem); break;
    }
  }
}

// Clips the key ranges [a[i], b[i]) of up to 4 pairs to the key block [j0, j1): per pair [lo[i], hi[i]),
// and [c0, c1) the keys all of them share (empty when c0 >= c1).
static inline void clip_key_ranges(const int32_t* a, const int32_t* b, int64_t nr, int64_t j0, int64_t j1,
                                   int64_t* lo, int64_t* hi, int64_t& c0, int64_t& c1) {
  c0 = j0;
  c1 = j1;
  for (int64_t i = 0; i < nr; ++i) {
    lo[i] = std::max<int64_t>(a[i], j0);
    hi[i] = std::min<int64_t>(b[i], j1);
    c0 = std::max(c0, lo[i]);
    c1 = std::min(c1, hi[i]);
  }
}

// scores s[0 .. n) -> exp(s - max) in place; returns their sum (16-lane partial sums, then hsum16)
inline float softmax_numerators_avx(float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 mk = n - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j0)) - 1);
    mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, s + j0));
  }
  const __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 ps = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 mk = n - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j0)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp16_avx(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j0), mxv)));
    _mm512_mask_storeu_ps(s + j0, mk, e);
    ps = _mm512_add_ps(ps, e);
  }
  return hsum16_avx(ps);
}

// Extra keys (tree rows): pair r then attends ne[r] more keys at cache positions ex[r][0 .. ne[r]) after its
// range, each scored alone (scores_avx<1>) into the score buffer right after the range's scores and added
// to P @ V after the range's keys, in that order: the pair's keys in logical order, as attn_tree_row_scalar.
template <class T>
void attn_item_avx(int64_t P, const float* const* qs, const int32_t* a, const int32_t* b, const int32_t* const* ex,
                   const int64_t* ne, float* const* outs, const T* K, const T* V, int64_t D, float scale,
                   int64_t lds, float* scratch) {
  // sb[r] is indexed by the absolute key position: sb[r] + a[r] is the pair's score buffer
  std::vector<float*> sb(P), acc(P);
  int64_t jlo = INT64_MAX, jhi = 0;
  for (int64_t r = 0; r < P; ++r) {
    sb[r] = scratch + r * lds - a[r];
    acc[r] = scratch + P * lds + r * D;
    jlo = std::min<int64_t>(jlo, a[r]);
    jhi = std::max<int64_t>(jhi, b[r]);
  }
  const int64_t jb = std::max<int64_t>(16, (32 * 1024) / (D * 4)) / 4 * 4;
  // pass 1: scores
  for (int64_t j0 = jlo; j0 < jhi; j0 += jb) {
    const int64_t j1 = std::min(jhi, j0 + jb);
    for (int64_t r0 = 0; r0 < P; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, P - r0);
      int64_t lo[4], hi[4], c0, c1;
      clip_key_ranges(a + r0, b + r0, nr, j0, j1, lo, hi, c0, c1);
      const bool joint = nr == 4 && c1 - c0 >= 4;
      const int64_t ce = joint ? c0 + (c1 - c0) / 4 * 4 : c0;  // joint keys [c0, ce)
      if (joint) {
        for (int64_t j = c0; j < ce; j += 4) {
          float* s[4] = {sb[r0] + j, sb[r0 + 1] + j, sb[r0 + 2] + j, sb[r0 + 3] + j};
          scores_tile_avx(qs + r0, K + j * D, D, scale, s);
        }
      }
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        if (lo[i] >= hi[i]) continue;
        if (joint) {
          scores_one_avx(qs[r], K, lo[i], c0, D, scale, sb[r]);
          scores_one_avx(qs[r], K, ce, hi[i], D, scale, sb[r]);
        } else {
          scores_one_avx(qs[r], K, lo[i], hi[i], D, scale, sb[r]);
        }
      }
    }
  }
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = 0; e < ne[r]; ++e) scores_avx<1>(qs[r], K + int64_t(ex[r][e]) * D, D, scale, sb[r] + b[r] + e);
  // softmax numerators and sums, per pair (same as before)
  std::vector<float> sums(P);
  for (int64_t r = 0; r < P; ++r) {
    sums[r] = softmax_numerators_avx(sb[r] + a[r], b[r] - a[r] + ne[r]);
    std::fill(acc[r], acc[r] + D, 0.0f);
  }
  // pass 2: P @ V, per pair sequential over keys in ascending order
  for (int64_t j0 = jlo; j0 < jhi; j0 += jb) {
    const int64_t j1 = std::min(jhi, j0 + jb);
    for (int64_t r0 = 0; r0 < P; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, P - r0);
      int64_t lo[4], hi[4], c0, c1;
      clip_key_ranges(a + r0, b + r0, nr, j0, j1, lo, hi, c0, c1);
      const bool joint = nr == 4 && c1 - c0 >= 2;
      for (int64_t i = 0; i < nr; ++i) {  // keys before the joint part (or all)
        const int64_t e = joint ? c0 : hi[i];
        if (lo[i] < e) pv_avx(sb[r0 + i] + lo[i], V + lo[i] * D, e - lo[i], D, acc[r0 + i]);
      }
      if (!joint) continue;
      pv_tile4_avx(sb.data() + r0, V, c0, c1, D, acc.data() + r0);
      for (int64_t i = 0; i < nr; ++i)  // keys after it
        if (c1 < hi[i]) pv_avx(sb[r0 + i] + c1, V + c1 * D, hi[i] - c1, D, acc[r0 + i]);
    }
  }
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = 0; e < ne[r]; ++e) pv_avx(sb[r] + b[r] + e, V + int64_t(ex[r][e]) * D, 1, D, acc[r]);
  for (int64_t r = 0; r < P; ++r) {
    const __m512 sv = _mm512_set1_ps(sums[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(outs[r] + d, _mm512_div_ps(_mm512_loadu_ps(acc[r] + d), sv));
  }
}

// 16 elements of gated_scalar with the same operations lane by lane.
inline void gated_row_avx(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(gate + j);
    __m512 t;
    if (gelu) {
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluA), x3));
      t = _mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_mul_ps(_mm512_set1_ps(kGeluC), inner));
    } else {
      t = _mm512_sub_ps(_mm512_setzero_ps(), x);
    }
    t = _mm512_min_ps(t, _mm512_set1_ps(kExpHi));
    const __m512 act = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_avx(t)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(act, _mm512_loadu_ps(up + j)));
  }
  for (; j < n; ++j) out[j] = gated_scalar(gate[j], up[j], gelu);
}

// argmax_range_scalar's answer, 16 lanes at a time: each lane keeps its first maximum (strictly greater
// replaces), the lanes are then reduced by value and, among equal values, by the smallest index; the tail
// (indices above every lane's) replaces only when strictly greater.
ArgmaxPart argmax_range_avx(const float* x, int64_t n, int64_t offset) {
  if (n < 16) return argmax_range_scalar(x, n, offset);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_loadu_ps(x);
  __m512i best_index = lanes;
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t j = 16;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))));
    nan = static_cast<__mmask16>(nan | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
  }
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(indices, best_index);
  ArgmaxPart part{values[0], indices[0], nan != 0};
  for (int l = 1; l < 16; ++l)
    if (values[l] > part.value || (values[l] == part.value && indices[l] < part.index)) {
      part.value = values[l];
      part.index = indices[l];
    }
  argmax_scan(x, j, n, part);
  part.index += offset;
  return part;
}

}  // namespace
#pragma GCC pop_options
#endif

// --------------------------------------------------------------------------
// entry points

namespace {

void linear_block_scalar(const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                         const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                         int64_t m0, int64_t m1) {
  const int64_t ldc = L.U * 16;
  const int64_t nfull = N / 4 * 4;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m)
      dot_row_scalar(n < nfull ? W + (n / 4) * 4 * L.Kp + (n % 4) * 64 : W + n * L.Kp, n < nfull ? 256 : 64,
                     X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + n * (L.Kp / 32),
                     bias ? bias + n : nullptr, y + m * N + n);
}

// The activations as contiguous fp32 [M, K] and the bias (if any) as contiguous fp32 [N], checked.
struct LinearInputs {
  torch::Tensor x, bias;
};
LinearInputs linear_inputs(const torch::Tensor& x_in, const c10::optional<torch::Tensor>& bias_in, int64_t N,
                           const char* name) {
  LinearInputs in;
  in.x = (x_in.scalar_type() == at::kFloat && x_in.is_contiguous()) ? x_in : x_in.to(at::kFloat).contiguous();
  if (bias_in.has_value() && bias_in->defined()) {
    const torch::Tensor& bi = *bias_in;
    in.bias = (bi.scalar_type() == at::kFloat && bi.is_contiguous()) ? bi : bi.to(at::kFloat).contiguous();
    TORCH_CHECK(in.bias.numel() == N, name, ": bias must have ", N, " elements");
  }
  return in;
}

// The calling thread's scratch for M quantized activation rows: the int8 values [M, Kp], then per row `per_row`
// fp32 scales and int32 block sums (their order within a row is the layout's).
struct QuantizedRows {
  int8_t* q;
  float* scales;
  int32_t* sums;
};
QuantizedRows quantized_rows_scratch(int64_t M, int64_t Kp, int64_t per_row) {
  thread_local Scratch scratch;
  const size_t q_bytes = align64(size_t(M * Kp));
  const size_t values_bytes = align64(size_t(M * per_row) * 4);
  uint8_t* base = scratch.get(q_bytes + 2 * values_bytes);
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + q_bytes),
          reinterpret_cast<int32_t*>(base + q_bytes + values_bytes)};
}

inline QuantizeUnit pick_quantize_unit() {
#ifdef SPECDEC_X86
  if (use_avx()) return quantize_unit_avx;
#endif
  return quantize_unit_scalar;
}

// Tiles of tile_bytes handed out in chunks of at least ~48 KiB of work (so that a small call stays on one thread),
// otherwise two chunks per thread: each thread then streams long runs of consecutive weights, which its
// prefetches follow across tiles (eight chunks per thread measured 6-11 % slower per matrix at 1 and 8 rows, and
// 5-13 % slower at 40 and 128 rows, the weights cold: every chunk boundary restarts the stream). A call walked
// once per block of rows (not single_pass: a prefill, a large batch) caps its chunks at ~512 KiB of weights, which
// stay in the cache while every row block uses them (1 MiB measured up to 14 % slower on Qwen-1.5B's attention
// matrices at 128 rows).
inline int64_t chunk_tiles(int64_t tiles, int64_t tile_bytes, int64_t M, bool single_pass) {
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (48 * 1024) / (tile_bytes * std::max<int64_t>(1, M / 2)));
  const int64_t two_per_thread = std::max(grain, (tiles + 2 * nth - 1) / (2 * nth));
  if (single_pass) return two_per_thread;
  return std::min(std::max<int64_t>(1, (512 * 1024) / tile_bytes), two_per_thread);
}

// Runs worker(next) on every intra-op thread (one call when a single worker suffices): each worker takes chunk
// indices from the shared counter until nchunks are taken, so a thread slowed down by other load does not hold
// back the whole call. Which thread computes a chunk has no influence on the result.
template <class Worker>
void run_chunk_workers(int64_t nchunks, const Worker& worker) {
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), nchunks);
  std::atomic<int64_t> next{0};
  if (workers <= 1 || at::in_parallel_region()) {
    worker(next);
  } else {
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(next); });
  }
}

torch::Tensor q8_linear(const torch::Tensor& x_in, const torch::Tensor& qweight, const torch::Tensor& wscale,
                        const c10::optional<torch::Tensor>& bias_in, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear: x must be 2-D [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "q8_linear: qweight must be contiguous uint8 [N, Kp]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(K == in_features, "q8_linear: x has ", K, " features, weight expects ", in_features);
  TORCH_CHECK(Kp % kChunk == 0 && Kp >= K && Kp < K + kChunk, "q8_linear: bad padded width ", Kp);
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) == N && wscale.size(1) == Kp / 32,
              "q8_linear: scale must be contiguous fp16 [N, Kp/32]");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q8_linear");
  const torch::Tensor& x = in.x;
  const torch::Tensor& bias = in.bias;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const Layout L(Kp);
  const QuantizedRows act = quantized_rows_scratch(M, Kp, L.U * 16);
  int8_t* xq = act.q;
  float* xs = act.scales;
  int32_t* corr = act.sums;  // -128 * the block sums (see quantize_rows)

  const float* xp = x.data_ptr<float>();
  const bool avx = use_avx();
  const QuantizeUnit quantize_unit = pick_quantize_unit();
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) { quantize_rows(quantize_unit, xp, K, L, a, b, xq, corr, xs); });

  const uint8_t* W = qweight.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();

  // Tiling: weight rows in tiles of 4; each chunk of tiles is walked for every m-block of ~96 KiB of activations.
  constexpr int64_t NR = 4;
  const int64_t ntiles = (N + NR - 1) / NR;
  const int64_t mb = std::max<int64_t>(3, ((96 * 1024) / Kp) / 3 * 3);
  const int64_t chunk = chunk_tiles(ntiles, NR * Kp, M, M <= mb);
  const int64_t nchunks = (ntiles + chunk - 1) / chunk;
  auto run_chunk = [&](int64_t c) {
    const int64_t t0 = c * chunk, t1 = std::min(ntiles, t0 + chunk);
    const int64_t n0 = t0 * NR, n1 = std::min(N, t1 * NR);
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
      const int64_t m1 = std::min(M, m0 + mb);
#ifdef SPECDEC_X86
      if (avx) {
        linear_block_avx(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1);
        continue;
      }
#endif
      linear_block_scalar(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1);
    }
  };
  run_chunk_workers(nchunks, [&](std::atomic<int64_t>& next) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) run_chunk(c);
  });
  (void)avx;
  return y;
}

// How the (row, head) pairs of one (slot, kv head) are cut into work items: a group of P pairs is cut into
// ceil(P / cap) pieces of equal size, rounded up to a multiple of 4 (the pair tile of attn_item_avx) when the
// pieces hold 4 or more; the last piece takes the rest. Appends the pieces' sizes.
inline void append_attention_pieces(int64_t pairs, int64_t cap, std::vector<int64_t>& sizes) {
  const int64_t pieces = (pairs + cap - 1) / cap;
  int64_t size = (pairs + pieces - 1) / pieces;
  if (size >= 4) size = (size + 3) / 4 * 4;
  for (int64_t p0 = 0; p0 < pairs; p0 += size) sizes.push_back(std::min(size, pairs - p0));
}

// The item sizes (pairs per item, groups in order) for the cap (most pairs per item) whose items finish first on
// nth threads that take them in order, each the next item when free (as the attention loop does), at a cost per
// item of its pairs (a pair outside a tile of 4 costing half again as much) plus one pair's worth for reading the
// keys and values once more. Caps 32, 28, ..., 4, 3, 2, 1; ties go to the larger cap. Only the split depends on
// this, never a pair's arithmetic.
std::vector<int64_t> attention_split(const std::vector<int64_t>& group_pairs, int64_t nth) {
  std::vector<int64_t> best, sizes;
  double best_time = INFINITY;
  std::vector<double> free_at(std::max<int64_t>(1, nth));
  for (int64_t cap = 32; cap >= 1; cap = cap > 4 ? cap - 4 : cap - 1) {
    sizes.clear();
    for (const int64_t pairs : group_pairs) append_attention_pieces(pairs, cap, sizes);
    std::fill(free_at.begin(), free_at.end(), 0.0);
    for (const int64_t n : sizes)
      *std::min_element(free_at.begin(), free_at.end()) += 1.0 + double(n / 4 * 4) + 1.5 * double(n % 4);
    const double time = *std::max_element(free_at.begin(), free_at.end());
    if (time < best_time - 1e-9) best_time = time, best.swap(sizes);
  }
  return best;
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                        const torch::Tensor& slots_in, const torch::Tensor& start_in, const torch::Tensor& end_in,
                        double scale_d, const c10::optional<torch::Tensor>& extra_in) {
  TORCH_CHECK(q_in.dim() == 3, "attention: q must be [M, Hq, D]");
  TORCH_CHECK(k_in.dim() == 4 && v_in.dim() == 4, "attention: caches must be [S, Hkv, L, D]");
  TORCH_CHECK(k_in.sizes() == v_in.sizes(), "attention: k_cache and v_cache shapes differ");
  const auto f32 = [](const torch::Tensor& t) {
    return (t.scalar_type() == at::kFloat && t.is_contiguous()) ? t : t.to(at::kFloat).contiguous();
  };
  const auto i32 = [](const torch::Tensor& t) {
    return (t.scalar_type() == at::kInt && t.is_contiguous()) ? t : t.to(at::kInt).contiguous();
  };
  // The caches are fp32 or fp16 (both the same); an fp16 cache is read as it is, never converted as a whole.
  TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type(), "attention: k_cache is ", k_in.scalar_type(),
              " but v_cache is ", v_in.scalar_type());
  const bool half_kv = k_in.scalar_type() == at::kHalf;
  const auto kv = [&](const torch::Tensor& t) { return half_kv ? t.contiguous() : f32(t); };
  const torch::Tensor q = f32(q_in), kc = kv(k_in), vc = kv(v_in);
  const torch::Tensor slots = i32(slots_in), ks = i32(start_in), ke = i32(end_in);
  const int64_t M = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = kc.size(0), Hkv = kc.size(1), Lmax = kc.size(2);
  TORCH_CHECK(kc.size(3) == D, "attention: head dim mismatch");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "attention: Hq must be a multiple of Hkv");
  TORCH_CHECK(slots.numel() == M && ks.numel() == M && ke.numel() == M, "attention: slots/ranges must be [M]");
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int32_t* a = ks.data_ptr<int32_t>();
  const int32_t* b = ke.data_ptr<int32_t>();
  // extra keys (tree rows): row m then attends [a[m], b[m]) followed by extra[m, 0 .. ne[m]) (cache
  // positions, the leading non-negative entries of the row; -1 pads)
  torch::Tensor extra;
  int64_t E = 0;
  if (extra_in.has_value() && extra_in->defined()) {
    extra = i32(*extra_in);
    TORCH_CHECK(extra.dim() == 2 && extra.size(0) == M, "attention: extra_keys must be [M, E]");
    E = extra.size(1);
  }
  const int32_t* ep = E ? extra.data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> ne(M, 0);
  int64_t maxn = 0;
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sp[m] >= 0 && sp[m] < S, "attention: slot out of range");
    TORCH_CHECK(a[m] >= 0 && b[m] <= Lmax, "attention: key range out of bounds");
    while (ne[m] < E && ep[m * E + ne[m]] >= 0) {
      TORCH_CHECK(ep[m * E + ne[m]] < Lmax, "attention: extra key position out of bounds");
      ++ne[m];
    }
    maxn = std::max<int64_t>(maxn, std::max<int64_t>(0, b[m] - a[m]) + ne[m]);
  }
  auto out = torch::empty({M, Hq, D}, q.options());
  if (M == 0 || Hq == 0) return out;
  const float scale = static_cast<float>(scale_d);
  const int64_t group = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  // element offsets below are in cache elements; kp / vp are cast to the element type where they are read
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  const int64_t esize = kc.element_size();
  float* op = out.data_ptr<float>();
  const bool avx = use_avx() && D % 16 == 0;

  // Work items: (row, head) pairs of the same slot and kv head, so that K/V are
  // read once per item.  How pairs are grouped into items (and items onto
  // threads) only decides who computes what, never how: each pair's result is
  // computed with the same operation sequence whatever its item.
  std::vector<int64_t> order(M);
  for (int64_t m = 0; m < M; ++m) order[m] = m;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return sp[x] < sp[y]; });
  std::vector<int64_t> run_start;  // runs of rows with the same slot and a non-empty key sequence
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t m = order[i];
    TORCH_CHECK(ne[m] == 0 || b[m] >= a[m], "attention: a row with extra keys needs key_end >= key_start");
    if (b[m] <= a[m] && ne[m] == 0) {
      std::fill(op + m * Hq * D, op + (m + 1) * Hq * D, 0.0f);
      continue;
    }
    if (rows.empty() || sp[rows.back()] != sp[m]) run_start.push_back(int64_t(rows.size()));
    rows.push_back(m);
  }
  run_start.push_back(int64_t(rows.size()));
  const int64_t nruns = int64_t(run_start.size()) - 1;
  if (nruns <= 0) return out;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> group_pairs;  // pairs per (run, kv head), in item order
  for (int64_t r = 0; r < nruns; ++r)
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) group_pairs.push_back((run_start[r + 1] - run_start[r]) * group);
  const std::vector<int64_t> item_pairs = attention_split(group_pairs, nth);  // pairs per item, in item order
  size_t next_item = 0;
  // pairs in item order: run, kv head, rows of the run, heads of the group
  const int64_t npairs = int64_t(rows.size()) * Hq;
  std::vector<const float*> pq(npairs);
  std::vector<float*> po(npairs);
  std::vector<int32_t> pa(npairs), pb(npairs);
  std::vector<const int32_t*> pe(npairs);  // the pair's extra keys (tree rows)
  std::vector<int64_t> pne(npairs);
  struct Item {
    int64_t p0, np;
    const void *K, *V;  // position 0 of the (slot, kv head): const float* or, for an fp16 cache, const uint16_t*
  };
  std::vector<Item> items;
  int64_t idx = 0;
  for (int64_t r = 0; r < nruns; ++r) {
    const int64_t slot = sp[rows[run_start[r]]];
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const int64_t first = idx;
      for (int64_t i = run_start[r]; i < run_start[r + 1]; ++i) {
        const int64_t m = rows[i];
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h, ++idx) {
          pq[idx] = qp + (m * Hq + h) * D;
          po[idx] = op + (m * Hq + h) * D;
          pa[idx] = a[m];
          pb[idx] = b[m];
          pe[idx] = ne[m] ? ep + m * E : nullptr;
          pne[idx] = ne[m];
        }
      }
      const int64_t base = (slot * Hkv + kvh) * Lmax * D;
      for (int64_t p0 = first; p0 < idx; ++next_item) {
        items.push_back({p0, item_pairs[next_item], kp + base * esize, vp + base * esize});
        p0 += item_pairs[next_item];
      }
    }
  }
  const int64_t lds = (maxn + 16 + 15) / 16 * 16;
  auto run_typed = [&](const Item& it, const auto* K, const auto* V) {
    thread_local Scratch sbuf_mem;
#ifdef SPECDEC_X86
    if (avx) {
      float* sbuf = reinterpret_cast<float*>(sbuf_mem.get(size_t(it.np * (lds + D) + 16) * 4));
      attn_item_avx(it.np, pq.data() + it.p0, pa.data() + it.p0, pb.data() + it.p0, pe.data() + it.p0,
                    pne.data() + it.p0, po.data() + it.p0, K, V, D, scale, lds, sbuf);
      return;
    }
#endif
    float* sbuf = reinterpret_cast<float*>(sbuf_mem.get(size_t(lds + 16) * 4));
    for (int64_t r = it.p0; r < it.p0 + it.np; ++r) {
      if (pne[r])
        attn_tree_row_scalar(pq[r], K, V, pa[r], pb[r], pe[r], pne[r], D, scale, po[r], sbuf);
      else
        attn_row_scalar(pq[r], K, V, pa[r], pb[r], D, scale, po[r], sbuf);
    }
  };
  auto run_item = [&](const Item& it) {
    if (half_kv)
      run_typed(it, static_cast<const uint16_t*>(it.K), static_cast<const uint16_t*>(it.V));
    else
      run_typed(it, static_cast<const float*>(it.K), static_cast<const float*>(it.V));
  };
  const int64_t nitems = int64_t(items.size());
  const int64_t workers = std::min(nth, nitems);
  if (workers <= 1 || at::in_parallel_region() || npairs * maxn * D < (1 << 14)) {
    for (const Item& it : items) run_item(it);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t i = next.fetch_add(1); i < nitems; i = next.fetch_add(1)) run_item(items[i]);
    });
  }
  (void)avx;
  return out;
}

// --------------------------------------------------------------------------
// row-wise norm and rotary embedding: each row (token, or token x head) is computed
// on its own with a fixed operation order, so they are row invariant like the rest.

// One RMS norm row: 16 lane sums of squares (lane l takes elements l, l+16, ...),
// the fixed hsum16 tree, then out = (x * rsqrt(mean + eps)) * w.
inline void rms_norm_row(const float* x, const float* w, int64_t D, float eps, float* out) {
  float acc[16] = {0};
  for (int64_t j0 = 0; j0 < D; j0 += 16)
    for (int l = 0; l < 16 && j0 + l < D; ++l) acc[l] = acc[l] + x[j0 + l] * x[j0 + l];
  const float mean = hsum16_scalar(acc) / static_cast<float>(D);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t j = 0; j < D; ++j) out[j] = (x[j] * r) * w[j];
}

#ifdef SPECDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
// rms_norm_row's operations 16 lanes at a time: lane l sums the squares of elements l, l + 16, ... (square, then
// add: the build does not contract them), the tail under a mask that leaves the other lanes as they are, then the
// same hsum16 tree and scalar rsqrt; out = (x * r) * w element by element.
void rms_norm_row_avx(const float* x, const float* w, int64_t D, float eps, float* out) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j0 = 0;
  for (; j0 + 16 <= D; j0 += 16) {
    const __m512 v = _mm512_loadu_ps(x + j0);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (D - j0)) - 1u);
  if (j0 < D) {
    const __m512 v = _mm512_maskz_loadu_ps(tail, x + j0);
    acc = _mm512_mask_add_ps(acc, tail, acc, _mm512_mul_ps(v, v));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  const float mean = hsum16_scalar(lanes) / static_cast<float>(D);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (j0 = 0; j0 + 16 <= D; j0 += 16)
    _mm512_storeu_ps(out + j0, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j0), r), _mm512_loadu_ps(w + j0)));
  if (j0 < D)
    _mm512_mask_storeu_ps(out + j0, tail,
                          _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + j0), r),
                                        _mm512_maskz_loadu_ps(tail, w + j0)));
}
#pragma GCC pop_options
#endif

// rms_norm_row on the SIMD path when avx, else the scalar one (the same bits).
inline void rms_norm_row_any(bool avx, const float* x, const float* w, int64_t D, float eps, float* out) {
#ifdef SPECDEC_X86
  if (avx) {
    rms_norm_row_avx(x, w, D, eps, out);
    return;
  }
#endif
  (void)avx;
  rms_norm_row(x, w, D, eps, out);
}

// Rotate-half RoPE of one head row: out = x * cos + rotate_half(x) * sin (products rounded
// separately, as torch computes it).
inline void rope_row(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];
  for (int64_t j = half; j < D; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

#ifdef SPECDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
// rope_row 16 lanes at a time with the same operations (two products, each rounded, then their sum; negating a
// product's factor negates the rounded product exactly); half = D / 2 must be a multiple of 16.
void rope_row_avx(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 lo = _mm512_loadu_ps(x + j), hi = _mm512_loadu_ps(x + j + half);
    const __m512 minus_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), sign));
    _mm512_storeu_ps(out + j, _mm512_add_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(cos + j)),
                                            _mm512_mul_ps(minus_hi, _mm512_loadu_ps(sin + j))));
    _mm512_storeu_ps(out + j + half, _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(cos + j + half)),
                                                   _mm512_mul_ps(lo, _mm512_loadu_ps(sin + j + half))));
  }
}
#pragma GCC pop_options
#endif

// rope_row on the SIMD path when avx and D / 2 is a multiple of 16, else the scalar one (the same bits).
inline void rope_row_any(bool avx, const float* x, const float* cos, const float* sin, int64_t D, float* out) {
#ifdef SPECDEC_X86
  if (avx && D % 32 == 0) {
    rope_row_avx(x, cos, sin, D, out);
    return;
  }
#endif
  (void)avx;
  rope_row(x, cos, sin, D, out);
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == D, "rms_norm: weight must be [", D, "]");
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor w = w_in.contiguous();
  torch::Tensor out = torch::empty_like(x);
  const int64_t R = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const bool avx = use_avx();
  parallel_rows(R, R * D, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row_any(avx, xp + r * D, wp, D, e, op + r * D);
  });
  return out;
}

// qkv [T, (H + 2 Hkv) * D] (last dim contiguous) -> query [T, H, D], key [T, Hkv, D]:
// optional per-head RMS norm (Gemma 3 QK-norm), then RoPE at positions [T] from the
// tables cos, sin [P, D].
std::vector<torch::Tensor> qk_norm_rope(const torch::Tensor& qkv, int64_t H, int64_t Hkv, int64_t D,
                                        const c10::optional<torch::Tensor>& q_norm,
                                        const c10::optional<torch::Tensor>& k_norm, double eps,
                                        const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                                        const torch::Tensor& positions_in) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "qk_norm_rope: qkv must be [T, (H + 2 Hkv) * D] fp32 with a contiguous last dim");
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qk_norm_rope: qkv width ", qkv.size(1), " != (H + 2 Hkv) * D");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "qk_norm_rope: give both q_norm and k_norm or neither");
  const torch::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const torch::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), P = cos.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "qk_norm_rope: tables must be [P, D]");
  TORCH_CHECK(positions.numel() == T, "qk_norm_rope: positions must be [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "qk_norm_rope: position out of table");
  torch::Tensor query = torch::empty({T, H, D}, qkv.options());
  torch::Tensor key = torch::empty({T, Hkv, D}, qkv.options());
  torch::Tensor qn, kn;
  if (q_norm.has_value()) {
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
    TORCH_CHECK(qn.numel() == D && kn.numel() == D, "qk_norm_rope: norms must be [D]");
  }
  const float* src = qkv.data_ptr<float>();
  const int64_t lds = qkv.stride(0);
  const float e = static_cast<float>(eps);
  const bool avx = use_avx();
  parallel_rows(T, T * (H + Hkv) * D, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos.data_ptr<float>() + pos[t] * D;
      const float* s = sin.data_ptr<float>() + pos[t] * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* x = src + t * lds + h * D;
        const bool is_q = h < H;
        if (qn.defined()) {
          rms_norm_row_any(avx, x, (is_q ? qn : kn).data_ptr<float>(), D, e, normed.data());
          x = normed.data();
        }
        float* out = is_q ? query.data_ptr<float>() + (t * H + h) * D : key.data_ptr<float>() + (t * Hkv + h - H) * D;
        rope_row_any(avx, x, c, s, D, out);
      }
    }
  });
  return {query, key};
}

// gate_up [R, 2 I] (gate first, then up) -> act(gate) * up [R, I]; activation "gelu_tanh" or "silu".
torch::Tensor gated_activation(const torch::Tensor& gate_up_in, const std::string& activation) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.scalar_type() == at::kFloat && gate_up_in.size(1) % 2 == 0,
              "gated_activation: gate_up must be [R, 2 I] fp32");
  TORCH_CHECK(activation == "gelu_tanh" || activation == "silu",
              "gated_activation: activation must be 'gelu_tanh' or 'silu', got '", activation, "'");
  const bool gelu = activation == "gelu_tanh";
  const torch::Tensor gate_up = gate_up_in.contiguous();
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({R, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const bool avx = use_avx();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = src + r * 2 * I;
#ifdef SPECDEC_X86
      if (avx) {
        gated_row_avx(gate, gate + I, I, gelu, dst + r * I);
        continue;
      }
#endif
      for (int64_t j = 0; j < I; ++j) dst[r * I + j] = gated_scalar(gate[j], gate[I + j], gelu);
    }
  };
  parallel_rows(R, R * I, rows);
  (void)avx;
  return out;
}

// Row-wise argmax of x [R, V] fp32 -> int64 [R]: the first index of the row's maximum, torch.argmax's rule (a
// row holding a NaN is left to torch.argmax). Rows are cut into pieces that the threads share; a row's pieces
// are combined in index order, so the answer does not depend on the threads.
torch::Tensor argmax_rows(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) > 0,
              "argmax_rows: x must be [R, V] fp32 with V > 0");
  TORCH_CHECK(x_in.size(1) < (int64_t(1) << 31), "argmax_rows: V must fit in int32");
  const torch::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  constexpr int64_t kPiece = 16384;
  const int64_t pieces = (V + kPiece - 1) / kPiece;
  std::vector<ArgmaxPart> parts(R * pieces);
  const float* xp = x.data_ptr<float>();
  const bool avx = use_avx();
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / pieces, a = (t % pieces) * kPiece, n = std::min(kPiece, V - a);
#ifdef SPECDEC_X86
      if (avx) {
        parts[t] = argmax_range_avx(xp + r * V + a, n, a);
        continue;
      }
#endif
      parts[t] = argmax_range_scalar(xp + r * V + a, n, a);
    }
  };
  parallel_rows(R * pieces, R * V, run);
  (void)avx;
  torch::Tensor out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    ArgmaxPart best = parts[r * pieces];
    for (int64_t p = 1; p < pieces; ++p) {
      const ArgmaxPart& part = parts[r * pieces + p];
      best.nan = best.nan || part.nan;
      if (part.value > best.value) {
        best.value = part.value;
        best.index = part.index;
      }
    }
    op[r] = best.nan ? x[r].argmax().item<int64_t>() : best.index;
  }
  return out;
}

// Token ids as a flat int64 tensor, each checked to be a row of an N-row table.
torch::Tensor embedding_ids(const torch::Tensor& ids_in, int64_t N) {
  const torch::Tensor ids = ids_in.to(at::kLong).contiguous().reshape({-1});
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "embedding_rows: token id ", idp[i], " out of range [0, ", N, ")");
  return ids;
}

// Rows of a q8 weight as an embedding table: out[i, j] = (qweight byte of (ids[i], j) - 128) * scale[ids[i], j / 32]
// in fp32 (one rounding, the product QuantizedWeight.int8() * _scales() computes). unpack[j] is the packed
// column of natural column j; rows in tiles of 4 are chunk-interleaved (QuantizedWeight's layout), the last N % 4
// rows are plain.
torch::Tensor embedding_rows(const torch::Tensor& qweight, const torch::Tensor& wscale, const torch::Tensor& ids_in,
                             const torch::Tensor& unpack_in) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "embedding_rows: qweight must be contiguous uint8 [N, Kp]");
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(Kp % kChunk == 0, "embedding_rows: bad padded width ", Kp);
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) == N && wscale.size(1) == Kp / 32,
              "embedding_rows: scale must be contiguous fp16 [N, Kp/32]");
  const torch::Tensor ids = embedding_ids(ids_in, N);
  const torch::Tensor unpack = unpack_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), K = unpack.numel();
  TORCH_CHECK(K <= Kp, "embedding_rows: ", K, " columns but the weight has ", Kp);
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* up = unpack.data_ptr<int64_t>();
  for (int64_t j = 0; j < K; ++j) TORCH_CHECK(up[j] >= 0 && up[j] < Kp, "embedding_rows: unpack index out of range");
  torch::Tensor out = torch::empty({n, K}, qweight.options().dtype(at::kFloat));
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  const int64_t nfull = N / 4 * 4;
  // byte (r, p) of a tiled row: W[(r / 4) * 4 * Kp + (r % 4) * 64 + in_tile[j]], with p = unpack[j]
  std::vector<int64_t> in_tile(K);
  for (int64_t j = 0; j < K; ++j) in_tile[j] = (up[j] / kChunk) * 4 * kChunk + up[j] % kChunk;
  parallel_rows(n, n * K, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = idp[i];
      const uint16_t* row_scales = ws + r * (Kp / 32);
      const bool tiled = r < nfull;
      const uint8_t* base = tiled ? W + (r / 4) * 4 * Kp + (r % 4) * kChunk : W + r * Kp;
      const int64_t* offsets = tiled ? in_tile.data() : up;
      float* dst = op + i * K;
      for (int64_t j = 0; j < K; ++j)
        dst[j] = static_cast<float>(static_cast<int>(base[offsets[j]]) - 128) * half_to_float(row_scales[j / 32]);
    }
  });
  return out;
}

// n fp32 values -> fp16 bits, rounded to nearest even (c10::Half, as tensor.to(torch.float16))
inline void floats_to_halves_scalar(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = c10::Half(src[j]).x;
}

#ifdef SPECDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f,f16c")
// floats_to_halves_scalar 16 at a time (vcvtps2ph rounds to nearest even too); the tail on the scalar path
void floats_to_halves_avx(const float* src, int64_t n, uint16_t* dst) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  floats_to_halves_scalar(src + j, n - j, dst + j);
}
#pragma GCC pop_options
#endif

// Writes keys/values [n, Hkv, D] fp32 at (slots[i], positions[i]) of the caches [S, Hkv, L, D] (fp32, or fp16
// rounded to nearest even as tensor.to(torch.float16) does): KVCache.write without torch's indexing machinery.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots_in,
              const torch::Tensor& positions_in, const torch::Tensor& keys_in, const torch::Tensor& values_in) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "kv_write: caches must be contiguous [S, Hkv, L, D], both fp32 or both fp16");
  const int64_t S = k_cache.size(0), H = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3);
  const torch::Tensor slots = slots_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
  const int64_t n = slots.numel();
  TORCH_CHECK(positions.numel() == n, "kv_write: ", n, " slots but ", positions.numel(), " positions");
  TORCH_CHECK(keys_in.dim() == 3 && keys_in.size(0) == n && keys_in.size(1) == H && keys_in.size(2) == D &&
                  keys_in.sizes() == values_in.sizes(),
              "kv_write: keys and values must be [", n, ", ", H, ", ", D, "]");
  // rows may be strided (the values are a column slice of the fused qkv projection): each row's heads contiguous
  auto rows_of = [](const torch::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.to(at::kFloat).contiguous();
  };
  const torch::Tensor keys = rows_of(keys_in), values = rows_of(values_in);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S && pp[i] >= 0 && pp[i] < L, "kv_write: (slot, position) (", sp[i], ", ",
                pp[i], ") outside the cache's [", S, ", ", L, ")");
  const bool half = k_cache.scalar_type() == at::kHalf;
  const bool avx = use_avx();
  for (int w = 0; w < 2; ++w) {
    const torch::Tensor& rows = w == 0 ? keys : values;
    const float* src = rows.data_ptr<float>();
    const int64_t row_stride = n > 1 ? rows.stride(0) : H * D;
    void* base = (w == 0 ? k_cache : v_cache).data_ptr();  // element (s, h, p, 0) at ((s * H + h) * L + p) * D
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* row = src + i * row_stride + h * D;
        const int64_t at = ((sp[i] * H + h) * L + pp[i]) * D;
        if (!half) {
          std::memcpy(static_cast<float*>(base) + at, row, size_t(D) * sizeof(float));
          continue;
        }
        uint16_t* dst = static_cast<uint16_t*>(base) + at;
#ifdef SPECDEC_X86
        if (avx) {
          floats_to_halves_avx(row, D, dst);
          continue;
        }
#endif
        floats_to_halves_scalar(row, D, dst);
      }
  }
  (void)avx;
}

// --------------------------------------------------------------------------
// int8 linear, AMX layout ("amx"): the weights of 16 output rows and one block of 32 inputs form one AMX tile.
//
// qweight int8 [Np, Kp] (Np = N rounded up to 16, zero rows beyond N), memory order
// [Np/16 row tiles][Kp/32 blocks][8 quads][16 rows][4 values]: the 512 bytes of (row tile t, block b) hold
// w[16 t + r][32 b + 4 q + i] at q * 64 + r * 4 + i, which is the B operand of one TDPBSSD with K = 32.
// tile_scale fp16 [Np/16, Kp/32, 16]: the block scales of the tile's 16 rows.
// Activations are quantized per row and block of 32 exactly as for the other layout (quantize_unit_*), in
// natural order: xq int8 [M, Kp], xs fp32 [M, Kp/32]. Every output is then
//   fa = +0; for b = 0, 1, ...: fa = fma(float(dot_b), xs[m][b] * ws[n][b], fa);   y = fa (+ bias[n])
// with dot_b the exact int32 dot product of block b (signed x signed: no offset to cancel). The order of the
// blocks is fixed, so y does not depend on M, on the other rows or on the threads; the AMX path (one TDPBSSD
// per block and tile of up to 16 activation rows, the epilogue over the 16 output rows of a zmm) and the scalar
// path perform the same operations and give the same bits.

constexpr int64_t kAmxRows = 16;    // output rows per weight tile
constexpr int64_t kAmxTile = 512;   // bytes of one (row tile, block) weight tile
constexpr int64_t kAmxPrefetch = 4096;  // bytes ahead in the weight stream (2 and 8 KB measured within noise)
constexpr int kAmxVnniRows = 4;         // row blocks of at most this many rows skip the tiles

bool cpu_has_amx() {
#ifdef SPECDEC_X86
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    if (!(tile && int8 && cpu_has_avx512vnni())) return false;
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it
    // the first tile instruction raises SIGILL. The permission is per process.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline bool use_amx() { return !g_force_scalar && cpu_has_amx(); }

// Quantize activation rows [m0, m1) into natural order: xq [M, Kp], block scales xs and sums xsum [M, Kp/32].
void quantize_rows_natural(QuantizeUnit quantize_unit, const float* x, int64_t K, int64_t Kp, int64_t m0, int64_t m1,
                           int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t NB = Kp / 32;
  float d[16];
  int32_t sum[16];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b0 = 0; b0 < NB; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, NB - b0));
      quantize_unit(x + m * K, K, b0, nb, xq + m * Kp + b0 * 32, d, sum);
      std::memcpy(xs + m * NB + b0, d, sizeof(float) * nb);
      std::memcpy(xsum + m * NB + b0, sum, sizeof(int32_t) * nb);
    }
}

// Output rows [n0, n1) x activation rows [m0, m1), scalar.
void linear_amx_layout_scalar(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs, int64_t Kp,
                              const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const int64_t NB = Kp / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t t = n / kAmxRows, r = n % kAmxRows;
    for (int64_t m = m0; m < m1; ++m) {
      float fa = 0.0f;
      for (int64_t b = 0; b < NB; ++b) {
        const int8_t* wt = W + (t * NB + b) * kAmxTile;
        const int8_t* xb = xq + m * Kp + b * 32;
        int32_t dot = 0;
        for (int q = 0; q < 8; ++q)
          for (int i = 0; i < 4; ++i) dot += int32_t(wt[q * 64 + r * 4 + i]) * int32_t(xb[q * 4 + i]);
        const float s = xs[m * NB + b] * half_to_float(tscale[(t * NB + b) * kAmxRows + r]);
        fa = std::fma(static_cast<float>(dot), s, fa);
      }
      if (bias) fa = fa + bias[n];
      y[m * N + n] = fa;
    }
  }
}

}  // namespace

#ifdef SPECDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,avx2,f16c,amx-tile,amx-int8")
namespace {

struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Tiles: 0 .. 2 = C (mr x 16 int32); 3 and 7 = A (mr activation rows x 32 bytes); 4 .. 6 = B (weights, 8 x 64
// bytes). A call's first block of up to 16 rows uses C 0 .. 2, A 3 and B 4 .. 6 for up to kAmxStreams row tiles at
// once (amx_tile_rows); its later blocks, which find the chunk's weights in the cache, use C 0, 1, A 3, 7 and B 4, 5
// for two consecutive blocks of one row tile (amx_tile_block_pairs). The configuration is loaded only if the thread's
// current one differs (read back with sttilecfg, so that a configuration another library loaded on this thread in
// between is never mistaken for ours); the tiles stay configured after a call.
constexpr int kAmxStreams = 3;
inline void amx_configure(int mr) {
  AmxConfig cfg;
  for (int i = 0; i < kAmxStreams; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(mr);
    cfg.colsb[i] = 64;
    cfg.rows[4 + i] = 8;
    cfg.colsb[4 + i] = 64;
  }
  cfg.rows[3] = cfg.rows[7] = static_cast<uint8_t>(mr);
  cfg.colsb[3] = cfg.colsb[7] = 32;
  AmxConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &cfg, sizeof(cfg)) != 0) _tile_loadconfig(&cfg);
}

// The block scales of row tile t's 16 output rows for block b, as fp32.
inline __m512 amx_block_scales(const uint16_t* tscale, int64_t NB, int64_t t, int64_t b) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tscale + (t * NB + b) * kAmxRows)));
}

// One block's step of the layout's reduction for one activation row: fa = fma(float(dots), x_scale * w_scales, fa)
// (the product rounded first). Both SIMD paths use it, so their sums are the same operations in the same order.
inline __m512 amx_add_block(__m512 fa, __m512i dots, float x_scale, __m512 w_scales) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(_mm512_set1_ps(x_scale), w_scales), fa);
}

// y[m][16 t .. 16 t + 16) = fa[m] (+ bias), the rows beyond N left out.
template <int MR>
inline void amx_store_rows(const __m512 (&fa)[MR], const float* bias, float* y, int64_t N, int64_t t) {
  const int64_t n0 = t * kAmxRows;
  const int64_t valid = std::min<int64_t>(kAmxRows, N - n0);
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * N + n0, mask, bias ? _mm512_add_ps(fa[m], bv) : fa[m]);
}

// Zeroed accumulators fa[S][MR] and the weight bases of the S row tiles t[0 .. S) (amx layout).
template <int MR, int S>
__attribute__((always_inline)) inline void start_row_tiles(const int8_t* W, int64_t NB, const int64_t* t,
                                                           __m512 (&fa)[S][MR], const int8_t* (&wt)[S]) {
#pragma GCC unroll 16
  for (int s = 0; s < S; ++s) {
    wt[s] = W + t[s] * NB * kAmxTile;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[s][m] = _mm512_setzero_ps();
  }
}

// Row tiles [t0, t1) cut into S consecutive runs walked side by side: side_by_side(t) for t[s] = the i-th tile of
// run s, i = 0, 1, ...; then alone(&t) for each tile left over.
template <int S, class SideBySide, class Alone>
inline void walk_row_tiles(int64_t t0, int64_t t1, const SideBySide& side_by_side, const Alone& alone) {
  const int64_t run = (t1 - t0) / S;
  for (int64_t i = 0; i < run; ++i) {
    int64_t t[S];
    for (int s = 0; s < S; ++s) t[s] = t0 + s * run + i;
    side_by_side(t);
  }
  for (int64_t t = t0 + S * run; t < t1; ++t) alone(&t);
}

// y[m][16 t .. 16 t + 16) for the MR activation rows at xq (row stride Kp), for S row tiles t[0 .. S) at once
// (S <= kAmxStreams): block by block, the block's activations loaded once, one TDPBSSD per row tile, so that S weight
// streams are in flight (see vnni_tile_rows). Each tile's operations are those of a tile alone, in the same order.
// (Earlier: one row tile, two consecutive blocks per step; four accumulator tiles in rotation over four blocks,
// with the A and B tiles reused, measured 1.5x slower than that.)
template <int MR, int S>
__attribute__((always_inline)) inline void amx_tile_rows(const int8_t* W, const uint16_t* tscale, const int8_t* xq,
                                                         const float* xs, int64_t Kp, const float* bias, float* y,
                                                         int64_t N, const int64_t* t) {
  static_assert(S >= 1 && S <= kAmxStreams, "one C and one B tile per stream");
  const int64_t NB = Kp / 32;
  alignas(64) int32_t cbuf[S][kAmxRows * 16];
  __m512 fa[S][MR];
  const int8_t* wt[S];
  start_row_tiles<MR, S>(W, NB, t, fa, wt);
  for (int64_t b = 0; b < NB; ++b) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {  // each weight stream, kAmxPrefetch bytes ahead (the hardware prefetcher alone: 15 % slower)
      const char* pf = reinterpret_cast<const char*>(wt[s] + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    }
    _tile_loadd(3, xq + b * 32, Kp);
    // tile numbers must be immediates: the streams are spelled out
    _tile_zero(0);
    _tile_loadd(4, wt[0] + b * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    if constexpr (S > 1) {
      _tile_zero(1);
      _tile_loadd(5, wt[1] + b * kAmxTile, 64);
      _tile_dpbssd(1, 3, 5);
    }
    if constexpr (S > 2) {
      _tile_zero(2);
      _tile_loadd(6, wt[2] + b * kAmxTile, 64);
      _tile_dpbssd(2, 3, 6);
    }
    _tile_stored(0, cbuf[0], 64);
    if constexpr (S > 1) _tile_stored(1, cbuf[1], 64);
    if constexpr (S > 2) _tile_stored(2, cbuf[2], 64);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m512 wsv = amx_block_scales(tscale, NB, t[s], b);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        fa[s][m] = amx_add_block(fa[s][m], _mm512_load_si512(cbuf[s] + m * 16), xs[m * NB + b], wsv);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) amx_store_rows<MR>(fa[s], bias, y, N, t[s]);
}

// y[m][16 t .. 16 t + 16) for the MR activation rows at xq, one row tile t, two consecutive blocks per step (C 0, 1;
// A 3, 7; B 4, 5): the same operations per tile as amx_tile_rows. For calls that walk their chunks once per block of
// 16 rows (a prefill), whose weights come from the cache: there, 3 row tiles per block measured 4-32 % slower.
template <int MR>
__attribute__((always_inline)) inline void amx_tile_block_pairs(const int8_t* W, const uint16_t* tscale,
                                                                const int8_t* xq, const float* xs, int64_t Kp,
                                                                const float* bias, float* y, int64_t N, int64_t t) {
  const int64_t NB = Kp / 32;
  alignas(64) int32_t cbuf[2][kAmxRows * 16];
  __m512 fa[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) fa[m] = _mm512_setzero_ps();
  const int8_t* wt = W + t * NB * kAmxTile;
  auto epilogue = [&](const int32_t* c, int64_t b) {
    const __m512 wsv = amx_block_scales(tscale, NB, t, b);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[m] = amx_add_block(fa[m], _mm512_load_si512(c + m * 16), xs[m * NB + b], wsv);
  };
  int64_t b = 0;
  for (; b + 2 <= NB; b += 2) {
    {
      const char* pf = reinterpret_cast<const char*>(wt + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 16
      for (int line = 0; line < 16; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(3, xq + b * 32, Kp);
    _tile_loadd(4, wt + b * kAmxTile, 64);
    _tile_loadd(7, xq + (b + 1) * 32, Kp);
    _tile_loadd(5, wt + (b + 1) * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    _tile_dpbssd(1, 7, 5);
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    epilogue(cbuf[0], b);
    epilogue(cbuf[1], b + 1);
  }
  if (b < NB) {
    _tile_zero(0);
    _tile_loadd(3, xq + b * 32, Kp);
    _tile_loadd(4, wt + b * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    _tile_stored(0, cbuf[0], 64);
    epilogue(cbuf[0], b);
  }
  amx_store_rows<MR>(fa, bias, y, N, t);
}

// Row tiles [t0, t1) for MR activation rows on the tiles: the range cut into kAmxStreams consecutive runs walked side
// by side, the tiles left over one at a time.
// from_memory false (a later block of 16 rows of a call that walks each chunk once per block, so that the weights
// come from the cache): amx_tile_block_pairs, tile by tile.
template <int MR>
inline void amx_tile_range(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs, int64_t Kp,
                           const float* bias, float* y, int64_t N, int64_t t0, int64_t t1, bool from_memory) {
  if (!from_memory) {
    for (int64_t t = t0; t < t1; ++t) amx_tile_block_pairs<MR>(W, tscale, xq, xs, Kp, bias, y, N, t);
    return;
  }
  walk_row_tiles<kAmxStreams>(
      t0, t1, [&](const int64_t* t) { amx_tile_rows<MR, kAmxStreams>(W, tscale, xq, xs, Kp, bias, y, N, t); },
      [&](const int64_t* t) { amx_tile_rows<MR, 1>(W, tscale, xq, xs, Kp, bias, y, N, t); });
}

// The same outputs as amx_tile_rows with AVX-512 VNNI instead of tiles, for 1 to kAmxVnniRows activation rows
// (where the tile path's store and reload of every block's dots costs more than it saves). vpdpbusd multiplies unsigned
// by signed bytes: the weights are flipped to w + 128 (xor 0x80) and the accumulator starts at -128 * sum(x of
// the block), so each lane holds the exact int32 dot of its output row, as TDPBSSD gives it.
// S row tiles t[0 .. S) at once, block by block: S weight streams in flight per thread instead of one (a core here
// reads 9.7 GB/s from one prefetched stream, 12.3 from two, 13.4-13.9 from four; two cores 18.8, 27.3 and 33).
// Each tile's operations are those of a tile alone, in the same order: which tiles go together never changes a bit.
template <int MR, int S>
__attribute__((always_inline)) inline void vnni_tile_rows(const int8_t* W, const uint16_t* tscale, const int8_t* xq,
                                                          const float* xs, const int32_t* xsum, int64_t Kp,
                                                          const float* bias, float* y, int64_t N, const int64_t* t) {
  const int64_t NB = Kp / 32;
  __m512 fa[S][MR];
  const int8_t* wt[S];
  start_row_tiles<MR, S>(W, NB, t, fa, wt);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < NB; ++b) {
    __m512i acc[S][MR];
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const char* pf = reinterpret_cast<const char*>(wt[s] + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[s][m] = _mm512_set1_epi32(-128 * xsum[m * NB + b]);
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m512i xv[MR];
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * Kp + b * 32 + q * 4, 4);
        xv[m] = _mm512_set1_epi32(quad);
      }
#pragma GCC unroll 16
      for (int s = 0; s < S; ++s) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(wt[s] + b * kAmxTile + q * 64), flip);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[s][m] = _mm512_dpbusd_epi32(acc[s][m], w, xv[m]);
      }
    }
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const __m512 wsv = amx_block_scales(tscale, NB, t[s], b);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) fa[s][m] = amx_add_block(fa[s][m], acc[s][m], xs[m * NB + b], wsv);
    }
  }
#pragma GCC unroll 16
  for (int s = 0; s < S; ++s) amx_store_rows<MR>(fa[s], bias, y, N, t[s]);
}

// Row tiles [t0, t1) for MR activation rows on VNNI: the range cut into kVnniStreams consecutive runs walked side
// by side (vnni_tile_rows<MR, kVnniStreams>), the tiles left over one at a time.
constexpr int kVnniStreams = 4;
template <int MR>
inline void vnni_tile_range(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                            const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                            int64_t t1) {
  walk_row_tiles<kVnniStreams>(
      t0, t1, [&](const int64_t* t) { vnni_tile_rows<MR, kVnniStreams>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t); },
      [&](const int64_t* t) { vnni_tile_rows<MR, 1>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t); });
}

// Row tiles [t0, t1) x activation rows [m0, m1), in row blocks of up to 16. configured: the row count this call
// has configured the thread's tiles for (0: not yet), updated here; the tiles stay configured afterwards.
void linear_amx_layout_amx(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                           const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                           int64_t t1, int64_t m0, int64_t m1, int& configured) {
  const int64_t NB = Kp / 32;
  for (int64_t m = m0; m < m1; m += kAmxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kAmxRows, m1 - m));
    const bool from_memory = m == m0;  // the first row block streams the chunk's weights; later ones find them cached
    if (mr <= kAmxVnniRows) {
      switch (mr) {
#define SPECDEC_VNNI_CASE(R) \
  case R: vnni_tile_range<R>(W, tscale, xq + m * Kp, xs + m * NB, xsum + m * NB, Kp, bias, y + m * N, N, t0, t1); break;
        SPECDEC_VNNI_CASE(1) SPECDEC_VNNI_CASE(2) SPECDEC_VNNI_CASE(3)
        default: vnni_tile_range<4>(W, tscale, xq + m * Kp, xs + m * NB, xsum + m * NB, Kp, bias, y + m * N, N, t0, t1); break;
#undef SPECDEC_VNNI_CASE
      }
      continue;
    }
    if (mr != configured) {
      amx_configure(mr);
      configured = mr;
    }
    const int8_t* xm = xq + m * Kp;
    const float* sm = xs + m * NB;
    float* ym = y + m * N;
    static_assert(kAmxVnniRows == 4, "blocks of 1 to 4 rows take VNNI above: the tile cases start at 5");
    switch (mr) {
#define SPECDEC_AMX_CASE(R) \
  case R: amx_tile_range<R>(W, tscale, xm, sm, Kp, bias, ym, N, t0, t1, from_memory); break;
      SPECDEC_AMX_CASE(5) SPECDEC_AMX_CASE(6) SPECDEC_AMX_CASE(7) SPECDEC_AMX_CASE(8)
      SPECDEC_AMX_CASE(9) SPECDEC_AMX_CASE(10) SPECDEC_AMX_CASE(11) SPECDEC_AMX_CASE(12)
      SPECDEC_AMX_CASE(13) SPECDEC_AMX_CASE(14) SPECDEC_AMX_CASE(15)
      default: amx_tile_range<16>(W, tscale, xm, sm, Kp, bias, ym, N, t0, t1, from_memory); break;
#undef SPECDEC_AMX_CASE
    }
  }
}

}  // namespace
#pragma GCC pop_options
#endif

namespace {

torch::Tensor q8_linear_amx_layout(const torch::Tensor& x_in, const torch::Tensor& qweight,
                                   const torch::Tensor& tile_scale, const c10::optional<torch::Tensor>& bias_in,
                                   int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear_amx: x must be 2-D [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "q8_linear_amx: qweight must be contiguous int8 [Np, Kp]");
  const int64_t M = x_in.size(0), K = x_in.size(1), Np = qweight.size(0), Kp = qweight.size(1), N = out_features;
  TORCH_CHECK(K == in_features, "q8_linear_amx: x has ", K, " features, weight expects ", in_features);
  TORCH_CHECK(Kp % kChunk == 0 && Kp >= K && Kp < K + kChunk, "q8_linear_amx: bad padded width ", Kp);
  TORCH_CHECK(Np % kAmxRows == 0 && N <= Np && N > Np - kAmxRows, "q8_linear_amx: ", Np, " packed rows for ", N, " outputs");
  const int64_t NB = Kp / 32, tiles = Np / kAmxRows;
  TORCH_CHECK(tile_scale.scalar_type() == at::kHalf && tile_scale.is_contiguous() && tile_scale.dim() == 3 &&
                  tile_scale.size(0) == tiles && tile_scale.size(1) == NB && tile_scale.size(2) == kAmxRows,
              "q8_linear_amx: tile_scale must be contiguous fp16 [Np/16, Kp/32, 16]");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q8_linear_amx");
  const torch::Tensor& x = in.x;
  const torch::Tensor& bias = in.bias;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const QuantizedRows act = quantized_rows_scratch(M, Kp, NB);
  int8_t* xq = act.q;
  float* xs = act.scales;
  int32_t* xsum = act.sums;
  const float* xp = x.data_ptr<float>();
  const bool amx = use_amx();
  const QuantizeUnit quantize_unit = pick_quantize_unit();
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) { quantize_rows_natural(quantize_unit, xp, K, Kp, a, b, xq, xs, xsum); });

  const int8_t* W = qweight.data_ptr<int8_t>();
  const uint16_t* ts = reinterpret_cast<const uint16_t*>(tile_scale.data_ptr<at::Half>());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Row tiles in chunks (chunk_tiles), each chunk walked for every block of 16 activation rows while its weights
  // stay in cache. Who computes a tile never changes its result.
  const int64_t chunk = chunk_tiles(tiles, NB * kAmxTile, M, M <= kAmxRows);
  const int64_t nchunks = (tiles + chunk - 1) / chunk;
  // A thread checks its tile configuration once per call (another library may have loaded its own since).
  auto run_chunks = [&](std::atomic<int64_t>& next) {
    int configured = 0;
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) {
      const int64_t t0 = c * chunk, t1 = std::min(tiles, t0 + chunk);
#ifdef SPECDEC_X86
      if (amx) {
        linear_amx_layout_amx(W, ts, xq, xs, xsum, Kp, bp, yp, N, t0, t1, 0, M, configured);
        continue;
      }
#endif
      linear_amx_layout_scalar(W, ts, xq, xs, Kp, bp, yp, N, t0 * kAmxRows, std::min(N, t1 * kAmxRows), 0, M);
    }
  };
  run_chunk_workers(nchunks, run_chunks);
  (void)amx;
  return y;
}

// embedding_rows for the AMX layout (qweight int8 [Np, Kp], the row's scales taken from wscale [N, Kp/32]):
// value k of row r is byte (k % 32 / 4) * 64 + (r % 16) * 4 + k % 4 of tile (r / 16, k / 32), times its scale.
torch::Tensor embedding_rows_amx(const torch::Tensor& qweight, const torch::Tensor& wscale, const torch::Tensor& ids_in,
                                 int64_t in_features) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "embedding_rows_amx: qweight must be contiguous int8 [Np, Kp]");
  const int64_t Np = qweight.size(0), Kp = qweight.size(1), K = in_features;
  TORCH_CHECK(Kp % kChunk == 0 && Np % kAmxRows == 0 && K <= Kp && K > 0, "embedding_rows_amx: bad shape");
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) <= Np && wscale.size(1) == Kp / 32,
              "embedding_rows_amx: scale must be contiguous fp16 [N, Kp/32]");
  const int64_t N = wscale.size(0), NB = Kp / 32;
  const torch::Tensor ids = embedding_ids(ids_in, N);
  const int64_t n = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  torch::Tensor out = torch::empty({n, K}, qweight.options().dtype(at::kFloat));
  const int8_t* W = qweight.data_ptr<int8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  parallel_rows(n, n * K, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = idp[i];
      const int8_t* tile_row = W + (r / kAmxRows) * NB * kAmxTile + (r % kAmxRows) * 4;
      float* dst = op + i * K;
      for (int64_t k = 0; k < K; ++k)
        dst[k] = static_cast<float>(tile_row[(k / 32) * kAmxTile + (k % 32 / 4) * 64 + k % 4]) *
                 half_to_float(ws[r * NB + k / 32]);
    }
  });
  return out;
}

void set_force_scalar(bool v) { g_force_scalar = v; }

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
std::string isa() { return use_avx() ? "avx512vnni" : "scalar"; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "int8 weight x Q8_0 activation linear (row invariant)");
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
  m.def("set_force_scalar", &set_force_scalar);
  m.def("parallel_threads", &parallel_threads, "distinct threads at::parallel_for uses for n items");
  m.def("isa", &isa);
  m.def("cpu_has_avx512vnni", &cpu_has_avx512vnni);
  m.def("q8_linear_amx", &q8_linear_amx_layout, "int8 linear on the AMX weight layout (row invariant)");
  m.def("amx_available", [] { return cpu_has_amx(); }, "AMX-INT8 present and granted by the OS");
}
