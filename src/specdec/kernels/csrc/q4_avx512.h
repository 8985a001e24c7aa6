// The q4 linear (see q4_scalar.h for the layout and the reduction order), AVX-512 VNNI: 4 weight rows x up to 4
// activation rows per tile. Included inside namespace avx512 after linear_avx512.h (finish_tile), before
// block_walk.h (the walk over tiles and row blocks). The amx path runs this code too.
//
// Each 64-byte chunk of quants is two weight vectors (its low nibbles, its high nibbles), one vpdpbusd each per
// activation row: unsigned quants 0..15 times signed int8 activations, summed exactly into the lane's int32.

// The exact scales of one weight row's unit of NB sub-blocks, per lane: ws = d * sc, wm = dmin * m.
template <int NB>
inline void q4_lane_scales(const uint8_t* unit_scales, __m512& ws, __m512& wm) {
  __m512i scale_bytes, min_bytes;  // one sub-block's byte per lane, zero extended
  __m128 d_dmin;                   // [d0, d1, dmin0, dmin1] (NB 16) or [d, dmin] (NB 8)
  __m512i d_lanes, dmin_lanes;     // which element of d_dmin each lane takes
  if constexpr (NB == 16) {
    scale_bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit_scales)));
    min_bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit_scales + 16)));
    d_dmin = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales + 32)));
    d_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    dmin_lanes = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  } else {  // two lanes per sub-block: each byte twice
    const __m128i scales8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales));
    const __m128i mins8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales + 8));
    scale_bytes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(scales8, scales8));
    min_bytes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mins8, mins8));
    int32_t two_halves;
    std::memcpy(&two_halves, unit_scales + 16, sizeof(two_halves));
    d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(two_halves));
    d_lanes = _mm512_setzero_si512();
    dmin_lanes = _mm512_set1_epi32(1);
  }
  const __m512 d_dmin_wide = _mm512_castps128_ps512(d_dmin);
  ws = _mm512_mul_ps(_mm512_permutexvar_ps(d_lanes, d_dmin_wide), _mm512_cvtepi32_ps(scale_bytes));
  wm = _mm512_mul_ps(_mm512_permutexvar_ps(dmin_lanes, d_dmin_wide), _mm512_cvtepi32_ps(min_bytes));
}

// Unit u (NB sub-blocks from sub-block 16 u) of NR weight rows x MR activation rows into fa. W: the tile's
// quants (chunk c of row n at W + (c * NR + n) * 64), scales: the tile's first row of scales; X, xs, xsum: the
// first activation row's quantized values [K] and lane scales and sums [ldc].
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void q4_unit(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                   const int8_t* X, const float* xs, const float* xsum, int64_t K,
                                                   int64_t ldc, int64_t u, const uint8_t* pf, __m512 (&fa)[NR][MR]) {
  constexpr int kChunks = NB / 4;
  const int64_t b0 = 16 * u;
  const uint8_t* wp = W + b0 * 16 * NR;  // the unit's first chunk
  const int8_t* xp = X + b0 * 32;
  const __m512i low_nibble = _mm512_set1_epi8(0x0F);
  __m512i ia[NR][MR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) ia[n][m] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < kChunks; ++j) {
    __m512i w_low[NR], w_high[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const __m512i packed = _mm512_loadu_si512(wp + (j * NR + n) * 64);
      w_low[n] = _mm512_and_si512(packed, low_nibble);
      w_high[n] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibble);
    }
    if (pf) {
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + b0 * 16 * NR + (j * NR + n) * 64), _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512i x_low = _mm512_loadu_si512(xp + m * K + j * 64);
      const __m512i x_high = _mm512_loadu_si512(xp + m * K + (j + kChunks) * 64);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        ia[n][m] = _mm512_dpbusd_epi32(ia[n][m], w_low[n], x_low);
        ia[n][m] = _mm512_dpbusd_epi32(ia[n][m], w_high[n], x_high);
      }
    }
  }
  // the epilogue: the scales of the tile's NR rows first, then each activation row's lane scales and sums once,
  // with every weight row (the order of the operations within each output element is the scalar path's)
  __m512 ws[NR], wm[NR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n) q4_lane_scales<NB>(scales + n * scale_row_bytes + kQ4UnitScaleBytes * u, ws[n], wm[n]);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512 x_scales = _mm512_loadu_ps(xs + m * ldc + u * 16);
    const __m512 x_sums = _mm512_loadu_ps(xsum + m * ldc + u * 16);
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const __m512 t = _mm512_mul_ps(wm[n], x_sums);
      const __m512 inner = _mm512_fmsub_ps(ws[n], _mm512_cvtepi32_ps(ia[n][m]), t);
      fa[n][m] = _mm512_fmadd_ps(x_scales, inner, fa[n][m]);
    }
  }
}

// Activation rows per tile (block_walk.h): 4, filled from a block's first row.
constexpr int kQ4TileRows = 4;
