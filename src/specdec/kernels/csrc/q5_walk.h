// The q5 linear's avx512 walk (see q5_scalar.h): each tile of 4 weight rows (or plain row) unpacked by q5_unpack
// (q5_avx512.h) into the vnni layout's bytes, then walked by the int8 linear's full_tile and plain_row
// (linear_walk.h) over every activation row block. Included inside namespace avx512 after linear_walk.h and
// q5_avx512.h (the amx path runs it too; avx2 decodes in registers instead, q5_avx2.h).

// Tiles ahead of the one unpacked that its unpacking prefetches into L2 (one line per chunk): measured against 4 and
// 8 on Zen 4, and against none, which made a call 1.2-2x slower.
constexpr int64_t kQ5PrefetchTiles = 2;

// Weight rows [n0, n1) x activation rows [m0, m1); n0 a multiple of 4. The full tiles are software-pipelined: tile
// t + 1 is unpacked into the other of two buffers before tile t is walked, so the walk never loads bytes still on
// their way from the unpacking stores, and the unpacking's loads run a tile ahead of the walk.
void q5_linear_block(const uint8_t* W5, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                     const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                     int64_t m0, int64_t m1) {
  constexpr int NR = 4;
  const int64_t chunks = L.Kp / 64, row_bytes = chunks * kQ5ChunkBytes, ldw = L.Kp / 32;
  thread_local Scratch scratch;
  uint8_t* buffers[2] = {scratch.get(2 * NR * L.Kp), nullptr};
  buffers[1] = buffers[0] + NR * L.Kp;
  const int64_t full_end = n0 + (n1 - n0) / NR * NR;  // the full tiles' rows, then the plain rows
  const auto unpack_tile = [&](int64_t n, uint8_t* tile) {
    const uint8_t* ahead = n + kQ5PrefetchTiles * NR < full_end ? W5 + (n + kQ5PrefetchTiles * NR) * row_bytes : nullptr;
    q5_unpack(W5 + n * row_bytes, tile, NR * chunks, ahead);
  };
  if (n0 < full_end) unpack_tile(n0, buffers[0]);
  for (int64_t n = n0, t = 0; n < full_end; n += NR, ++t) {
    if (n + NR < full_end) unpack_tile(n + NR, buffers[(t + 1) % 2]);
    full_tile(buffers[t % 2], nullptr, X, corr, xs, L, wscale + n * ldw, bias ? bias + n : nullptr, y + n, N, m0, m1);
  }
  for (int64_t i = full_end; i < n1; ++i) {  // the last N % 4 rows are plain rows
    q5_unpack(W5 + i * row_bytes, buffers[0], chunks, nullptr);
    plain_row(buffers[0], X, corr, xs, L, wscale + i * ldw, bias ? bias + i : nullptr, y + i, N, m0, m1);
  }
}
