// The q4 linear (see q4_scalar.h for the layout and the reduction order), AVX2: 4 weight rows x up to 5 activation
// rows per tile, walked in passes of 2 weight rows (1 at 5 rows: kPassRows) over each lane half (lanes 0-7 = bytes 0-31 of every 64-byte
// chunk, lanes 8-15 = bytes 32-63), so that a pass's accumulators fit in the 16 registers. Included inside
// namespace avx2 after linear_avx2.h (finish_tile), before block_walk.h.
//
// The integer dots without vpdpbusd: vpmaddubsw(q, x) multiplies the unsigned quants (0..15) with the signed
// activations (-127..127) and adds adjacent pairs into int16, |pair| <= 2 * 15 * 127 = 3810, so it never
// saturates, and the 2 * NB / 4 <= 8 pair vectors of a unit add up in int16 without overflow (8 * 3810 = 30480 <
// 32767). One vpmaddwd with ones per unit then gives each lane's int32 sum of its 4-byte groups: the very
// int32 of the avx512 path, before the same fp32 epilogue. On CPUs with AVX-VNNI (Zen 5 and later, Alder Lake and
// later) this file is compiled a second time with SPECDEC_AVX_VNNI (namespace avx2_vnni): there the 256-bit
// vpdpbusd adds each 4-byte group's products into the lane's int32 directly, the same exact int32.

// The exact scales of lanes 8h .. 8h + 7 of one weight row's unit of NB sub-blocks: ws = d * sc, wm = dmin * m.
template <int NB>
inline void q4_lane_scales(const uint8_t* unit_scales, int h, __m256& ws, __m256& wm) {
  __m256i scale_bytes, min_bytes;  // the lanes' sub-block bytes, zero extended
  uint16_t d_half, dmin_half;      // the half's super-block
  if constexpr (NB == 16) {        // lanes 8h .. 8h + 7: sub-blocks 8h .. 8h + 7, super-block h
    scale_bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales + 8 * h)));
    min_bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit_scales + 16 + 8 * h)));
    std::memcpy(&d_half, unit_scales + 32 + 2 * h, sizeof(d_half));
    std::memcpy(&dmin_half, unit_scales + 36 + 2 * h, sizeof(dmin_half));
  } else {  // lanes 8h .. 8h + 7: sub-blocks 4h .. 4h + 3, two lanes each; one super-block
    int32_t four_scales, four_mins;
    std::memcpy(&four_scales, unit_scales + 4 * h, sizeof(four_scales));
    std::memcpy(&four_mins, unit_scales + 8 + 4 * h, sizeof(four_mins));
    const __m128i scales4 = _mm_cvtsi32_si128(four_scales);
    const __m128i mins4 = _mm_cvtsi32_si128(four_mins);
    scale_bytes = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(scales4, scales4));
    min_bytes = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(mins4, mins4));
    std::memcpy(&d_half, unit_scales + 16, sizeof(d_half));
    std::memcpy(&dmin_half, unit_scales + 18, sizeof(dmin_half));
  }
  const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(d_half) | (int32_t(dmin_half) << 16)));
  ws = _mm256_mul_ps(_mm256_broadcastss_ps(d_dmin), _mm256_cvtepi32_ps(scale_bytes));
  wm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin)), _mm256_cvtepi32_ps(min_bytes));
}

// Unit u (NB sub-blocks from sub-block 16 u) of NR weight rows x MR activation rows into fa (arguments as the
// avx512 path's q4_unit).
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void q4_unit(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                   const int8_t* X, const float* xs, const float* xsum, int64_t K,
                                                   int64_t ldc, int64_t u, const uint8_t* pf, vf (&fa)[NR][MR]) {
  constexpr int kChunks = NB / 4;
  constexpr int NP = kPassRows<NR, MR>;  // weight rows per pass
  const int64_t b0 = 16 * u;
  const uint8_t* wp = W + b0 * 16 * NR;  // the unit's first chunk
  const int8_t* xp = X + b0 * 32;
  const __m256i low_nibble = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // (the vpmaddwd that sums the pairs)
  if (pf) {
#pragma GCC unroll 4
    for (int j = 0; j < kChunks; ++j)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + b0 * 16 * NR + (j * NR + n) * 64), _MM_HINT_T1);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
    for (int n0 = 0; n0 < NR; n0 += NP) {
      __m256i pair_sums[NP][MR];  // int16 sums of the unit's vpmaddubsw pairs (with AVX-VNNI: the int32 lane dots)
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q)
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) pair_sums[q][m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < kChunks; ++j) {
        __m256i w_low[NP], w_high[NP];
#pragma GCC unroll 2
        for (int q = 0; q < NP; ++q) {
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (j * NR + n0 + q) * 64 + 32 * h));
          w_low[q] = _mm256_and_si256(packed, low_nibble);
          w_high[q] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibble);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + j * 64 + 32 * h));
          const __m256i x_high =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + (j + kChunks) * 64 + 32 * h));
#pragma GCC unroll 2
          for (int q = 0; q < NP; ++q) {
#ifdef SPECDEC_AVX_VNNI
            pair_sums[q][m] = _mm256_dpbusd_avx_epi32(pair_sums[q][m], w_low[q], x_low);
            pair_sums[q][m] = _mm256_dpbusd_avx_epi32(pair_sums[q][m], w_high[q], x_high);
#else
            pair_sums[q][m] = _mm256_add_epi16(pair_sums[q][m], _mm256_maddubs_epi16(w_low[q], x_low));
            pair_sums[q][m] = _mm256_add_epi16(pair_sums[q][m], _mm256_maddubs_epi16(w_high[q], x_high));
#endif
            // keep the sum in its register (as the int8 linear's avx2 unit: left free, the compiler reassociated
            // the unrolled additions into trees held in spilled registers)
            asm("" : "+x"(pair_sums[q][m]));
          }
        }
      }
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        __m256 ws, wm;
        q4_lane_scales<NB>(scales + (n0 + q) * scale_row_bytes + kQ4UnitScaleBytes * u, h, ws, wm);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
#ifdef SPECDEC_AVX_VNNI
          const __m256i idot = pair_sums[q][m];
#else
          const __m256i idot = _mm256_madd_epi16(pair_sums[q][m], ones);
#endif
          const __m256 t = _mm256_mul_ps(wm, _mm256_loadu_ps(xsum + m * ldc + u * 16 + 8 * h));
          const __m256 inner = _mm256_fmsub_ps(ws, _mm256_cvtepi32_ps(idot), t);
          __m256& acc = lanes_half(fa[n0 + q][m], h);
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * ldc + u * 16 + 8 * h), inner, acc);
        }
      }
    }
  }
}

// Activation rows per tile (block_walk.h): 5, so that a verify block of 5 rows is one pass over the weights (tiles of
// 4 made it 4 + 1, the lone row costing most of a 4-row tile), in passes of 1 weight row (kPassRows).
constexpr int kQ4TileRows = 5;
