// The 6-bit linear ("q6"): GGUF Q6_K's blocks, repacked losslessly for the kernels, and its scalar path, the
// executable specification that the avx2 and avx512 paths (q6_avx2.h, q6_avx512.h) reproduce lane by lane.
//
// Weights. Per output row, super-blocks of 256 inputs; each has an fp16 scale d and 16 sub-blocks of 16 inputs,
// sub-block l with a signed 8-bit scale sc_l, and 6-bit quants q in 0..63: weight = d * sc_l * (q - 32) (Q6_K's
// values). K (in_features) is a multiple of 256.
//
// Units. A row is walked in units of one super-block (unit u: inputs 256 u ..), each of 4 vectors of 64 bytes
// over 16 lanes; lane l is sub-block l. Byte 4 l + i of vector j (i < 4) is input 256 u + 16 l + 4 j + i.
//
// Quants ("quants", uint8 [N, 3 K / 4]). Unit u of a row is 3 chunks of 64 bytes (chunk 3 u + c). Byte 4 l + i of
// chunk c < 2 holds the low 4 bits of vector c's value [l, i] in its low nibble and those of vector c + 2's in its
// high nibble; byte 4 l + i of chunk 2 holds, in bits 2 p .. 2 p + 1, the high 2 bits of vector p's value [l, i].
// Rows are stored in tiles of 4 (memory order [N / 4 tiles][3 K / 256 chunks][4 rows][64 bytes]), so that a tile
// is one sequential stream; the last N % 4 rows are stored as plain rows.
//
// Scales ("scales", uint8 [N, 18 K / 256], natural row order). Row n, unit u at byte 18 u: its 16 sub-block
// scales sc (int8), then its fp16 d.
//
// Activations: int8 per block of 32 with an fp32 scale (quantize_unit, exactly as q8_linear), in the units'
// order above (lane l of a unit holds sub-block l; the two lanes of a block of 32 share its scale); per lane of
// every unit, the fp32 scale of its block (xs) and corr = -32 * the sum of its 16 int8 values (exact).
//
// Reduction order of y[m][n] (every path):
//   fa[16] = 0
//   for each unit u, in order:
//     idot[l] = corr[l] + sum over the lane's 16 values of q * x          (int32, exact: |idot| <= 16 * 32 * 127)
//     ws = float(d) * float(sc[l])                                       (exact: 11 x 8 significant bits)
//     s = ws * xscale[l]                                                 (rounded)
//     fa[l] = fma(float(idot[l]), s, fa[l])                              (float(idot) exact, rounded once)
//   y = hsum16(fa) (+ bias[n])
// It depends neither on the rows of the call, nor on the other rows, nor on the threads: every path computes
// each output element alone with these operations in this order.

constexpr int64_t kQ6SuperBlock = 256;   // inputs per super-block and unit (Q6_K's QK_K)
constexpr int64_t kQ6UnitBytes = 192;    // quant bytes per row and unit: 3 chunks of 64
constexpr int64_t kQ6ScaleBytes = 18;    // scale bytes per row and unit: 16 int8 sc, fp16 d
constexpr int64_t kQ6Rows = 4;           // weight rows per tile of the quants

// The 6-bit value of byte b (< 64) of vector j (< 4) of a unit whose 3 chunks are at chunk(0..2).
template <class Chunk>
inline int32_t q6_value(const Chunk& chunk, int j, int b) {
  const uint8_t low_byte = chunk(j % 2)[b];
  const int32_t low = j < 2 ? (low_byte & 0x0F) : (low_byte >> 4);
  const int32_t high = (chunk(2)[b] >> (2 * j)) & 0x03;
  return low | (high << 4);
}

// One weight row x one activation row. w: the row's first 64-byte chunk, chunk_stride: the bytes between its
// consecutive chunks (256 in a tile of 4, 64 for a plain row); x: the quantized activation row [K]; xs, corr: its
// lane scales and corrections [K / 16]; scales: the row's scale bytes.
void q6_dot_row_scalar(const uint8_t* w, int64_t chunk_stride, const int8_t* x, const float* xs,
                       const int32_t* corr, int64_t K, const uint8_t* scales, const float* bias, float* y) {
  float fa[16] = {0};
  for (int64_t u = 0; u < K / kQ6SuperBlock; ++u) {
    const auto chunk = [&](int c) { return w + (3 * u + c) * chunk_stride; };
    const int8_t* xu = x + u * kQ6SuperBlock;
    const uint8_t* unit_scales = scales + kQ6ScaleBytes * u;
    uint16_t d_bits;
    std::memcpy(&d_bits, unit_scales + 16, sizeof(d_bits));
    const float d = half_to_float(d_bits);
    for (int l = 0; l < 16; ++l) {
      int32_t idot = corr[u * 16 + l];
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i) idot += q6_value(chunk, j, l * 4 + i) * int32_t(xu[j * 64 + l * 4 + i]);
      const float ws = d * static_cast<float>(static_cast<int8_t>(unit_scales[l]));
      const float s = ws * xs[u * 16 + l];
      fa[l] = std::fma(static_cast<float>(idot), s, fa[l]);
    }
  }
  float v = hsum16_scalar(fa);
  if (bias) v = v + *bias;
  *y = v;
}

// Weight rows [n0, n1) x activation rows [m0, m1) of the q6 linear (y [M, N]).
void q6_linear_block_scalar(const uint8_t* W, const uint8_t* scales, const int8_t* X, const float* xs,
                            const int32_t* corr, int64_t K, const float* bias, float* y, int64_t N, int64_t n0,
                            int64_t n1, int64_t m0, int64_t m1) {
  const int64_t ldc = K / 16;
  const int64_t row_bytes = K / kQ6SuperBlock * kQ6UnitBytes;
  const int64_t scale_row_bytes = K / kQ6SuperBlock * kQ6ScaleBytes;
  const int64_t full_tile_rows = N / kQ6Rows * kQ6Rows;
  for (int64_t n = n0; n < n1; ++n) {
    const bool in_tile = n < full_tile_rows;
    const uint8_t* w = in_tile ? W + (n / kQ6Rows) * kQ6Rows * row_bytes + (n % kQ6Rows) * 64 : W + n * row_bytes;
    const int64_t chunk_stride = in_tile ? kQ6Rows * 64 : 64;
    for (int64_t m = m0; m < m1; ++m)
      q6_dot_row_scalar(w, chunk_stride, X + m * K, xs + m * ldc, corr + m * ldc, K, scales + n * scale_row_bytes,
                        bias ? bias + n : nullptr, y + m * N + n);
  }
}
