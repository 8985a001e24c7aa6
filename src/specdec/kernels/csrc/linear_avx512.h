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

// NR weight rows x MR activation rows over the units [u0, u1) of K. The accumulators start at zero when u0 == 0
// and from partial[n * MR ... ] (the sums of the units before u0, stored exactly) otherwise; when u1 == L.U the
// tile ends: y = hsum16(fa) (+ bias); otherwise fa is stored back into partial. The units are added into fa in
// the same order however K is split, so a K-split tile is bitwise the unsplit one. Sliced = false: the whole
// of K (u0 = 0, u1 = L.U, no partial), compiled without the slice bookkeeping.
// Always inlined: left to itself the compiler made it a call per tile, 3-6 % of a one-row call over Gemma's
// output layer (65536 tiles of 2.5 KB).
template <int NR, int MR, bool Sliced>
__attribute__((always_inline)) inline void tile(const uint8_t* W, const int8_t* X, const int32_t* corr,
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
    unit<NR, MR, 16>(W, X, corr, xs, Kp, ldc, ldw, u, u * 16, wscale, pf, fa);
  for (int64_t t = 0; t < L.T; ++t) {
    const int64_t u = L.G + t;
    if (u < u0 || u >= u1) continue;
    switch (L.tail_nb[t]) {
      case 8: unit<NR, MR, 8>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      case 4: unit<NR, MR, 4>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      default: unit<NR, MR, 2>(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
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

// mr activation rows (1..3) of a tile; partial == nullptr: the whole of K (u0, u1 unused), else the units
// [u0, u1) of a K-sliced walk (see tile).
template <int NR>
inline void tile_mr(int mr, const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs,
                        const Layout& L, const uint16_t* wscale, const float* bias, float* y, int64_t ldy,
                        const uint8_t* pf = nullptr, int64_t u0 = 0, int64_t u1 = 0, __m512* partial = nullptr) {
  if (partial == nullptr) {
    switch (mr) {
      case 1: tile<NR, 1, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
      case 2: tile<NR, 2, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
      default: tile<NR, 3, false>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr); break;
    }
    return;
  }
  switch (mr) {
    case 1: tile<NR, 1, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
    case 2: tile<NR, 2, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
    default: tile<NR, 3, true>(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial); break;
  }
}

// process weight rows [n0, n1) x activation rows [m0, m1)
void linear_block(const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
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
          tile_mr<1>(mr, W + i * L.Kp, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + i * (L.Kp / 32),
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
        tile_mr<NR>(mr, W + n * L.Kp, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + n * (L.Kp / 32),
                        bias ? bias + n : nullptr, y + m * N + n, N, pf, u0, u1,
                        slice_units < L.U ? partial + (m - m0) * NR : nullptr);
      }
      if (u1 == L.U) break;
    }
  }
}

// quantize_unit_scalar's operations (amax of |x| -- exact in any order --, d = amax / 127, id = 1 / d,
// nearest-even rounding of x * id, clamp to +-127, exact int sum), 16 values per instruction, in two passes
