// The q6 linear (see q6_scalar.h for the layout and the reduction order), AVX-512 VNNI: 4 weight rows x up to 4
// activation rows per tile. Included inside namespace avx512 after linear_avx512.h (finish_tile), before
// block_walk.h (the walk over tiles and row blocks). The amx path runs this code too.
//
// A unit's 3 chunks give its 4 weight vectors: the two nibble chunks their low 4 bits, the third their high 2
// bits (split once into pairs 0, 2 and pairs 1, 3, each then one shift and one bit select away from its place).
// One vpdpbusd per weight vector and activation row: unsigned quants 0..63 times signed int8 activations, summed
// exactly into the lane's int32, which starts at the lane's correction -32 * sum(x).

// Bits 0-3 of every byte from a, bits 4-7 from b.
inline __m512i q6_select_nibbles(__m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), a, b, 0xCA);
}

// Unit u of NR weight rows x MR activation rows into fa. W: the tile's quants (chunk c of row n at
// W + (c * NR + n) * 64), scales: the tile's first row of scales; X, xs, corr: the first activation row's
// quantized values [K] and lane scales and corrections [ldc].
template <int NR, int MR>
__attribute__((always_inline)) inline void q6_unit(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                   const int8_t* X, const float* xs, const int32_t* corr, int64_t K,
                                                   int64_t ldc, int64_t u, const uint8_t* pf, __m512 (&fa)[NR][MR]) {
  const uint8_t* wp = W + u * kQ6UnitBytes * NR;  // the unit's first chunk
  const int8_t* xp = X + u * kQ6SuperBlock;
  const __m512i pairs_mask = _mm512_set1_epi8(0x33);
  __m512i ia[NR][MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512i c = _mm512_loadu_si512(corr + m * ldc + u * 16);
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) ia[n][m] = c;
  }
  if (pf) {
#pragma GCC unroll 16
    for (int c = 0; c < 3 * NR; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(pf + u * kQ6UnitBytes * NR + c * 64), _MM_HINT_T1);
  }
  // nibble chunk c (0, 1): weight vectors c (its low nibbles) and c + 2 (its high nibbles)
#pragma GCC unroll 2
  for (int c = 0; c < 2; ++c) {
    __m512i w_low[NR], w_high[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const __m512i nibbles = _mm512_loadu_si512(wp + (c * NR + n) * 64);
      const __m512i high_bits = _mm512_loadu_si512(wp + (2 * NR + n) * 64);
      // bits 0-1 and 4-5 of each byte: the high bits of vectors c and c + 2
      const __m512i pairs = _mm512_and_si512(c == 0 ? high_bits : _mm512_srli_epi16(high_bits, 2), pairs_mask);
      w_low[n] = q6_select_nibbles(nibbles, _mm512_slli_epi16(pairs, 4));
      w_high[n] = q6_select_nibbles(_mm512_srli_epi16(nibbles, 4), pairs);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512i x_low = _mm512_loadu_si512(xp + m * K + c * 64);
      const __m512i x_high = _mm512_loadu_si512(xp + m * K + (c + 2) * 64);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        ia[n][m] = _mm512_dpbusd_epi32(ia[n][m], w_low[n], x_low);
        ia[n][m] = _mm512_dpbusd_epi32(ia[n][m], w_high[n], x_high);
      }
    }
  }
  // the epilogue: ws = d * sc per weight row, then s = ws * xscale and fa = fma(float(idot), s, fa)
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n) {
    const uint8_t* unit_scales = scales + n * scale_row_bytes + kQ6ScaleBytes * u;
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit_scales)));
    uint16_t d_bits;
    std::memcpy(&d_bits, unit_scales + 16, sizeof(d_bits));
    const __m512 d = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_bits))));
    const __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 s = _mm512_mul_ps(ws, _mm512_loadu_ps(xs + m * ldc + u * 16));
      fa[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[n][m]), s, fa[n][m]);
    }
  }
}

// Activation rows per tile (block_walk.h): 4, filled from a block's first row.
constexpr int kQ6TileRows = 4;
constexpr bool kBlockBalancedTiles = false;
