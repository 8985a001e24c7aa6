// The walk of the block-quantized linears (q4, q6) over tiles and blocks of activation rows, the same for every
// vector path and format: weight rows in tiles of 4 (the last N % 4 as single rows), each tile over blocks of up to
// Units::kTileRows activation rows. Included inside namespace avx512 and namespace avx2 after their linear_*.h
// (finish_tile: the tile's sums) and their q4_*.h and q6_*.h (q4_unit, q6_unit: one unit of K into the
// accumulators; kQ4TileRows, kQ6TileRows: the path's activation rows per tile; kBlockBalancedTiles, in q6_*.h:
// whether a block's rows split evenly over its tiles). Each format's Units (Q4Units, Q6Units) tells the walk:
//   Sum                      the type of the activations' per-lane sums (q4: fp32 sums, q6: int32 corrections)
//   kTileRows                activation rows per tile (avx512: 4; avx2: 5, a verify block of 5 rows in one tile)
//   row_bytes(K), scale_row_bytes(K), lanes(K): a weight row's quant and scale bytes, an activation row's lanes
//   row<NR, MR>(...)         every unit of K of NR weight rows x MR activation rows into the accumulators
// Every output element is computed within one tile call, over the units in order, so neither the rows of its
// tile nor those of its row block change its bits.

// The q4 format for the walk.
struct Q4Units {
  using Sum = float;  // the lanes' fp32 activation sums
  static constexpr int kTileRows = kQ4TileRows;  // activation rows per tile
  static int64_t row_bytes(int64_t K) { return K / 2; }
  static int64_t scale_row_bytes(int64_t K) { return K / kQ4SuperBlock * kQ4ScaleBytes; }
  static int64_t lanes(int64_t K) { return (K / (2 * kQ4SuperBlock) + K / kQ4SuperBlock % 2) * 16; }
  // units of 16 sub-blocks, then one of 8 where K / 256 is odd
  template <int NR, int MR>
  __attribute__((always_inline)) static void row(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                 const int8_t* X, const float* xs, const float* xsum, int64_t K,
                                                 int64_t ldc, const uint8_t* pf, vf (&fa)[NR][MR]) {
    const int64_t groups = K / (2 * kQ4SuperBlock);
    for (int64_t u = 0; u < groups; ++u)
      q4_unit<NR, MR, 16>(W, scales, scale_row_bytes, X, xs, xsum, K, ldc, u, pf, fa);
    if (K / kQ4SuperBlock % 2) q4_unit<NR, MR, 8>(W, scales, scale_row_bytes, X, xs, xsum, K, ldc, groups, pf, fa);
  }
};

// The q6 format for the walk.
struct Q6Units {
  using Sum = int32_t;  // the lanes' corrections -32 * sum(x)
  static constexpr int kTileRows = kQ6TileRows;  // activation rows per tile
  static int64_t row_bytes(int64_t K) { return K / kQ6SuperBlock * kQ6UnitBytes; }
  static int64_t scale_row_bytes(int64_t K) { return K / kQ6SuperBlock * kQ6ScaleBytes; }
  static int64_t lanes(int64_t K) { return K / 16; }
  template <int NR, int MR>
  __attribute__((always_inline)) static void row(const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                                                 const int8_t* X, const float* xs, const int32_t* corr, int64_t K,
                                                 int64_t ldc, const uint8_t* pf, vf (&fa)[NR][MR]) {
    for (int64_t u = 0; u < K / kQ6SuperBlock; ++u)
      q6_unit<NR, MR>(W, scales, scale_row_bytes, X, xs, corr, K, ldc, u, pf, fa);
  }
};

// NR weight rows x MR activation rows over the whole of K: y[m][n] = hsum16(fa[n][m]) (+ bias[n]).
template <class Units, int NR, int MR>
__attribute__((always_inline)) inline void block_tile(const uint8_t* W, const uint8_t* scales,
                                                      int64_t scale_row_bytes, const int8_t* X, const float* xs,
                                                      const typename Units::Sum* sums, int64_t K, int64_t ldc,
                                                      const float* bias, float* y, int64_t ldy, const uint8_t* pf) {
  // the scales of the next tile (contiguous after this tile's) are a separate small stream: fetch them early
  for (int64_t o = 0; o < NR * scale_row_bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(scales + NR * scale_row_bytes + o), _MM_HINT_T0);
  vf fa[NR][MR];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[n][m] = zero();
  Units::template row<NR, MR>(W, scales, scale_row_bytes, X, xs, sums, K, ldc, pf, fa);
  finish_tile<NR, MR>(fa, bias, y, ldy);
}

// mr activation rows (1 .. Units::kTileRows) of a tile.
template <class Units, int NR>
inline void block_tile_mr(int mr, const uint8_t* W, const uint8_t* scales, int64_t scale_row_bytes,
                          const int8_t* X, const float* xs, const typename Units::Sum* sums, int64_t K, int64_t ldc,
                          const float* bias, float* y, int64_t ldy, const uint8_t* pf) {
  static_assert(Units::kTileRows >= 4 && Units::kTileRows <= 5, "the cases below");
  const auto rows = [&](auto rows_constant) {
    constexpr int R = decltype(rows_constant)::value;
    block_tile<Units, NR, R>(W, scales, scale_row_bytes, X, xs, sums, K, ldc, bias, y, ldy, pf);
  };
  switch (mr) {
    case 1: rows(std::integral_constant<int, 1>{}); break;
    case 2: rows(std::integral_constant<int, 2>{}); break;
    case 3: rows(std::integral_constant<int, 3>{}); break;
    case 4: rows(std::integral_constant<int, 4>{}); break;
    default: rows(std::integral_constant<int, Units::kTileRows>{}); break;
  }
}

// the rows of the next tile when `left` activation rows remain: Units::kTileRows at most; with kBlockBalancedTiles,
// the rows split as evenly as such tiles allow (avx2, tiles of 5: 6 as 3 + 3, 8 as 4 + 4, not 5 + 1 and 5 + 3)
template <class Units>
inline int block_tile_rows(int64_t left) {
  constexpr int MR = Units::kTileRows;
  if constexpr (kBlockBalancedTiles) return even_block_rows(left, MR);
  return static_cast<int>(std::min<int64_t>(MR, left));
}

// Weight rows [n0, n1) x activation rows [m0, m1); n0 is a multiple of 4 (chunks of whole tiles).
template <class Units>
void block_linear_block(const uint8_t* W, const uint8_t* scales, const int8_t* X, const float* xs,
                        const typename Units::Sum* sums, int64_t K, const float* bias, float* y, int64_t N,
                        int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const int64_t ldc = Units::lanes(K);
  const int64_t row_bytes = Units::row_bytes(K);
  const int64_t scale_row_bytes = Units::scale_row_bytes(K);
  constexpr int NR = 4;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    if (nr < NR) {  // the last N % 4 rows are plain rows
      for (int64_t m = m0, mr = 0; m < m1; m += mr) {
        mr = block_tile_rows<Units>(m1 - m);
        for (int64_t i = n; i < n + nr; ++i)
          block_tile_mr<Units, 1>(static_cast<int>(mr), W + i * row_bytes, scales + i * scale_row_bytes,
                                  scale_row_bytes, X + m * K, xs + m * ldc, sums + m * ldc, K, ldc,
                                  bias ? bias + i : nullptr, y + m * N + i, N, nullptr);
      }
      continue;
    }
    // every row block prefetches the next tile into L2 while it computes this one (as the int8 linear's walk)
    const uint8_t* pf = n + 2 * NR <= n1 ? W + (n + NR) * row_bytes : nullptr;
    for (int64_t m = m0, mr = 0; m < m1; m += mr) {
      mr = block_tile_rows<Units>(m1 - m);
      block_tile_mr<Units, NR>(static_cast<int>(mr), W + n * row_bytes, scales + n * scale_row_bytes,
                               scale_row_bytes, X + m * K, xs + m * ldc, sums + m * ldc, K, ldc,
                               bias ? bias + n : nullptr, y + m * N + n, N, pf);
    }
  }
}
