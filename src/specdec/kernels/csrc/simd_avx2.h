// The op set of the avx2 path (AVX2 + FMA + F16C): 16 fp32 lanes in two ymm, lo = lanes 0-7, hi = lanes 8-15.
// The same operations as simd_avx512.h, lane by lane, and the same reduction trees (see there).
// Included inside namespace avx2 under #pragma GCC target (see q8_kernels.cpp).

struct vf {
  __m256 lo, hi;
};
struct vi {
  __m256i lo, hi;
};
struct vm {  // a lane mask: all ones where set
  __m256 lo, hi;
};

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline __m256i first8(int64_t n) {  // lanes [0, n) of 8
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(n, 0), 8))), lanes);
}
inline vm first(int64_t n) { return {_mm256_castsi256_ps(first8(n)), _mm256_castsi256_ps(first8(n - 8))}; }
inline vf load_first(const float* p, vm m) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline void store_first(float* p, vm m, vf v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}

inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf abs(vf a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
inline vf neg(vf a) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)));
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
inline vf round_even(vf a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
inline __m256 exp2i8(__m256 fx) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23));
}
inline vf exp2i(vf fx) { return {exp2i8(fx.lo), exp2i8(fx.hi)}; }

inline vf select(vm m, vf if_true, vf if_false) {
  return {_mm256_blendv_ps(if_false.lo, if_true.lo, m.lo), _mm256_blendv_ps(if_false.hi, if_true.hi, m.hi)};
}
inline vm less(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)}; }
inline vm greater(vf a, vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
inline vm unordered(vf a) { return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)}; }
inline vm either(vm a, vm b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
inline bool any(vm m) { return _mm256_movemask_ps(_mm256_or_ps(m.lo, m.hi)) != 0; }

// the 8-lane part of hsum's tree, from t8 on
inline float hsum8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
inline float hsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }

inline float hmax(vf a) {
  const __m256 m8 = _mm256_max_ps(a.hi, a.lo);
  const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
  const __m128 m2 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128 m1 = _mm_max_ps(m2, _mm_shuffle_ps(m2, m2, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(m1);
}

// [hsum8(t[0]), ..., hsum8(t[7])] with hsum8's tree for each: t4 = t8[0:4] + t8[4:8], t2 = t4[0:2] + t4[2:4],
// t2[0] + t2[1], the partial sums of the 8 vectors gathered by shuffles.
inline __m256 hsum8x8(const __m256* t) {
  __m256 x[4];  // x[i] = [t4 of t[2i] | t4 of t[2i + 1]]
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    x[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31));
  // y0 = [t2 of t0, t2 of t2 | t2 of t1, t2 of t3], y1 the same for t4 .. t7
  const __m256 y0 = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 y1 = _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // z = [s0, s2, s4, s6 | s1, s3, s5, s7]
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 16 vectors -> 16 sums, each with hsum's tree: lane 4k + i of the result = hsum(v[4i + k]).
inline vf reduce16(const vf* v) {
  __m256 t[16];  // t8 of v[4i + k] at 8 * (k / 2) + ... : gathered in result order
#pragma GCC unroll 16
  for (int lane = 0; lane < 16; ++lane) {
    const vf& a = v[4 * (lane % 4) + lane / 4];
    t[lane] = _mm256_add_ps(a.lo, a.hi);
  }
  return {hsum8x8(t), hsum8x8(t + 8)};
}

inline void store_quarters(vf r, float* const* s) {
  _mm_storeu_ps(s[0], _mm256_castps256_ps128(r.lo));
  _mm_storeu_ps(s[1], _mm256_extractf128_ps(r.lo, 1));
  _mm_storeu_ps(s[2], _mm256_castps256_ps128(r.hi));
  _mm_storeu_ps(s[3], _mm256_extractf128_ps(r.hi, 1));
}

inline void store_halves(uint16_t* p, vf v) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.lo, kNearest));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.hi, kNearest));
}

// integers
inline vi iota() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline vi add(vi a, int32_t b) {
  const __m256i bv = _mm256_set1_epi32(b);
  return {_mm256_add_epi32(a.lo, bv), _mm256_add_epi32(a.hi, bv)};
}
inline vi select(vm m, vi if_true, vi if_false) {
  return {_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false.lo), _mm256_castsi256_ps(if_true.lo), m.lo)),
          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false.hi), _mm256_castsi256_ps(if_true.hi), m.hi))};
}
inline void store(int32_t* p, vi v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), v.hi);
}
inline vi to_int(vf a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline int32_t hsum(vi a) {
  const __m256i s8 = _mm256_add_epi32(a.lo, a.hi);
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline void store_bytes(int8_t* p, vi a) {  // values in [-128, 127]
  const __m256i words = _mm256_packs_epi32(a.lo, a.hi);  // [lo 0-3, hi 0-3 | lo 4-7, hi 4-7]
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  // bytes = [lo 0-3, hi 0-3, lo 4-7, hi 4-7]: put the 4-byte groups back in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0)));
}

// vector_kernels.h's tiling for 16 registers (each vf takes two): one pair at a time for the scores, and fewer
// column chunks per P @ V step; which pairs or chunks go together never changes a result
constexpr bool kJointScores = false;
constexpr int kPvChunks = 4;
constexpr int kPvTileChunks = 1;
