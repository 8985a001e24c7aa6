// The int8 linear on the "amx" weight layout (linear_amx.h: the layout and its reduction order), AVX2. Included
// inside namespace avx2, and again with SPECDEC_AVX_VNNI inside namespace avx2_vnni (see q8_kernels.cpp).
//
// A row tile's 16 output rows are two ymm lane halves: rows 0-7 are bytes 0-31 of each 64-byte quad, rows 8-15
// bytes 32-63. Each activation quad (4 bytes) is broadcast to the 8 lanes, so a lane accumulates the exact int32
// dot of one output row and one block, and the block's scale epilogue follows at once, lane by lane:
//   fa = fma(float(dot_b), x_scale * w_scale, fa)
// as amx_add_block does on the amx and avx512 paths: the same operations in the same order, the same bits, and
// neither horizontal sums nor a tail of K to finish (the vnni layout's walk ends every output with hsum16 and pays a
// unit's epilogue for each of K's tail units; this layout's epilogue is one per block, 3 operations per 8 dots).
// The dots: with AVX-VNNI, vpdpbusd of the weights flipped to w + 128 (xor 0x80) and the activation quad, the
// accumulator started at -128 * sum(x of the block); without it, vpmaddubsw of |w| and the quad carrying w's sign
// (|w| <= 127, |x| <= 127: a pair never saturates int16), then vpmaddwd with ones, from 0. Both are the signed dot.

constexpr int64_t kAmxAvx2Prefetch = 4096;  // bytes ahead in a weight stream, as linear_amx.h's kAmxPrefetch

// What a pass prefetches of its weights: the lines `ahead` bytes beyond each block it reads (0: none), into L1 (a
// decode stream, kAmxAvx2Prefetch ahead) or into L2 (the next tile, while a verify block's passes compute).
struct AmxAvx2Prefetch {
  int64_t ahead;
  bool to_l1;
};
constexpr int kAmxAvx2Rows = 4;             // activation rows per pass at most

// The 4 activation bytes at p in every lane (vbroadcastss: a load, no shuffle port).
inline __m256i amx_quad(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

#ifdef SPECDEC_AVX_VNNI
constexpr int kAmxAvx2Split = 2;  // int32 partial sums per block and lane group (vpdpbusd's latency, below)
#else
constexpr int kAmxAvx2Split = 1;  // the additions' latency is 1 cycle: one chain per lane group suffices
#endif

// MR activation rows x HR lane halves (from half h0) of S row tiles t[0 .. S), side by side (S weight streams in
// flight per thread), over every block: out[s][m][j] for half h0 + j of tile t[s] and row m. Each tile's
// operations are those of a tile alone: which tiles or halves go together never changes a bit.
// A block's int32 dots run in P = kAmxAvx2Split partial sums per lane group (quads p, p + P, ...), added at the
// block's end (int32: exact, the very dot): vpdpbusd's latency (5 cycles, 2 per cycle on Golden Cove) needs about
// 10 independent chains, and 4 rows x one lane half are 4 without the split.
template <int MR, int HR, int S>
__attribute__((always_inline)) inline void amx_avx2_pass(const int8_t* W, const uint16_t* tscale, const int8_t* xq,
                                                         const float* xs, const int32_t* xsum, int64_t Kp,
                                                         const int64_t* t, int h0, AmxAvx2Prefetch prefetch,
                                                         __m256 (&out)[S][MR][HR]) {
  constexpr int A = S * MR * HR;  // lane groups, index (s * MR + m) * HR + j (flat arrays: kept in registers)
  constexpr int P = kAmxAvx2Split;
  const int64_t NB = Kp / 32;
  const int8_t* wt[S];
  const uint16_t* st[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    wt[s] = W + t[s] * NB * kAmxTile + 32 * h0;
    st[s] = tscale + t[s] * NB * kAmxRows + 8 * h0;
  }
  __m256 fa[A];
#pragma GCC unroll 16
  for (int a = 0; a < A; ++a) fa[a] = _mm256_setzero_ps();
#ifdef SPECDEC_AVX_VNNI
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < NB; ++b) {
    if (prefetch.ahead) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const char* pf = reinterpret_cast<const char*>(wt[s] + b * kAmxTile) + prefetch.ahead;
#pragma GCC unroll 8
        for (int line = 0; line < 8; ++line) {
          // a stream's next 4 KB into L1; the next tile (up to 150 KB at K = 4864) into L2
          if (prefetch.to_l1) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
          else _mm_prefetch(pf + line * 64, _MM_HINT_T1);
        }
      }
    }
    __m256i acc[A * P];  // index a * P + p
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
#ifdef SPECDEC_AVX_VNNI
      const __m256i start = _mm256_set1_epi32(-128 * xsum[m * NB + b]);
#else
      const __m256i start = _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 2
        for (int j = 0; j < HR; ++j) {
          const int a = (s * MR + m) * HR + j;
          acc[a * P] = start;
#pragma GCC unroll 2
          for (int p = 1; p < P; ++p) acc[a * P + p] = _mm256_setzero_si256();
        }
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m256i xv[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) xv[m] = amx_quad(xq + m * Kp + b * 32 + q * 4);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 2
        for (int j = 0; j < HR; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt[s] + b * kAmxTile + q * 64 + 32 * j));
#ifdef SPECDEC_AVX_VNNI
          const __m256i w_unsigned = _mm256_xor_si256(w, flip);
#else
          const __m256i w_abs = _mm256_abs_epi8(w);
#endif
#pragma GCC unroll 4
          for (int m = 0; m < MR; ++m) {
            const int c = ((s * MR + m) * HR + j) * P + q % P;
#ifdef SPECDEC_AVX_VNNI
            acc[c] = _mm256_dpbusd_avx_epi32(acc[c], w_unsigned, xv[m]);
#else
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv[m], w)), ones);
            asm("" : "+x"(dot));  // an opaque summand: no reassociation of the additions into trees of products
            acc[c] = _mm256_add_epi32(acc[c], dot);
#endif
          }
        }
    }
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 2
      for (int j = 0; j < HR; ++j) {
        const __m256 w_scales =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st[s] + b * kAmxRows + 8 * j)));
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const int a = (s * MR + m) * HR + j;
          __m256i dots = acc[a * P];
#pragma GCC unroll 2
          for (int p = 1; p < P; ++p) dots = _mm256_add_epi32(dots, acc[a * P + p]);
          fa[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(_mm256_set1_ps(xs[m * NB + b]), w_scales),
                                  fa[a]);
        }
      }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
      for (int j = 0; j < HR; ++j) out[s][m][j] = fa[(s * MR + m) * HR + j];
}

// y[m][16 t + 8 h .. + 8) = fa[m] (+ bias), the rows beyond N left out.
template <int MR>
inline void amx_avx2_store_half(const __m256 (&fa)[MR], const float* bias, float* y, int64_t N, int64_t t, int h) {
  const int64_t n0 = t * kAmxRows + 8 * h;
  if (n0 >= N) return;
  if (n0 + 8 <= N) {
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + m * N + n0, bias ? _mm256_add_ps(fa[m], bv) : fa[m]);
    return;
  }
  alignas(32) float lanes[8];
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(lanes, fa[m]);
    for (int64_t i = 0; i < N - n0; ++i) y[m * N + n0 + i] = bias ? lanes[i] + bias[n0 + i] : lanes[i];
  }
}

// Row tiles t[0 .. S) for the MR activation rows at xq: 1 and 2 rows take both lane halves in one pass (their
// accumulators fit the 16 registers), 3 and 4 rows one half per pass, the second pass reading the tile from cache.
template <int MR, int S>
inline void amx_avx2_tiles(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                           const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, const int64_t* t,
                           AmxAvx2Prefetch prefetch) {
  constexpr int HR = MR <= 2 ? 2 : 1;
  for (int h0 = 0; h0 < 2; h0 += HR) {
    __m256 fa[S][MR][HR];
    amx_avx2_pass<MR, HR, S>(W, tscale, xq, xs, xsum, Kp, t, h0, prefetch, fa);
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < HR; ++j) {
        __m256 half[MR];
        for (int m = 0; m < MR; ++m) half[m] = fa[s][m][j];
        amx_avx2_store_half<MR>(half, bias, y, N, t[s], h0 + j);
      }
  }
}

// Weight streams walked side by side at one row (decode; more rows fill the registers with accumulators).
constexpr int kAmxAvx2Streams = 2;

// Row tiles t[0 .. S) for the mr activation rows from row m (mr <= kAmxAvx2Rows).
template <int S>
inline void amx_avx2_rows(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                          const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, const int64_t* t,
                          int64_t m, int mr, AmxAvx2Prefetch prefetch) {
  const int64_t NB = Kp / 32;
  const int8_t* xm = xq + m * Kp;
  const float* sm = xs + m * NB;
  const int32_t* um = xsum + m * NB;
  float* ym = y + m * N;
  static_assert(kAmxAvx2Rows == 4, "the cases below");
  switch (mr) {
    case 1: amx_avx2_tiles<1, S>(W, tscale, xm, sm, um, Kp, bias, ym, N, t, prefetch); break;
    case 2: amx_avx2_tiles<2, S>(W, tscale, xm, sm, um, Kp, bias, ym, N, t, prefetch); break;
    case 3: amx_avx2_tiles<3, S>(W, tscale, xm, sm, um, Kp, bias, ym, N, t, prefetch); break;
    default: amx_avx2_tiles<4, S>(W, tscale, xm, sm, um, Kp, bias, ym, N, t, prefetch); break;
  }
}

// Activation bytes whose row blocks all run over a tile while it is in cache (a verify block; a prefill's rows go
// in groups of this size, each group over the whole range of tiles).
constexpr int64_t kAmxAvx2GroupBytes = 96 * 1024;

// Row tiles [t0, t1) x activation rows [m0, m1). One row (decode) walks the range with kAmxAvx2Streams weight
// streams, each prefetched kAmxAvx2Prefetch bytes ahead. More rows walk it tile by tile, every block of rows over the
// tile before the next tile (the first block streams the tile from memory, the others find it in cache), in groups
// of rows of at most kAmxAvx2GroupBytes of activations; every pass prefetches the same blocks of the next tile, so
// that the memory stream stays busy while the tile's later passes compute.
void linear_amx_layout_avx2(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs,
                            const int32_t* xsum, int64_t Kp, const float* bias, float* y, int64_t N, int64_t t0,
                            int64_t t1, int64_t m0, int64_t m1) {
  if (m1 - m0 == 1) {
    constexpr int S = kAmxAvx2Streams;
    const AmxAvx2Prefetch stream{kAmxAvx2Prefetch, true};
    walk_row_tiles<S>(
        t0, t1,
        [&](const int64_t* t) { amx_avx2_rows<S>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t, m0, 1, stream); },
        [&](const int64_t* t) { amx_avx2_rows<1>(W, tscale, xq, xs, xsum, Kp, bias, y, N, t, m0, 1, stream); });
    return;
  }
  const AmxAvx2Prefetch next_tile{Kp / 32 * kAmxTile, false};
  const int64_t group = std::max<int64_t>(kAmxAvx2Rows, kAmxAvx2GroupBytes / Kp / kAmxAvx2Rows * kAmxAvx2Rows);
  for (int64_t g0 = m0; g0 < m1; g0 += group) {
    const int64_t g1 = std::min(m1, g0 + group);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = g0, mr = 0; m < g1; m += mr) {  // blocks of rows split evenly: 5 as 3 + 2, 8 as 4 + 4
        mr = even_block_rows(g1 - m, kAmxAvx2Rows);
        amx_avx2_rows<1>(W, tscale, xq, xs, xsum, Kp, bias, y, N, &t, m, static_cast<int>(mr), next_tile);
      }
  }
}
