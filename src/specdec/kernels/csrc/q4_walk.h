// The walk of the q4 linear over tiles and blocks of activation rows, the same for every vector path: weight rows
// in tiles of 4 (the last N % 4 as single rows), each tile over blocks of up to kQ4TileRows activation rows.
// Included inside namespace avx512 and namespace avx2 after their q4_*.h, which define q4_unit<NR, MR, NB> (one unit
// of K into the accumulators) and kQ4TileRows, and after their linear_*.h (finish_tile: the tile's sums).
// Every output element is computed within one tile call, over the units in order, so neither the rows of its
// tile nor those of its row block change its bits.

// NR weight rows x MR activation rows over the whole of K: y[m][n] = hsum16(fa[n][m]) (+ bias[n]).
template <int NR, int MR>
__attribute__((always_inline)) inline void q4_tile(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                   const int8_t* X, const float* xs, const float* xsum,
                                                   const Layout& L, const float* bias, float* y, int64_t ldy,
                                                   const uint8_t* pf) {
  // the scales of the next tile (contiguous after this tile's) are a separate small stream: fetch them early
  for (int64_t o = 0; o < NR * scale_row_bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(scales + NR * scale_row_bytes + o), _MM_HINT_T0);
  const int64_t ldc = L.U * 16;
  vf fa[NR][MR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[n][m] = zero();
  for (int64_t u = 0; u < L.G; ++u) q4_unit<NR, MR, 16>(W, scales, scale_row_bytes, X, xs, xsum, L.Kp, ldc, u, pf, fa);
  if (L.T > 0) q4_unit<NR, MR, 8>(W, scales, scale_row_bytes, X, xs, xsum, L.Kp, ldc, L.G, pf, fa);
  finish_tile<NR, MR>(fa, bias, y, ldy);
}

// mr activation rows (1 .. kQ4TileRows) of a tile.
template <int NR>
inline void q4_tile_mr(int mr, const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes, const int8_t* X,
                       const float* xs, const float* xsum, const Layout& L, const float* bias, float* y, int64_t ldy,
                       const uint8_t* pf) {
  static_assert(kQ4TileRows >= 3 && kQ4TileRows <= 4, "the cases below");
  switch (mr) {
    case 1: q4_tile<NR, 1>(W, scales, scale_row_bytes, X, xs, xsum, L, bias, y, ldy, pf); break;
    case 2: q4_tile<NR, 2>(W, scales, scale_row_bytes, X, xs, xsum, L, bias, y, ldy, pf); break;
    case 3: q4_tile<NR, 3>(W, scales, scale_row_bytes, X, xs, xsum, L, bias, y, ldy, pf); break;
    default: q4_tile<NR, kQ4TileRows>(W, scales, scale_row_bytes, X, xs, xsum, L, bias, y, ldy, pf); break;
  }
}

// Weight rows [n0, n1) x activation rows [m0, m1); n0 is a multiple of 4 (chunks of whole tiles).
void q4_linear_block(const uint8_t* W, const uint8_t* scales, const int8_t* X, const float* xs, const float* xsum,
                     const Layout& L, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, int64_t m0,
                     int64_t m1) {
  const int64_t K = L.Kp;
  const int64_t ldc = L.U * 16;
  const int64_t row_bytes = K / 2;
  const int64_t scale_row_bytes = K / kQ4SuperBlock * kQ4ScaleBytes;
  constexpr int NR = kQ4Rows;
  constexpr int MR = kQ4TileRows;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    if (nr < NR) {  // the last N % 4 rows are plain rows
      for (int64_t m = m0; m < m1; m += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        for (int64_t i = n; i < n + nr; ++i)
          q4_tile_mr<1>(mr, W + i * row_bytes, scales + i * scale_row_bytes, scale_row_bytes, X + m * K,
                        xs + m * ldc, xsum + m * ldc, L, bias ? bias + i : nullptr, y + m * N + i, N, nullptr);
      }
      continue;
    }
    // every row block prefetches the next tile into L2 while it computes this one (as the int8 linear's walk)
    const uint8_t* pf = n + 2 * NR <= n1 ? W + (n + NR) * row_bytes : nullptr;
    for (int64_t m = m0; m < m1; m += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - m));
      q4_tile_mr<NR>(mr, W + n * row_bytes, scales + n * scale_row_bytes, scale_row_bytes, X + m * K, xs + m * ldc,
                     xsum + m * ldc, L, bias ? bias + n : nullptr, y + m * N + n, N, pf);
    }
  }
}
