// The int8 linear on the "vnni" weight layout (see linear.h for the layout and the reduction order), AVX-512
// VNNI: 4 weight rows x up to 3 activation rows per tile, one vpdpbusd per 64 bytes of a weight row and
// activation row. Included inside namespace avx512 (see q8_kernels.cpp).

// [hsum(a), hsum(b), hsum(c), hsum(d)] bitwise: the same tree of additions per
// vector, four vectors at a time (t8 = lo256 + hi256, t4 = t8[0:4] + t8[4:8], t2 = t4[0:2] + t4[2:4],
// t1 = t2[0] + t2[1]), with each vector's partial sums gathered into one register by shuffles.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
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

// One unit of NB blocks starting at block b0 (unit index u): NB/2 vpdpbusd per (weight row, activation row)
// give the exact int32 dots of its blocks, then one scale epilogue adds them into fa.
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void unit(const uint8_t* W, const int8_t* X, const int32_t* corr,
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

// The tile's end: y[m][n] = hsum16(fa[n][m]) (+ bias[n]), four rows' sums at once when NR == 4.
template <int NR, int MR>
__attribute__((always_inline)) inline void finish_tile(const vf (&fa)[NR][MR], const float* bias, float* y,
                                                       int64_t ldy) {
  if constexpr (NR == 4) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      __m128 v = hsum4(fa[0][m], fa[1][m], fa[2][m], fa[3][m]);
      if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias));
      _mm_storeu_ps(y + m * ldy, v);
    }
  } else {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        float v = hsum(fa[n][m]);
        if (bias) v = v + bias[n];
        y[m * ldy + n] = v;
      }
  }
}

constexpr int kTileRows = 3;  // activation rows per tile
constexpr bool kBalancedTiles = false;  // a block's rows in tiles of 3 from its first (linear_walk.h's tile_rows)
