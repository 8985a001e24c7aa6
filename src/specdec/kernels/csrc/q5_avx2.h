// The q5 linear's unpacking (see q5_scalar.h for the layout), AVX2: 64 weights into the 64 bytes of the vnni layout
// per step, as two 32-byte halves. Included inside namespace avx2 (and avx2_vnni) before q5_walk.h.

// The chunks chunks of a tile (or plain row) at src -> dst; prefetch (nullptr: none): the next tile's bytes, one
// line per chunk fetched into L2.
inline void q5_unpack(const uint8_t* src, uint8_t* dst, int64_t chunks, const uint8_t* prefetch) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), fifth_bit = _mm256_set1_epi8(0x10);
  const __m256i bias = _mm256_set1_epi8(112);
  // byte i = 8 k + j of a chunk takes bit k of fifth-bit byte j: in the first half (k = a / 2 for the 32-bit lane a
  // of bytes 4a .. 4a + 3) a left shift by 4 - k brings it to bit 4 of its byte, in the second (k = 4 + a / 2) a
  // right shift by k - 4; no other byte's bit lands there
  const __m256i first_shifts = _mm256_setr_epi32(4, 4, 3, 3, 2, 2, 1, 1);
  const __m256i second_shifts = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const uint8_t* fifth_bits = src + 32 * chunks;
  for (int64_t c = 0; c < chunks; ++c, src += 32, fifth_bits += 8, dst += 64) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * kQ5ChunkBytes), _MM_HINT_T1);
    const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    int64_t bits;
    std::memcpy(&bits, fifth_bits, sizeof(bits));
    const __m256i spread = _mm256_set1_epi64x(bits);
    const __m256i first = _mm256_or_si256(_mm256_and_si256(nibbles, low_nibbles),
                                          _mm256_and_si256(_mm256_sllv_epi32(spread, first_shifts), fifth_bit));
    const __m256i second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low_nibbles),
                                           _mm256_and_si256(_mm256_srlv_epi32(spread, second_shifts), fifth_bit));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_add_epi8(first, bias));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_add_epi8(second, bias));
  }
}
