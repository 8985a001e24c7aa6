// The q5 linear's unpacking (see q5_scalar.h for the layout), AVX-512: 64 weights into the 64 bytes of the vnni
// layout per step. Included inside namespace avx512 before q5_walk.h.

// The chunks chunks of a tile (or plain row) at src -> dst; prefetch (nullptr: none): the next tile's bytes, one
// line per chunk fetched into L2.
inline void q5_unpack(const uint8_t* src, uint8_t* dst, int64_t chunks, const uint8_t* prefetch) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), fifth_bit = _mm512_set1_epi8(0x10);
  const __m512i bias = _mm512_set1_epi8(112);
  // the 32 nibble bytes in both halves, the upper one shifted right by 4: bytes 32-63 take the high nibbles
  const __m512i nibble_shifts = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  // byte i = 8 k + j of a chunk takes bit k of fifth-bit byte j: 32-bit lane a (bytes 4a .. 4a + 3, k = a / 2)
  // rotated left by 4 - k (mod 32) brings it to bit 4 of its byte, and no other byte's bit there
  const __m512i rotations = _mm512_setr_epi32(4, 4, 3, 3, 2, 2, 1, 1, 0, 0, 31, 31, 30, 30, 29, 29);
  const uint8_t* fifth_bits = src + 32 * chunks;
  for (int64_t c = 0; c < chunks; ++c, src += 32, fifth_bits += 8, dst += 64) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * kQ5ChunkBytes), _MM_HINT_T1);
    const __m512i nibbles = _mm512_srlv_epi64(
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), nibble_shifts);
    int64_t bits;
    std::memcpy(&bits, fifth_bits, sizeof(bits));
    const __m512i fifth = _mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi64(bits), rotations), fifth_bit);
    // (nibbles & 0x0F) | fifth in one ternary-logic op (0xEA: (A & B) | C with A = nibbles, B = 0x0F, C = fifth)
    const __m512i values = _mm512_ternarylogic_epi32(nibbles, low_nibbles, fifth, 0xEA);
    _mm512_storeu_si512(dst, _mm512_add_epi8(values, bias));
  }
}
