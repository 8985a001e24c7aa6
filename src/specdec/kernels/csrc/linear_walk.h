// The walk of the int8 linear over the "vnni" layout, the same for every vector path: weight rows in tiles of 4
// (the last N % 4 as single rows), each tile over blocks of up to kTileRows activation rows (tile_rows), wide tiles in
// K slices.
// Included inside namespace avx512 and namespace avx2 after their linear_*.h, which define unit<NR, MR, NB> (one
// unit of K into the accumulators), finish_tile<NR, MR> (the tile's sums), kTileRows and kBalancedTiles; and again
// inside namespace q5_units of q5_avx2.h, with q5's own unit. The walk calls its functions as (f)(...): without
// argument-dependent lookup, which would also find the enclosing namespace's walk through the argument types.

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
                                                    int64_t u0, int64_t u1, vf* partial) {
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
  vf fa[NR][MR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[n][m] = (!Sliced || u0 == 0) ? zero() : partial[n * MR + m];

  for (int64_t u = u0; u < std::min(u1, L.G); ++u)
    (unit<NR, MR, 16>)(W, X, corr, xs, Kp, ldc, ldw, u, u * 16, wscale, pf, fa);
  for (int64_t t = 0; t < L.T; ++t) {
    const int64_t u = L.G + t;
    if (u < u0 || u >= u1) continue;
    switch (L.tail_nb[t]) {
      case 8: (unit<NR, MR, 8>)(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      case 4: (unit<NR, MR, 4>)(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
      default: (unit<NR, MR, 2>)(W, X, corr, xs, Kp, ldc, ldw, u, L.b0(u), wscale, pf, fa); break;
    }
  }
  if (Sliced && u1 < L.U) {
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) partial[n * MR + m] = fa[n][m];
    return;
  }
  finish_tile<NR, MR>(fa, bias, y, ldy);
}

// the rows of the next tile when `left` activation rows remain: kTileRows at most; with kBalancedTiles, the rows
// split as evenly as tiles of up to kTileRows allow (6 as 3 + 3, not 5 + 1)
inline int tile_rows(int64_t left) {
  if constexpr (kBalancedTiles) return even_block_rows(left, kTileRows);
  return static_cast<int>(std::min<int64_t>(kTileRows, left));
}

// mr activation rows (1 .. kTileRows) of a tile; partial == nullptr: the whole of K (u0, u1 unused), else the
// units [u0, u1) of a K-sliced walk (see tile).
template <int NR>
inline void tile_mr(int mr, const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs,
                        const Layout& L, const uint16_t* wscale, const float* bias, float* y, int64_t ldy,
                        const uint8_t* pf = nullptr, int64_t u0 = 0, int64_t u1 = 0, vf* partial = nullptr) {
  static_assert(kTileRows >= 1 && kTileRows <= 8, "the cases below");
  const auto rows = [&](auto rows_constant) {
    constexpr int R = decltype(rows_constant)::value;
    if constexpr (R <= kTileRows) {
      if (partial != nullptr)
        (tile<NR, R, true>)(W, X, corr, xs, L, wscale, bias, y, ldy, pf, u0, u1, partial);
      else
        (tile<NR, R, false>)(W, X, corr, xs, L, wscale, bias, y, ldy, pf, 0, L.U, nullptr);
    }
  };
  switch (mr) {
    case 1: rows(std::integral_constant<int, 1>{}); break;
    case 2: rows(std::integral_constant<int, 2>{}); break;
    case 3: rows(std::integral_constant<int, 3>{}); break;
    case 4: rows(std::integral_constant<int, 4>{}); break;
    case 5: rows(std::integral_constant<int, 5>{}); break;
    case 6: rows(std::integral_constant<int, 6>{}); break;
    case 7: rows(std::integral_constant<int, 7>{}); break;
    default: rows(std::integral_constant<int, 8>{}); break;
  }
}

// The plain weight row at Wr (the last N % 4 rows of a layer) x activation rows [m0, m1): y[m][0] at y + m * N.
inline void plain_row(const uint8_t* Wr, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                      const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t m0, int64_t m1) {
  const int64_t ldc = L.U * 16;
  for (int64_t m = m0; m < m1;) {
    const int mr = tile_rows(m1 - m);
    (tile_mr<1>)(mr, Wr, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale, bias, y + m * N, N);
    m += mr;
  }
}

// The full tile of 4 weight rows at Wt x activation rows [m0, m1), in K slices where the tile is wide (see tile):
// y[m][0..3] at y + m * N. pf: the next tile's bytes to prefetch into L2 (nullptr: none).
// Every row block prefetches the next tile (the same lines again after the first block: measured, with 8
// activation rows this lets memory keep streaming while the row blocks compute, where prefetching from the
// first block only left memory idle for most of the tile; T0 hint or more tiles ahead are slower).
inline void full_tile(const uint8_t* Wt, const uint8_t* pf, const int8_t* X, const int32_t* corr, const float* xs,
                      const Layout& L, const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t m0,
                      int64_t m1) {
  const int64_t ldc = L.U * 16;
  constexpr int NR = 4;
  // units per K slice: whole groups of 16 blocks (512 bytes per row); the tail units go with the last slice
  const int64_t slice_units = NR * L.Kp > kSliceBytes && m1 - m0 > 1 && m1 - m0 <= kMaxSlicedRows
                                  ? std::max<int64_t>(1, kSliceBytes / (NR * kGroup))
                                  : L.U;
  alignas(64) vf partial[kMaxSlicedRows * NR];
  for (int64_t u0 = 0; u0 < L.U; u0 += slice_units) {
    const int64_t u1 = u0 + slice_units >= L.G ? L.U : u0 + slice_units;
    for (int64_t m = m0; m < m1;) {
      const int mr = tile_rows(m1 - m);
      (tile_mr<NR>)(mr, Wt, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale, bias, y + m * N, N, pf, u0, u1,
                  slice_units < L.U ? partial + (m - m0) * NR : nullptr);
      m += mr;
    }
    if (u1 == L.U) break;
  }
}

// process weight rows [n0, n1) x activation rows [m0, m1); row_bytes: the bytes a weight row is stored in (Kp for
// q8's vnni layout, Kp / 64 * 40 for q5's), so that tile n starts at W + n * row_bytes
void linear_block(const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                  const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                  int64_t m0, int64_t m1, int64_t row_bytes) {
  constexpr int NR = 4;
  const int64_t ldw = L.Kp / 32;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    if (nr < NR) {  // the last N % 4 rows are plain rows
      for (int64_t i = n; i < n + nr; ++i)
        (plain_row)(W + i * row_bytes, X, corr, xs, L, wscale + i * ldw, bias ? bias + i : nullptr, y + i, N, m0,
                    m1);
      continue;
    }
    const uint8_t* pf = n + 2 * NR <= n1 ? W + (n + NR) * row_bytes : nullptr;
    (full_tile)(W + n * row_bytes, pf, X, corr, xs, L, wscale + n * ldw, bias ? bias + n : nullptr, y + n, N, m0, m1);
  }
}
