// The q5 linear's entry point (see q5_scalar.h for the layout): checks, then the int8 linear's activation
// quantization, threading and tiles (vnni_layout_linear), on the path the call runs: avx512 and scalar unpack each
// tile (q5_walk.h, q5_scalar.h), avx2 decodes in registers (q5_avx2.h).

torch::Tensor q5_linear(const torch::Tensor& x_in, const torch::Tensor& quants, const torch::Tensor& wscale,
                        const c10::optional<torch::Tensor>& bias_in, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2, "q5_linear: x must be 2-D [M, K]");
  const int64_t K = x_in.size(1), N = quants.size(0);
  TORCH_CHECK(K == in_features, "q5_linear: x has ", K, " features, weight expects ", in_features);
  const int64_t Kp = (K + kChunk - 1) / kChunk * kChunk;
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == at::kByte && quants.is_contiguous() &&
                  quants.size(1) == Kp / 64 * kQ5ChunkBytes,
              "q5_linear: quants must be contiguous uint8 [N, ", Kp / 64 * kQ5ChunkBytes, "] for ", K, " inputs");
  check_block_scales(wscale, N, Kp, "q5_linear");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q5_linear");
  const uint8_t* W5 = quants.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  const float* bp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
  const int64_t row_bytes = Kp / 64 * kQ5ChunkBytes;
  const int64_t tile_bytes = 4 * (row_bytes + Kp / 32 * 2);
  // the avx2 paths multiply the 5-bit values v = q + 16 themselves (q5_avx2.h), the others q8's bytes q + 128
  const auto lane_sum_factor = [](Isa isa, bool) { return isa == Isa::avx2 ? 112 : 0; };
  return vnni_layout_linear(in, N, Kp, tile_bytes, lane_sum_factor, [&](Isa isa, bool avx2_vnni, const int8_t* xq,
                                                                         const int32_t* corr, const float* xs,
                                                                         const Layout& L, float* yp, int64_t n0,
                                                                         int64_t n1, int64_t m0, int64_t m1) {
    if (at_least(isa, Isa::avx512))  // and amx: q5 has no AMX tile layout
      avx512::q5_linear_block(W5, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1);
    else if (avx2_vnni)
      avx2_vnni::q5_units::linear_block(W5, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1, row_bytes);
    else if (isa == Isa::avx2)
      avx2::q5_units::linear_block(W5, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1, row_bytes);
    else
      q5_linear_block_scalar(W5, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1);
  });
}
