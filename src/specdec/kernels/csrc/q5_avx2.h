// The q5 linear (see q5_scalar.h for the layout), AVX2: the int8 linear's walk (linear_walk.h, included again in
// namespace q5_units with q5's own unit) over q5's tiles, each 5-bit weight vector decoded in registers where it is
// used: q5_units::linear_block with q5's row bytes, in tiles of up to 8 activation rows. Included inside namespace
// avx2 (and avx2_vnni) after linear_walk.h.
//
// The integer dots take the unsigned 5-bit values v = q + 16 (0..31) as they are: vpmaddubsw(v, x) adds adjacent
// products into int16, |pair| <= 2 * 31 * 127 = 7874, and two chunks' pairs add up in int16 (15748) before one
// vpmaddwd with ones gives each lane's int32 (no sign trick: 2.5 instructions a chunk and activation row where q8's
// signed dot takes 4). With AVX-VNNI (namespace avx2_vnni) vpdpbusd adds them directly. Each lane's accumulator
// starts at the AVX-512 path's correction plus 112 times the sum of its activation bytes (quantize_rows'
// lane_sum_factor): sum(v x) + 112 sum(x) = sum((q + 128) x), so every lane holds the very int32 of the int8 linear
// on the same weights, before the same epilogue (start_lanes, add_scaled_lanes, finish_tile of linear_avx2.h).

namespace q5_units {

// v of the weight vector (chunk j, row n) of a tile (NR rows) at W, lanes 8h .. 8h + 7: the low nibbles of its 32
// nibble bytes (h = 0) or their high nibbles (h = 1), with the fifth bits of its 8 bit-plane bytes at bit 4 (byte
// i = 8 k + j of the chunk takes bit k of bit-plane byte j: a left shift by 4 - k in the first half, a right shift by
// k - 4 in the second, per 32-bit lane; no other byte's bit lands on bit 4).
__attribute__((always_inline)) inline __m256i q5_vector(const uint8_t* nibbles, const uint8_t* fifth_bits, int h) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), fifth_bit = _mm256_set1_epi8(0x10);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles));
  int64_t bits;
  std::memcpy(&bits, fifth_bits, sizeof(bits));
  const __m256i spread = _mm256_set1_epi64x(bits);
  if (h == 0)
    return _mm256_or_si256(_mm256_and_si256(packed, low_nibbles),
                           _mm256_and_si256(_mm256_sllv_epi32(spread, _mm256_setr_epi32(4, 4, 3, 3, 2, 2, 1, 1)),
                                            fifth_bit));
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles),
                         _mm256_and_si256(_mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                                          fifth_bit));
}

// One unit of NB blocks starting at block b0 (unit index u) of a q5 tile at W (NR rows: nibbles [Kp/64][NR][32],
// then fifth bits [Kp/64][NR][8]), both lane halves, into fa: the int8 linear's unit (linear_avx2.h) on the same
// lanes, int32 and epilogue.
template <int NR, int MR, int NB>
__attribute__((always_inline)) inline void unit(const uint8_t* W, const int8_t* X, const int32_t* corr,
                                                const float* xs, int64_t Kp, int64_t ldc, int64_t ldw, int64_t u,
                                                int64_t b0, const uint16_t* wscale, const uint8_t* pf,
                                                vf (&fa)[NR][MR]) {
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* nibbles = W + b0 * 16 * NR;  // chunk b0 / 2 + j of row n at (j * NR + n) * 32
  const uint8_t* fifth_bits = W + Kp / 2 * NR + b0 * 4 * NR;  // ... at (j * NR + n) * 8
  const int8_t* xp = X + b0 * 32;
  if (pf) {  // the next tile's part of this unit: its nibble lines, then its fifth-bit lines
    for (int64_t o = 0; o < NB * 16 * NR; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + b0 * 16 * NR + o), _MM_HINT_T1);
    for (int64_t o = 0; o < NB * 4 * NR; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + Kp / 2 * NR + b0 * 4 * NR + o), _MM_HINT_T1);
  }
  constexpr int NP = kPassRows<NR, MR>;  // weight rows per pass, as the int8 linear's
  unit_passes<NR, MR, NB>(corr, xs, ldc, ldw, u, b0, wscale, fa,
                          [&](int h, int n0, __m256i (&ia)[NP][MR]) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int j = 0; j < NB / 2; j += 2) {  // two chunks a step (one in a unit of 2 blocks)
      __m256i v[NP][2];
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q)
#pragma GCC unroll 2
        for (int s = 0; s < 2 && j + s < NB / 2; ++s)
          v[q][s] = q5_vector(nibbles + ((j + s) * NR + n0 + q) * 32, fifth_bits + ((j + s) * NR + n0 + q) * 8, h);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * Kp + j * 64 + 32 * h));
        const bool two = j + 1 < NB / 2;
        const __m256i x1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * Kp + (j + 1) * 64 + 32 * h))
                               : _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int q = 0; q < NP; ++q) {
#ifdef SPECDEC_AVX_VNNI
          ia[q][m] = _mm256_dpbusd_avx_epi32(ia[q][m], v[q][0], x0);
          if (two) ia[q][m] = _mm256_dpbusd_avx_epi32(ia[q][m], v[q][1], x1);
#else
          __m256i pairs = _mm256_maddubs_epi16(v[q][0], x0);
          if (two) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[q][1], x1));
          ia[q][m] = _mm256_add_epi32(ia[q][m], _mm256_madd_epi16(pairs, ones));
#endif
          asm("" : "+x"(ia[q][m]));  // the accumulator stays in its register (see linear_avx2.h)
        }
      }
    }
  });
}

// Activation rows per tile: 8, where the int8 linear's are 5. Each 5-bit weight vector is decoded in registers once
// per pass, so a tile of 8 rows (one weight row per pass, kPassRows) decodes the weights once for 5 to 8 rows, where
// two blocks of 4 would decode them twice. The int8, q4 and q6 units, whose weights cost little or nothing to decode,
// run faster in blocks of 4 or 5 rows (docs/kernels.md, "Tile rows on avx2"). Blocks of more than 8 rows take tiles
// of 8 first (kBalancedTiles false: 12 rows as 8 + 4).
constexpr int kTileRows = 8;
constexpr bool kBalancedTiles = false;

// the int8 linear's walk with this unit: linear_block (called with q5's row bytes), full_tile, plain_row, tile_mr and
// tile over q5 tiles
#include "linear_walk.h"

}  // namespace q5_units
