// The op set of the avx512 path: 16 fp32 lanes in one zmm.
//
// simd_avx2.h implements the same operations on two ymm (lanes 0-7 and 8-15); vector_kernels.h is written once
// over them. Every operation is lane-wise IEEE fp32 (or exact integer), and the reductions (hsum, hmax, reduce16)
// follow one fixed tree that both files spell out, so the two paths give the same bits as each other and as the
// scalar path (scalar.h), which is the executable specification.
// Included inside namespace avx512 under #pragma GCC target (see q8_kernels.cpp).

using vf = __m512;
using vi = __m512i;
using vm = __mmask16;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
// lanes [0, n): none for n <= 0, all for n >= 16
inline vm first(int64_t n) { return n >= 16 ? vm(0xffff) : n <= 0 ? vm(0) : vm((1u << n) - 1u); }
inline vf load_first(const float* p, vm m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store_first(float* p, vm m, vf v) { _mm512_mask_storeu_ps(p, m, v); }

inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }  // b where either is NaN (as maxps)
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline vf neg(vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(int32_t(0x80000000u)))); }
inline vf round_even(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^int(fx) as the float whose exponent field is int(fx) + 127 (fx integral, in range)
inline vf exp2i(vf fx) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23));
}

inline vf select(vm m, vf if_true, vf if_false) { return _mm512_mask_mov_ps(if_false, m, if_true); }
inline vm less(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline vm greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vm unordered(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline vm either(vm a, vm b) { return vm(a | b); }
inline bool any(vm m) { return m != 0; }

// hsum16_scalar's tree: t8 = lanes [0, 8) + [8, 16), t4 = t8[0:4] + t8[4:8], t2 = t4[0:2] + t4[2:4], t2[0] + t2[1]
inline float hsum(vf a) {
  const __m256 lo = _mm512_castps512_ps256(a);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// the largest lane: m8 = max(hi, lo), m4 = max(m8[4:8], m8[0:4]), m2 = max(m4, m4 swapped by pairs), max(m2, m2
// swapped within pairs), lane 0 (GCC's _mm512_reduce_max_ps, spelled out so that simd_avx2.h can follow it)
inline float hmax(vf a) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 m8 = _mm256_max_ps(hi, _mm512_castps512_ps256(a));
  const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
  const __m128 m2 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128 m1 = _mm_max_ps(m2, _mm_shuffle_ps(m2, m2, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(m1);
}

// 16 vectors -> 16 sums, each with hsum's tree: lane 4k + i of the result = hsum(v[4i + k]).
inline vf reduce16(const vf* v) {
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

// s[p][0 .. 4) = lanes [4p, 4p + 4) of r
inline void store_quarters(vf r, float* const* s) {
  _mm_storeu_ps(s[0], _mm512_castps512_ps128(r));
  _mm_storeu_ps(s[1], _mm512_extractf32x4_ps(r, 1));
  _mm_storeu_ps(s[2], _mm512_extractf32x4_ps(r, 2));
  _mm_storeu_ps(s[3], _mm512_extractf32x4_ps(r, 3));
}

// fp32 -> fp16 bits, to nearest even (vcvtps2ph, as c10::Half)
inline void store_halves(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// integers
inline vi iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi add(vi a, int32_t b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
inline vi select(vm m, vi if_true, vi if_false) { return _mm512_mask_mov_epi32(if_false, m, if_true); }
inline void store(int32_t* p, vi v) { _mm512_storeu_si512(p, v); }
inline vi to_int(vf a) { return _mm512_cvtps_epi32(a); }  // integral values: exact
inline int32_t hsum(vi a) { return _mm512_reduce_add_epi32(a); }  // exact in any order
inline void store_bytes(int8_t* p, vi a) {  // values in [-128, 127]
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
}

// vector_kernels.h's tiling for 32 registers
constexpr bool kJointScores = true;  // score 4 pairs x 4 keys per step (16 accumulators)
constexpr int kPvChunks = 8;         // column chunks of 16 per P @ V step of one pair
constexpr int kPvTileChunks = 4;     // ... of 4 pairs side by side
