// The q6 linear (see q6_scalar.h for the layout and the reduction order), AVX2: 4 weight rows x up to 5 activation
// rows per tile, walked one weight row at a time over each lane half (lanes 0-7 = bytes 0-31 of every 64-byte
// chunk, lanes 8-15 = bytes 32-63), so that a pass's registers fit in the 16. Included inside namespace avx2 after
// linear_avx2.h (finish_tile), before block_walk.h.
//
// The integer dots without vpdpbusd: vpmaddubsw(q, x) multiplies the unsigned quants (0..63) with the signed
// activations (-127..127) and adds adjacent pairs into int16, |pair| <= 2 * 63 * 127 = 16002, so it never
// saturates, and two such vectors add up in int16 without overflow (32004 < 32767). One vpmaddwd with ones per two
// weight vectors then gives each lane's int32 sums of its 4-byte groups: the very int32 of the avx512 path,
// before the same fp32 epilogue. With AVX-VNNI (SPECDEC_AVX_VNNI, namespace avx2_vnni) the 256-bit vpdpbusd adds
// each 4-byte group's products into the lane's int32 directly, the same exact int32.

// Bits 0-3 of every byte from a, bits 4-7 from b.
inline __m256i q6_select_nibbles(__m256i a, __m256i b) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  return _mm256_or_si256(_mm256_and_si256(a, low_nibbles), _mm256_andnot_si256(low_nibbles, b));
}

// Unit u of NR weight rows x MR activation rows into fa (arguments as the avx512 path's q6_unit).
template <int NR, int MR>
__attribute__((always_inline)) inline void q6_unit(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                   const int8_t* X, const float* xs, const int32_t* corr, int64_t K,
                                                   int64_t ldc, int64_t u, const uint8_t* pf, vf (&fa)[NR][MR]) {
  const uint8_t* wp = W + u * kQ6UnitBytes * NR;  // the unit's first chunk
  const int8_t* xp = X + u * kQ6SuperBlock;
  const __m256i pairs_mask = _mm256_set1_epi8(0x33);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // (the vpmaddwd that sums the pairs)
  if (pf) {
#pragma GCC unroll 16
    for (int c = 0; c < 3 * NR; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(pf + u * kQ6UnitBytes * NR + c * 64), _MM_HINT_T1);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      __m256i idot[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
        idot[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + m * ldc + u * 16 + 8 * h));
      const __m256i high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (2 * NR + n) * 64 + 32 * h));
      // nibble chunk c (0, 1): weight vectors c (its low nibbles) and c + 2 (its high nibbles)
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (c * NR + n) * 64 + 32 * h));
        const __m256i pairs = _mm256_and_si256(c == 0 ? high_bits : _mm256_srli_epi16(high_bits, 2), pairs_mask);
        const __m256i w_low = q6_select_nibbles(nibbles, _mm256_slli_epi16(pairs, 4));
        const __m256i w_high = q6_select_nibbles(_mm256_srli_epi16(nibbles, 4), pairs);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + c * 64 + 32 * h));
          const __m256i x_high =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + (c + 2) * 64 + 32 * h));
#ifdef SPECDEC_AVX_VNNI
          idot[m] = _mm256_dpbusd_avx_epi32(idot[m], w_low, x_low);
          idot[m] = _mm256_dpbusd_avx_epi32(idot[m], w_high, x_high);
#else
          const __m256i pair_sums =
              _mm256_add_epi16(_mm256_maddubs_epi16(w_low, x_low), _mm256_maddubs_epi16(w_high, x_high));
          idot[m] = _mm256_add_epi32(idot[m], _mm256_madd_epi16(pair_sums, ones));
#endif
        }
      }
      // the epilogue of lanes 8h .. 8h + 7: ws = d * sc, s = ws * xscale, fa = fma(float(idot), s, fa)
      const uint8_t* unit_scales = scales + n * scale_row_bytes + kQ6ScaleBytes * u;
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales + 8 * h)));
      uint16_t d_bits;
      std::memcpy(&d_bits, unit_scales + 16, sizeof(d_bits));
      const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_bits))));
      const __m256 ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 s = _mm256_mul_ps(ws, _mm256_loadu_ps(xs + m * ldc + u * 16 + 8 * h));
        __m256& acc = lanes_half(fa[n][m], h);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot[m]), s, acc);
      }
    }
  }
}

// Activation rows per tile (block_walk.h): 5, as q4's; a block's rows split evenly over its tiles (8 as 4 + 4).
constexpr int kQ6TileRows = 5;
constexpr bool kBlockBalancedTiles = true;
