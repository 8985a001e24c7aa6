// The 5-bit linear (q5: GGUF Q5_0's blocks, kept losslessly), its weight layout and its scalar path.
//
// A Q5_0 block holds 32 weights d * (v - 16) with v in 0..31 and one fp16 scale d: the int8 values q = v - 16 lie in
// -16..15 with the block's scale, exactly an int8 weight of the vnni layout (linear.h) with its fp16 block scales.
// q5 stores the vnni layout's bytes (u = q + 128, tiles of 4 rows, the last N % 4 rows plain) in 5 bits each:
// every 64-byte chunk u[0..63] of the vnni layout (v = u - 112, 0..31) becomes
//   32 bytes of low nibbles: byte i holds v[i] & 15 in its low and v[i + 32] & 15 in its high nibble, and
//   8 bytes of fifth bits: bit k of byte j is v[8 k + j] >> 4 (bit planes: shifts, not shuffles, spread them).
// A tile of 4 rows (Kp/64 chunks each) stores its nibbles [Kp/64 chunks][4 rows][32 B], then its fifth bits
// [Kp/64 chunks][4 rows][8 B], 160 * Kp/64 bytes; a plain row likewise with 1 row, 40 * Kp/64 bytes. Each part is read
// at whole 32- and 8-byte steps, none across a cache line. Decoding is u[i] = ((v[i] & 15) | fifth bit << 4) + 112.
// The scales are the int8 linear's, fp16 [N, Kp/32].
//
// The scalar path (below) and the avx512 one (q5_walk.h) unpack each tile into the vnni layout's bytes (in L1) and
// walk it with the int8 linear's own code; the avx2 path runs that walk with a unit that decodes in registers and
// reaches the same int32 per lane (q5_avx2.h). So every output element is bitwise the int8 linear's on the same
// weights, on every path, whatever the rows of the call or the threads; the bytes streamed per weight are 5.5 bits
// instead of 8.5.
// The amx path runs the avx512 code (q5 has no AMX tile layout).

constexpr int64_t kQ5ChunkBytes = 40;  // bytes per 64 weights: 32 of nibbles, 8 of fifth bits

// The chunks chunks of a tile (or plain row) at src (its nibbles, then chunks * 8 bytes of fifth bits) -> chunks
// 64-byte chunks of the vnni layout at dst.
inline void q5_unpack_scalar(const uint8_t* src, uint8_t* dst, int64_t chunks) {
  const uint8_t* fifth_bits = src + 32 * chunks;
  for (int64_t c = 0; c < chunks; ++c, src += 32, fifth_bits += 8, dst += 64)
    for (int i = 0; i < 64; ++i) {
      const uint8_t low = i < 32 ? (src[i] & 0x0F) : (src[i - 32] >> 4);
      const uint8_t fifth = (fifth_bits[i % 8] >> (i / 8)) & 1;
      dst[i] = static_cast<uint8_t>((low | fifth << 4) + 112);
    }
}

// Weight rows [n0, n1) x activation rows [m0, m1), n0 a multiple of 4: each tile (or plain row) unpacked, then the
// int8 linear's scalar dot over it.
void q5_linear_block_scalar(const uint8_t* W5, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                            const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                            int64_t m0, int64_t m1) {
  const int64_t ldc = L.U * 16, chunks = L.Kp / 64, row_bytes = chunks * kQ5ChunkBytes;
  const int64_t nfull = N / 4 * 4;
  thread_local Scratch scratch;
  uint8_t* tile = scratch.get(4 * L.Kp);
  for (int64_t n = n0; n < n1; n += 4) {
    const bool full = n < nfull;
    const int64_t rows = full ? 4 : std::min<int64_t>(n1, N) - n;
    if (full) q5_unpack_scalar(W5 + n * row_bytes, tile, 4 * chunks);
    for (int64_t r = 0; r < rows; ++r) {
      if (!full) q5_unpack_scalar(W5 + (n + r) * row_bytes, tile, chunks);
      for (int64_t m = m0; m < m1; ++m)
        dot_row_scalar(full ? tile + r * 64 : tile, full ? 256 : 64, X + m * L.Kp, corr + m * ldc, xs + m * ldc, L,
                       wscale + (n + r) * (L.Kp / 32), bias ? bias + n + r : nullptr, y + m * N + n + r);
    }
  }
}
