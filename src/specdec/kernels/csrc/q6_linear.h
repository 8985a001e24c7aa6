// The q6 linear's entry point (see q6_scalar.h for the weight layout and the reduction order): checks, activation
// quantization, threading and the dispatch to the kernel path. The amx path runs the avx512 code (the 6-bit
// weights have no AMX tile kernel); a CPU without AVX-512 runs the avx2 code (its AVX-VNNI variant where the CPU
// has AVX-VNNI) or the scalar code.

// Activation rows [m0, m1) quantized for q6: xq [M, K] in the units' order (q6_scalar.h), and per row and lane
// (K / 16 per row) the fp32 scale of the lane's block (xs) and -32 times the sum of its 16 int8 values (corr).
void quantize_rows_q6(QuantizeUnit quantize_unit, const float* x, int64_t K, int64_t m0, int64_t m1, int8_t* xq,
                      float* xs, int32_t* corr) {
  const int64_t ldc = K / 16;
  alignas(64) int8_t q[16 * 32];
  float d[16];
  int32_t block_sums[16];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t u = 0; u < K / kQ6SuperBlock; ++u) {
      quantize_unit(x + m * K, K, 8 * u, 8, q, d, block_sums);  // the unit's 8 blocks of 32, natural order
      int8_t* qu = xq + m * K + u * kQ6SuperBlock;
      for (int l = 0; l < 16; ++l) {
        int32_t lane_sum = 0;
        for (int j = 0; j < 4; ++j) {
          std::memcpy(qu + j * 64 + l * 4, q + 16 * l + 4 * j, 4);
          for (int i = 0; i < 4; ++i) lane_sum += q[16 * l + 4 * j + i];
        }
        xs[m * ldc + u * 16 + l] = d[l / 2];
        corr[m * ldc + u * 16 + l] = -32 * lane_sum;
      }
    }
}

torch::Tensor q6_linear(const torch::Tensor& x_in, const torch::Tensor& quants, const torch::Tensor& scales,
                        const c10::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "q6_linear: x must be 2-D [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K > 0 && K % kQ6SuperBlock == 0, "q6_linear: ", K, " inputs are no multiple of ", kQ6SuperBlock);
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == at::kByte && quants.is_contiguous() &&
                  quants.size(1) == K / kQ6SuperBlock * kQ6UnitBytes,
              "q6_linear: quants must be contiguous uint8 [N, ", K / kQ6SuperBlock * kQ6UnitBytes, "] for ", K,
              " inputs");
  const int64_t N = quants.size(0);
  const int64_t scale_row_bytes = K / kQ6SuperBlock * kQ6ScaleBytes;
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.size(0) == N && scales.size(1) == scale_row_bytes,
              "q6_linear: scales must be contiguous uint8 [N, ", scale_row_bytes, "]");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q6_linear");
  auto y = torch::empty({M, N}, in.x.options());
  if (M == 0 || N == 0) return y;

  // the activations: int8 values [M, K], lane scales and corrections [M, K / 16] (the scratch of q4_linear's
  // layout: a lane's int32 correction takes the place of its fp32 sum)
  const Q4Activations act = q4_activations_scratch(M, K, K / 16);
  int32_t* corr = reinterpret_cast<int32_t*>(act.sums);
  const float* xp = in.x.data_ptr<float>();
  const Isa isa = active_isa();
  const bool avx2_vnni = avx2_vnni_variant(isa);
  const QuantizeUnit quantize_unit = pick_quantize_unit(isa);
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) { quantize_rows_q6(quantize_unit, xp, K, a, b, act.q, act.scales, corr); });

  const uint8_t* W = quants.data_ptr<uint8_t>();
  const uint8_t* S = scales.data_ptr<uint8_t>();
  const float* bp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = kQ6Rows * (K / kQ6SuperBlock * kQ6UnitBytes + scale_row_bytes);
  run_weight_tiles(N, M, K, tile_bytes, [&](int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
    if (at_least(isa, Isa::avx512))  // and amx, which has no tile kernel of this layout
      avx512::block_linear_block<avx512::Q6Units>(W, S, act.q, act.scales, corr, K, bp, yp, N, n0, n1, m0, m1);
    else if (avx2_vnni)
      avx2_vnni::block_linear_block<avx2_vnni::Q6Units>(W, S, act.q, act.scales, corr, K, bp, yp, N, n0, n1, m0, m1);
    else if (isa == Isa::avx2)
      avx2::block_linear_block<avx2::Q6Units>(W, S, act.q, act.scales, corr, K, bp, yp, N, n0, n1, m0, m1);
    else
      q6_linear_block_scalar(W, S, act.q, act.scales, corr, K, bp, yp, N, n0, n1, m0, m1);
  });
  return y;
}
