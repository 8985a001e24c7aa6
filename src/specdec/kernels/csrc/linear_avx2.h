// The int8 linear on the "vnni" weight layout (see linear.h for the layout and the reduction order), AVX2:
// 4 weight rows x up to 5 activation rows per tile, in passes of 2 weight rows (1 at 5 rows). Included inside namespace
// avx2 (see q8_kernels.cpp).
//
// A unit's 16 lanes are two ymm halves (lanes 0-7 = bytes 0-31 of each 64-byte chunk, lanes 8-15 = bytes
// 32-63), walked one after the other so that the int32 accumulators of a tile fit in 16 registers. AVX2 has no
// vpdpbusd: every 4-byte group's exact int32 dot is vpmaddubsw of |w| and x with w's sign (pairs of products,
// |w| <= 128 and |x| <= 127 so that a pair never saturates int16), then vpmaddwd with ones. That is the signed
// dot sum(q * x), where vpdpbusd on the unsigned bytes q + 128 gives sum(q * x) + 128 * sum(x); quantize_rows
// (signed_dot) therefore starts each lane's accumulator at the AVX-512 path's value plus 128 times the sum of the
// lane's activation bytes, and every lane holds the very same int32 as on the other paths before the same
// fp32 epilogue. Where the CPU has AVX-VNNI (256-bit vpdpbusd, VEX-encoded: Alder Lake and later, Sapphire
// Rapids), this file is compiled a second time with SPECDEC_AVX_VNNI (namespace avx2_vnni), which takes the unsigned
// weight bytes and the AVX-512 path's accumulator start as they are.

// Weight rows per pass of a tile of NR weight rows x MR activation rows, so that a pass's int32 accumulators (NP x
// MR) and weight vectors stay in the 16 registers: 2 up to 4 activation rows, 1 beyond (the int8 tiles of 5 rows,
// q5's of 8).
template <int NR, int MR>
constexpr int kPassRows = NR < 2 ? NR : (MR > 4 ? 1 : 2);

// lane half h of v: lanes 8h .. 8h + 7
inline __m256& lanes_half(vf& v, int h) { return h == 0 ? v.lo : v.hi; }

// The block scales of lanes 8h .. 8h + 7 of a unit of NB blocks starting at row scales ws (lane l takes block
// l / (16 / NB)), reading no further than the unit's NB halves.
template <int NB>
inline __m256 unit_scales(const uint16_t* ws, int h) {
  if constexpr (NB == 16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + 8 * h)));
  } else if constexpr (NB == 8) {  // 4 blocks per half, 2 lanes each
    const __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ws + 4 * h)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  } else if constexpr (NB == 4) {  // 2 blocks per half, 4 lanes each
    int32_t two;
    std::memcpy(&two, ws + 2 * h, sizeof(two));
    const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {  // one block per half
    return _mm256_set1_ps(half_to_float(ws[h]));
  }
}

// The int32 accumulators of NP weight rows x MR activation rows for lanes 8h .. 8h + 7 of unit u: each row's
// lane corrections (quantize_rows).
template <int NP, int MR>
__attribute__((always_inline)) inline void start_lanes(const int32_t* corr, int64_t ldc, int64_t u, int h,
                                                       __m256i (&ia)[NP][MR]) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + m * ldc + u * 16 + 8 * h));
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) ia[q][m] = c;
  }
}

// The scale epilogue of lanes 8h .. 8h + 7 of unit u (NB blocks from b0) for weight rows n0 .. n0 + NP - 1:
// fa = fma(float(ia), xscale * wscale, fa), lane by lane as unit() of the AVX-512 path.
template <int NR, int NP, int MR, int NB>
__attribute__((always_inline)) inline void add_scaled_lanes(const __m256i (&ia)[NP][MR], const uint16_t* wscale,
                                                            int64_t ldw, int64_t b0, const float* xs, int64_t ldc,
                                                            int64_t u, int h, int n0, vf (&fa)[NR][MR]) {
#pragma GCC unroll 2
  for (int q = 0; q < NP; ++q) {
    const __m256 wsv = unit_scales<NB>(wscale + (n0 + q) * ldw + b0, h);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xs + m * ldc + u * 16 + 8 * h), wsv);
      __m256& acc = lanes_half(fa[n0 + q][m], h);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[q][m]), s, acc);
    }
  }
}

// The passes of a unit (NB blocks from b0, unit index u) over its two lane halves and its weight rows, NP =
// kPassRows<NR, MR> at a time: each pass's int32 accumulators start at the rows' lane corrections (start_lanes),
// dots(h, n0, ia) adds the exact dots of lanes 8h .. 8h + 7 of weight rows n0 .. n0 + NP - 1 into them, and the
// scale epilogue adds them into fa (add_scaled_lanes). The int8 unit below and q5's (q5_avx2.h) differ only in
// their dots.
template <int NR, int MR, int NB, class Dots>
__attribute__((always_inline)) inline void unit_passes(const int32_t* corr, const float* xs, int64_t ldc,
                                                       int64_t ldw, int64_t u, int64_t b0, const uint16_t* wscale,
                                                       vf (&fa)[NR][MR], const Dots& dots) {
  constexpr int NP = kPassRows<NR, MR>;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
    for (int n0 = 0; n0 < NR; n0 += NP) {
      __m256i ia[NP][MR];
      start_lanes<NP, MR>(corr, ldc, u, h, ia);
      dots(h, n0, ia);
      add_scaled_lanes<NR, NP, MR, NB>(ia, wscale, ldw, b0, xs, ldc, u, h, n0, fa);
    }
  }
}

// One unit of NB blocks starting at block b0 (unit index u), both lane halves: the exact int32 dots of its
// blocks per lane, then one scale epilogue adds them into fa, lane by lane as unit() of the AVX-512 path.
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void unit(const uint8_t* W, const int8_t* X, const int32_t* corr,
                                                const float* xs, int64_t Kp, int64_t ldc, int64_t ldw, int64_t u,
                                                int64_t b0, const uint16_t* wscale, const uint8_t* pf,
                                                vf (&fa)[NR][MR]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  // W is the tile base: chunk q of row n is at W + (q * NR + n) * 64
  const uint8_t* wp = W + b0 * 32 * NR;
  const int8_t* xp = X + b0 * 32;
  if (pf) {
#pragma GCC unroll 8
    for (int j = 0; j < NB / 2; ++j)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + b0 * 32 * NR + (j * NR + n) * 64), _MM_HINT_T1);
  }
  constexpr int NP = kPassRows<NR, MR>;
  unit_passes<NR, MR, NB>(corr, xs, ldc, ldw, u, b0, wscale, fa,
                          [&](int h, int n0, __m256i (&ia)[NP][MR]) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int j = 0; j < NB / 2; ++j) {
      __m256i w[NP], w_abs[NP];
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) {
        w[q] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (j * NR + n0 + q) * 64 + 32 * h)), flip);
        w_abs[q] = _mm256_abs_epi8(w[q]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * Kp + j * 64 + 32 * h));
#pragma GCC unroll 2
        for (int q = 0; q < NP; ++q) {
#ifdef SPECDEC_AVX_VNNI
          // the unsigned weight bytes q + 128 as the AVX-512 path uses them (w[q] ^ 0x80 undone)
          ia[q][m] = _mm256_dpbusd_avx_epi32(ia[q][m], _mm256_xor_si256(w[q], flip), x);
#else
          const __m256i pairs = _mm256_maddubs_epi16(w_abs[q], _mm256_sign_epi8(x, w[q]));
          ia[q][m] = _mm256_add_epi32(ia[q][m], _mm256_madd_epi16(pairs, ones));
#endif
          // keep the accumulator in its register: left free, the compiler reassociated the additions of the
          // unrolled steps into trees of products held in spilled registers (7x slower at 8 rows)
          asm("" : "+x"(ia[q][m]));
        }
      }
    }
  });
}

// The tile's end: y[m][n] = hsum16(fa[n][m]) (+ bias[n]).
template <int NR, int MR>
__attribute__((always_inline)) inline void finish_tile(const vf (&fa)[NR][MR], const float* bias, float* y,
                                                       int64_t ldy) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      float v = hsum(fa[n][m]);
      if (bias) v = v + bias[n];
      y[m * ldy + n] = v;
    }
}

// Activation rows per tile: 5, the rows of a block split evenly over its tiles (linear_walk.h's tile_rows: 6 rows as
// 3 + 3, 10 as 5 + 5). A verify block of 5 rows is then one pass over the weights, where tiles of 4 made it 4 + 1: a
// second pass whose one row cost most of a 4-row tile (docs/kernels.md, "Tile rows on avx2"). q5_avx2.h: 8.
constexpr int kTileRows = 5;
constexpr bool kBalancedTiles = true;
