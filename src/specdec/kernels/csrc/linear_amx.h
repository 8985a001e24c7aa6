// The int8 linear on the "amx" weight layout: the weights of 16 output rows and one block of 32 inputs form one
// AMX tile.
//
// qweight int8 [Np, Kp] (Np = N rounded up to 16, zero rows beyond N), memory order
// [Np/16 row tiles][Kp/32 blocks][8 quads][16 rows][4 values]: the 512 bytes of (row tile t, block b) hold
// w[16 t + r][32 b + 4 q + i] at q * 64 + r * 4 + i, which is the B operand of one TDPBSSD with K = 32.
// tile_scale fp16 [Np/16, Kp/32, 16]: the block scales of the tile's 16 rows.
// Activations are quantized per row and block of 32 exactly as for the other layout (quantize_unit), in
// natural order: xq int8 [M, Kp], xs fp32 [M, Kp/32]. Every output is then
//   fa = +0; for b = 0, 1, ...: fa = fma(float(dot_b), xs[m][b] * ws[n][b], fa);   y = fa (+ bias[n])
// with dot_b the exact int32 dot product of block b (signed x signed: no offset to cancel). The order of the
// blocks is fixed, so y does not depend on M, on the other rows or on the threads. The amx path (one TDPBSSD
// per block and tile of up to 16 activation rows, the epilogue over the 16 output rows of a zmm), the avx512
// path (vpdpbusd, vnni_tile_rows) and the scalar path (linear_amx_layout_scalar) perform the same operations
// and give the same bits.
// Included inside namespace amx, under the AVX-512 and AMX targets (see q8_kernels.cpp).

constexpr int64_t kAmxPrefetch = 4096;  // bytes ahead in the weight stream (2 and 8 KB measured within noise)
constexpr int kAmxVnniRows = 4;         // row blocks of at most this many rows skip the tiles

struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Tiles: 0 .. 2 = C (mr x 16 int32); 3 and 7 = A (mr activation rows x 32 bytes); 4 .. 6 = B (weights, 8 x 64
// bytes). A call's first block of up to 16 rows uses C 0 .. 2, A 3 and B 4 .. 6 for up to kAmxStreams row tiles at
// once (amx_tile_rows); its later blocks, which find the chunk's weights in the cache, use C 0, 1, A 3, 7 and B 4, 5
// for two consecutive blocks of one row tile (amx_tile_block_pairs). The configuration is loaded only if the thread's
// current one differs (read back with sttilecfg, so that a configuration another library loaded on this thread in
// between is never mistaken for ours); the tiles stay configured after a call.
constexpr int kAmxStreams = 3;
inline void amx_configure(int mr) {
  AmxConfig cfg;
  for (int i = 0; i < kAmxStreams; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(mr);
    cfg.colsb[i] = 64;
    cfg.rows[4 + i] = 8;
    cfg.colsb[4 + i] = 64;
  }
  cfg.rows[3] = cfg.rows[7] = static_cast<uint8_t>(mr);
  cfg.colsb[3] = cfg.colsb[7] = 32;
  AmxConfig current;
  _tile_storeconfig(&current);
  if (std::memcmp(&current, &cfg, sizeof(cfg)) != 0) _tile_loadconfig(&cfg);
}

// The block scales of row tile t's 16 output rows for block b, as fp32.
inline __m512 amx_block_scales(const uint16_t* tscale, int64_t NB, int64_t t, int64_t b) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tscale + (t * NB + b) * kAmxRows)));
}

// One block's step of the layout's reduction for one activation row: fa = fma(float(dots), x_scale * w_scales, fa)
// (the product rounded first). Both SIMD paths use it, so their sums are the same operations in the same order.
inline __m512 amx_add_block(__m512 fa, __m512i dots, float x_scale, __m512 w_scales) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(_mm512_set1_ps(x_scale), w_scales), fa);
}

// y[m][16 t .. 16 t + 16) = fa[m] (+ bias), the rows beyond N left out.
template <int MR>
inline void amx_store_rows(const __m512 (&fa)[MR], const float* bias, float* y, int64_t N, int64_t t) {
  const int64_t n0 = t * kAmxRows;
  const int64_t valid = std::min<int64_t>(kAmxRows, N - n0);
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * N + n0, mask, bias ? _mm512_add_ps(fa[m], bv) : fa[m]);
}

// Zeroed accumulators fa[S][MR] and the weight bases of the S row tiles t[0 .. S) (amx layout).
template <int MR, int S>
__attribute__((always_inline)) inline void start_row_tiles(const int8_t* W, int64_t NB, const int64_t* t,
                                                           __m512 (&fa)[S][MR], const int8_t* (&wt)[S]) {
#pragma GCC unroll 16
  for (int s = 0; s < S; ++s) {
    wt[s] = W + t[s] * NB * kAmxTile;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[s][m] = _mm512_setzero_ps();
  }
}

// y[m][16 t .. 16 t + 16) for the MR activation rows at xq (row stride Kp), for S row tiles t[0 .. S) at once
// (S <= kAmxStreams): block by block, the block's activations loaded once, one TDPBSSD per row tile, so that S weight
// streams are in flight (see vnni_tile_rows). Each tile's operations are those of a tile alone, in the same order.
// (Earlier: one row tile, two consecutive blocks per step; four accumulator tiles in rotation over four blocks,
// with the A and B tiles reused, measured 1.5x slower than that.)
template <int MR, int S>
__attribute__((always_inline)) inline void amx_tile_rows(const int8_t* W, const uint16_t* tscale, const int8_t* xq,
                                                         const float* xs, int64_t Kp, const float* bias, float* y,
                                                         int64_t N, const int64_t* t) {
  static_assert(S >= 1 && S <= kAmxStreams, "one C and one B tile per stream");
  const int64_t NB = Kp / 32;
  alignas(64) int32_t cbuf[S][kAmxRows * 16];
  __m512 fa[S][MR];
  const int8_t* wt[S];
  start_row_tiles<MR, S>(W, NB, t, fa, wt);
  for (int64_t b = 0; b < NB; ++b) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {  // each weight stream, kAmxPrefetch bytes ahead (the hardware prefetcher alone: 15 % slower)
      const char* pf = reinterpret_cast<const char*>(wt[s] + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    }
    _tile_loadd(3, xq + b * 32, Kp);
    // tile numbers must be immediates: the streams are spelled out
    _tile_zero(0);
    _tile_loadd(4, wt[0] + b * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    if constexpr (S > 1) {
      _tile_zero(1);
      _tile_loadd(5, wt[1] + b * kAmxTile, 64);
      _tile_dpbssd(1, 3, 5);
    }
    if constexpr (S > 2) {
      _tile_zero(2);
      _tile_loadd(6, wt[2] + b * kAmxTile, 64);
      _tile_dpbssd(2, 3, 6);
    }
    _tile_stored(0, cbuf[0], 64);
    if constexpr (S > 1) _tile_stored(1, cbuf[1], 64);
    if constexpr (S > 2) _tile_stored(2, cbuf[2], 64);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m512 wsv = amx_block_scales(tscale, NB, t[s], b);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        fa[s][m] = amx_add_block(fa[s][m], _mm512_load_si512(cbuf[s] + m * 16), xs[m * NB + b], wsv);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) amx_store_rows<MR>(fa[s], bias, y, N, t[s]);
}

// y[m][16 t .. 16 t + 16) for the MR activation rows at xq, one row tile t, two consecutive blocks per step (C 0, 1;
// A 3, 7; B 4, 5): the same operations per tile as amx_tile_rows. For calls that walk their chunks once per block of
// 16 rows (a prefill), whose weights come from the cache: there, 3 row tiles per block measured 4-32 % slower.
template <int MR>
__attribute__((always_inline)) inline void amx_tile_block_pairs(const int8_t* W, const uint16_t* tscale,
                                                                const int8_t* xq, const float* xs, int64_t Kp,
                                                                const float* bias, float* y, int64_t N, int64_t t) {
  const int64_t NB = Kp / 32;
  alignas(64) int32_t cbuf[2][kAmxRows * 16];
  __m512 fa[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) fa[m] = _mm512_setzero_ps();
  const int8_t* wt = W + t * NB * kAmxTile;
  auto epilogue = [&](const int32_t* c, int64_t b) {
    const __m512 wsv = amx_block_scales(tscale, NB, t, b);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) fa[m] = amx_add_block(fa[m], _mm512_load_si512(c + m * 16), xs[m * NB + b], wsv);
  };
  int64_t b = 0;
  for (; b + 2 <= NB; b += 2) {
    {
      const char* pf = reinterpret_cast<const char*>(wt + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 16
      for (int line = 0; line < 16; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(3, xq + b * 32, Kp);
    _tile_loadd(4, wt + b * kAmxTile, 64);
    _tile_loadd(7, xq + (b + 1) * 32, Kp);
    _tile_loadd(5, wt + (b + 1) * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    _tile_dpbssd(1, 7, 5);
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    epilogue(cbuf[0], b);
    epilogue(cbuf[1], b + 1);
  }
  if (b < NB) {
    _tile_zero(0);
    _tile_loadd(3, xq + b * 32, Kp);
    _tile_loadd(4, wt + b * kAmxTile, 64);
    _tile_dpbssd(0, 3, 4);
    _tile_stored(0, cbuf[0], 64);
    epilogue(cbuf[0], b);
  }
  amx_store_rows<MR>(fa, bias, y, N, t);
}

// Row tiles [t0, t1) for MR activation rows on the tiles: the range cut into kAmxStreams consecutive runs walked side
// by side, the tiles left over one at a time.
// from_memory false (a later block of 16 rows of a call that walks each chunk once per block, so that the weights
// come from the cache): amx_tile_block_pairs, tile by tile.
template <int MR>
inline void amx_tile_range(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs, int64_t Kp,
                           const float* bias, float* y, int64_t N, int64_t t0, int64_t t1, bool from_memory) {
  if (!from_memory) {
    for (int64_t t = t0; t < t1; ++t) amx_tile_block_pairs<MR>(W, tscale, xq, xs, Kp, bias, y, N, t);
    return;
  }
  walk_row_tiles<kAmxStreams>(
      t0, t1, [&](const int64_t* t) { amx_tile_rows<MR, kAmxStreams>(W, tscale, xq, xs, Kp, bias, y, N, t); },
      [&](const int64_t* t) { amx_tile_rows<MR, 1>(W, tscale, xq, xs, Kp, bias, y, N, t); });
}

// The same outputs as amx_tile_rows with AVX-512 VNNI instead of tiles, for 1 to kAmxVnniRows activation rows
// (where the tile path's store and reload of every block's dots costs more than it saves). vpdpbusd multiplies unsigned
// by signed bytes: the weights are flipped to w + 128 (xor 0x80) and the accumulator starts at -128 * sum(x of
// the block), so each lane holds the exact int32 dot of its output row, as TDPBSSD gives it.
// S row tiles t[0 .. S) at once, block by block: S weight streams in flight per thread instead of one (a core here
// reads 9.7 GB/s from one prefetched stream, 12.3 from two, 13.4-13.9 from four; two cores 18.8, 27.3 and 33).
// Each tile's operations are those of a tile alone, in the same order: which tiles go together never changes a bit.
template <int MR, int S>
__attribute__((always_inline)) inline void vnni_tile_rows(const int8_t* W, const uint16_t* tscale, const int8_t* xq,
                                                          const float* xs, const int32_t* xsum, int64_t Kp,
                                                          const float* bias, float* y, int64_t N, const int64_t* t) {
  const int64_t NB = Kp / 32;
  __m512 fa[S][MR];
  const int8_t* wt[S];
  start_row_tiles<MR, S>(W, NB, t, fa, wt);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < NB; ++b) {
    __m512i acc[S][MR];
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const char* pf = reinterpret_cast<const char*>(wt[s] + b * kAmxTile) + kAmxPrefetch;
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[s][m] = _mm512_set1_epi32(-128 * xsum[m * NB + b]);
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m512i xv[MR];
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * Kp + b * 32 + q * 4, 4);
        xv[m] = _mm512_set1_epi32(quad);
      }
#pragma GCC unroll 16
      for (int s = 0; s < S; ++s) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(wt[s] + b * kAmxTile + q * 64), flip);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) acc[s][m] = _mm512_dpbusd_epi32(acc[s][m], w, xv[m]);
      }
    }
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const __m512 wsv = amx_block_scales(tscale, NB, t[s], b);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) fa[s][m] = amx_add_block(fa[s][m], acc[s][m], xs[m * NB + b], wsv);
    }
  }
#pragma GCC unroll 16
  for (int s = 0; s < S; ++s) amx_store_rows<MR>(fa[s], bias, y, N, t[s]);
}

// Row tiles [t0, t1) for MR activation rows on VNNI: the range cut into kVnniStreams consecutive runs walked side
// by side (vnni_tile_rows<MR, kVnniStreams>), the tiles left over one at a time.
constexpr int kVnniStreams = 4;
template <int MR>
inline void vnni_tile_range(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                            const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                            int64_t t1) {
  walk_row_tiles<kVnniStreams>(
      t0, t1, [&](const int64_t* t) { vnni_tile_rows<MR, kVnniStreams>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t); },
      [&](const int64_t* t) { vnni_tile_rows<MR, 1>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t); });
}

// Row tiles [t0, t1) x activation rows [m0, m1), in row blocks of up to 16. configured: the row count this call
// has configured the thread's tiles for (0: not yet), updated here; the tiles stay configured afterwards.
void linear_amx_layout_amx(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                           const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                           int64_t t1, int64_t m0, int64_t m1, int& configured) {
  const int64_t NB = Kp / 32;
  for (int64_t m = m0; m < m1; m += kAmxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kAmxRows, m1 - m));
    const bool from_memory = m == m0;  // the first row block streams the chunk's weights; later ones find them cached
    if (mr <= kAmxVnniRows) {
      switch (mr) {
#define SPECDEC_VNNI_CASE(R) \
  case R: vnni_tile_range<R>(W, tscale, xq + m * Kp, xs + m * NB, xsum + m * NB, Kp, bias, y + m * N, N, t0, t1); break;
        SPECDEC_VNNI_CASE(1) SPECDEC_VNNI_CASE(2) SPECDEC_VNNI_CASE(3)
        default: vnni_tile_range<4>(W, tscale, xq + m * Kp, xs + m * NB, xsum + m * NB, Kp, bias, y + m * N, N, t0, t1); break;
#undef SPECDEC_VNNI_CASE
      }
      continue;
    }
    if (mr != configured) {
      amx_configure(mr);
      configured = mr;
    }
    const int8_t* xm = xq + m * Kp;
    const float* sm = xs + m * NB;
    float* ym = y + m * N;
    static_assert(kAmxVnniRows == 4, "blocks of 1 to 4 rows take VNNI above: the tile cases start at 5");
    switch (mr) {
#define SPECDEC_AMX_CASE(R) \
  case R: amx_tile_range<R>(W, tscale, xm, sm, Kp, bias, ym, N, t0, t1, from_memory); break;
      SPECDEC_AMX_CASE(5) SPECDEC_AMX_CASE(6) SPECDEC_AMX_CASE(7) SPECDEC_AMX_CASE(8)
      SPECDEC_AMX_CASE(9) SPECDEC_AMX_CASE(10) SPECDEC_AMX_CASE(11) SPECDEC_AMX_CASE(12)
      SPECDEC_AMX_CASE(13) SPECDEC_AMX_CASE(14) SPECDEC_AMX_CASE(15)
      default: amx_tile_range<16>(W, tscale, xm, sm, Kp, bias, ym, N, t0, t1, from_memory); break;
#undef SPECDEC_AMX_CASE
    }
  }
}


// Row tiles [t0, t1) x activation rows [m0, m1) without the tiles (the avx512 path on a CPU without AMX, or with
// the path forced): vnni_tile_range for every block of up to kAmxVnniRows rows, the same outputs as the tiles.
void linear_amx_layout_vnni(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                            const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                            int64_t t1, int64_t m0, int64_t m1) {
  const int64_t NB = Kp / 32;
  for (int64_t m = m0; m < m1; m += kAmxVnniRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kAmxVnniRows, m1 - m));
    const int8_t* xm = xq + m * Kp;
    const float* sm = xs + m * NB;
    const int32_t* um = xsum + m * NB;
    float* ym = y + m * N;
    static_assert(kAmxVnniRows == 4, "the cases below");
    switch (mr) {
      case 1: vnni_tile_range<1>(W, tscale, xm, sm, um, Kp, bias, ym, N, t0, t1); break;
      case 2: vnni_tile_range<2>(W, tscale, xm, sm, um, Kp, bias, ym, N, t0, t1); break;
      case 3: vnni_tile_range<3>(W, tscale, xm, sm, um, Kp, bias, ym, N, t0, t1); break;
      default: vnni_tile_range<4>(W, tscale, xm, sm, um, Kp, bias, ym, N, t0, t1); break;
    }
  }
}
