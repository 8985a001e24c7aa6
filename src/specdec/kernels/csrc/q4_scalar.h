// The 4-bit linear ("q4"): GGUF Q4_K's block structure, repacked for the kernels, and its scalar path, the
// executable specification that the avx2 and avx512 paths (q4_avx2.h, q4_avx512.h) reproduce lane by lane.
//
// Weights. Per output row, super-blocks of 256 inputs; each has an fp16 scale d, an fp16 min scale dmin and 8
// sub-blocks of 32 inputs, sub-block b with a 6-bit scale sc_b and a 6-bit min m_b (stored one per byte), and
// 4-bit quants q in 0..15: weight = (d * sc_b) * q - dmin * m_b. K (in_features) is a multiple of 256.
//
// Units. A row is walked in units of the q8 "vnni" layout (common.h: Layout(K)): K / 512 units of 16 sub-blocks
// (two super-blocks), then, where K / 256 is odd, one unit of 8 sub-blocks. Unit u starts at sub-block
// b0 = 16 u. Its 16 lanes cover its sub-blocks, s = 16 / nb lanes each (lane l: sub-block b0 + l / s).
//
// Quants ("quants", uint8 [N, K / 2]). Unit u is nb / 4 chunks of 64 bytes (chunk c0 + j, c0 = b0 / 4). Byte
// l * 4 + i of chunk j holds, in its low nibble, value (j * 4 s + (l % s) * 4 + i) of sub-block b0 + l / s and, in
// its high nibble, value ((j + nb / 4) * 4 s + (l % s) * 4 + i) of the same sub-block. So the low nibbles of chunk
// j are activation vector j of the unit in the q8 vnni layout, the high nibbles activation vector j + nb / 4:
// one vpdpbusd each gives, per lane, the exact int32 dot of 4 quants with 4 activations.
// Rows are stored in tiles of 4 (memory order [N / 4 tiles][K / 128 chunks][4 rows][64 bytes]), so that a tile
// is one sequential stream; the last N % 4 rows are stored as plain rows.
//
// Scales ("scales", uint8 [N, 20 K / 256], natural row order). Row n, unit u at byte 40 u: its nb sub-block
// scales sc (one byte each), its nb mins m, then its nb / 8 fp16 d, then its nb / 8 fp16 dmin.
//
// Activations: int8 per block of 32 with an fp32 scale (quantize_unit, exactly as q8_linear), in the q8 vnni
// layout; per lane of every unit, the fp32 scale of its block and the fp32 sum of its int8 values (exact; see
// quantize_rows_q4 in q4_linear.h).
//
// Reduction order of y[m][n] (every path):
//   fa[16] = 0
//   for each unit u, in order:
//     idot[l] = sum over the lane's 4 * nb / 2 values of q * x                      (int32, exact)
//     for each lane l (sub-block b, super-block sb = b / 8):
//       ws = float(d[sb]) * float(sc[b]);  wm = float(dmin[sb]) * float(m[b])        (both exact)
//       t = wm * xsum[l]                                                            (rounded)
//       inner = fma(ws, float(idot[l]), -t)                                         (rounded once)
//       fa[l] = fma(xscale[l], inner, fa[l])                                        (rounded once)
//   y = hsum16(fa) (+ bias[n])
// It depends neither on the rows of the call, nor on the other rows, nor on the threads: every path computes
// each output element alone with these operations in this order.

constexpr int64_t kQ4SuperBlock = 256;      // inputs per super-block (Q4_K's QK_K)
constexpr int64_t kQ4ScaleBytes = 20;       // scale bytes per row and super-block: 8 sc, 8 m, fp16 d, fp16 dmin
constexpr int64_t kQ4UnitScaleBytes = 40;   // scale bytes per row and unit of 16 sub-blocks
constexpr int64_t kQ4Rows = 4;              // weight rows per tile of the quants

// The scales of one unit of nb sub-blocks of one row (base: the row's scales + 40 u).
struct Q4UnitScales {
  const uint8_t* base;
  int nb;
  uint8_t scale(int block) const { return base[block]; }
  uint8_t min(int block) const { return base[nb + block]; }
  uint16_t d(int super_block) const { return half_at(2 * nb + 2 * super_block); }
  uint16_t dmin(int super_block) const { return half_at(2 * nb + 2 * (nb / 8) + 2 * super_block); }
  uint16_t half_at(int offset) const {
    uint16_t h;
    std::memcpy(&h, base + offset, sizeof(h));
    return h;
  }
};

// The epilogue of one lane of a unit (see the reduction order above).
inline float q4_lane_epilogue(float ws, float wm, int32_t idot, float xscale, float xsum, float acc) {
  const float t = wm * xsum;
  const float inner = std::fma(ws, static_cast<float>(idot), -t);
  return std::fma(xscale, inner, acc);
}

// One weight row x one activation row. w: the row's first 64-byte chunk, chunk_stride: the bytes between its
// consecutive chunks (256 in a tile of 4, 64 for a plain row); x: the quantized activation row [K]; xs, xsum:
// its lane scales and sums [L.U * 16]; scales: the row's scale bytes.
void q4_dot_row_scalar(const uint8_t* w, int64_t chunk_stride, const int8_t* x, const float* xs, const float* xsum,
                       const Layout& L, const uint8_t* scales, const float* bias, float* y) {
  float fa[16] = {0};
  for (int64_t u = 0; u < L.U; ++u) {
    const int nb = L.nb(u);
    const int s = 16 / nb;
    const int chunks = nb / 4;
    const int64_t b0 = L.b0(u);
    const Q4UnitScales unit_scales{scales + kQ4UnitScaleBytes * u, nb};
    int32_t idot[16] = {0};
    for (int j = 0; j < chunks; ++j) {
      const uint8_t* chunk = w + (b0 / 4 + j) * chunk_stride;
      const int8_t* x_low = x + b0 * 32 + j * 64;              // activation vector j of the unit
      const int8_t* x_high = x + b0 * 32 + (j + chunks) * 64;  // activation vector j + nb / 4
      for (int l = 0; l < 16; ++l)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = chunk[l * 4 + i];
          idot[l] += int32_t(byte & 0x0F) * int32_t(x_low[l * 4 + i]) + int32_t(byte >> 4) * int32_t(x_high[l * 4 + i]);
        }
    }
    for (int l = 0; l < 16; ++l) {
      const int block = l / s;
      const int super_block = block / 8;
      const float ws = half_to_float(unit_scales.d(super_block)) * static_cast<float>(unit_scales.scale(block));
      const float wm = half_to_float(unit_scales.dmin(super_block)) * static_cast<float>(unit_scales.min(block));
      fa[l] = q4_lane_epilogue(ws, wm, idot[l], xs[u * 16 + l], xsum[u * 16 + l], fa[l]);
    }
  }
  float v = hsum16_scalar(fa);
  if (bias) v = v + *bias;
  *y = v;
}

// Weight rows [n0, n1) x activation rows [m0, m1) of the q4 linear (y [M, N]).
void q4_linear_block_scalar(const uint8_t* W, const uint8_t* scales, const int8_t* X, const float* xs,
                            const float* xsum, const Layout& L, const float* bias, float* y, int64_t N, int64_t n0,
                            int64_t n1, int64_t m0, int64_t m1) {
  const int64_t K = L.Kp;
  const int64_t ldc = L.U * 16;
  const int64_t row_bytes = K / 2;
  const int64_t scale_row_bytes = K / kQ4SuperBlock * kQ4ScaleBytes;
  const int64_t full_tile_rows = N / kQ4Rows * kQ4Rows;
  for (int64_t n = n0; n < n1; ++n) {
    const bool in_tile = n < full_tile_rows;
    const uint8_t* w = in_tile ? W + (n / kQ4Rows) * kQ4Rows * row_bytes + (n % kQ4Rows) * 64 : W + n * row_bytes;
    const int64_t chunk_stride = in_tile ? kQ4Rows * 64 : 64;
    for (int64_t m = m0; m < m1; ++m)
      q4_dot_row_scalar(w, chunk_stride, X + m * K, xs + m * ldc, xsum + m * ldc, L, scales + n * scale_row_bytes,
                        bias ? bias + n : nullptr, y + m * N + n);
  }
}
