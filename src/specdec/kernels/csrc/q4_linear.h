// The q4 linear's entry point (see q4_scalar.h for the weight layout and the reduction order): checks, activation
// quantization, threading and the dispatch to the kernel path. The amx path runs the avx512 code (the 4-bit
// weights have no AMX tile kernel); a CPU without AVX-512 runs the avx2 code (its AVX-VNNI variant where the CPU
// has AVX-VNNI) or the scalar code.

// Activation rows [m0, m1) quantized for q4: xq [M, K] in the vnni layout (as q8_linear's), and per row and unit
// lane (ldc = L.U * 16 per row) the fp32 scale of the lane's block (xs) and the fp32 sum of the lane's int8
// values (xsum, exact).
void quantize_rows_q4(QuantizeUnit quantize_unit, const float* x, int64_t K, const Layout& L, int64_t m0, int64_t m1,
                      int8_t* xq, float* xs, float* xsum) {
  const int64_t ldc = L.U * 16;
  alignas(64) int8_t q[16 * 32];
  float d[16];
  int32_t block_sums[16];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t u = 0; u < L.U; ++u) {
      const int nb = L.nb(u);
      const int s = 16 / nb;  // lanes per block
      const int64_t b0 = L.b0(u);
      quantize_unit(x + m * K, K, b0, nb, q, d, block_sums);
      int8_t* qu = xq + m * L.Kp + b0 * 32;
      if (s == 1)
        scatter_unit<1>(q, qu);
      else
        scatter_unit<2>(q, qu);
      for (int l = 0; l < 16; ++l) {
        xs[m * ldc + u * 16 + l] = d[l / s];
        if (s == 1) {  // the lane holds its whole block: its sum is the block's
          xsum[m * ldc + u * 16 + l] = static_cast<float>(block_sums[l]);
          continue;
        }
        int32_t lane_sum = 0;
        for (int j = 0; j < nb / 2; ++j)
          for (int i = 0; i < 4; ++i) lane_sum += qu[j * 64 + l * 4 + i];
        xsum[m * ldc + u * 16 + l] = static_cast<float>(lane_sum);
      }
    }
  }
}

// The calling thread's scratch for M quantized activation rows: int8 values [M, K], lane scales and lane sums
// [M, per_row] each.
struct Q4Activations {
  int8_t* q;
  float* scales;
  float* sums;
};
Q4Activations q4_activations_scratch(int64_t M, int64_t K, int64_t per_row) {
  thread_local Scratch scratch;
  const size_t q_bytes = align64(size_t(M * K));
  const size_t values_bytes = align64(size_t(M * per_row) * sizeof(float));
  uint8_t* base = scratch.get(q_bytes + 2 * values_bytes);
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + q_bytes),
          reinterpret_cast<float*>(base + q_bytes + values_bytes)};
}

torch::Tensor q4_linear(const torch::Tensor& x_in, const torch::Tensor& quants, const torch::Tensor& scales,
                        const c10::optional<torch::Tensor>& bias_in, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2, "q4_linear: x must be 2-D [M, K]");
  // K: the layer's inputs; Kp: the stored width, K padded to a multiple of 256 (the activations are quantized as
  // if zero beyond K, which is what zero columns give: the padding adds nothing)
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K == in_features, "q4_linear: x has ", K, " features, weight expects ", in_features);
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == at::kByte && quants.is_contiguous(),
              "q4_linear: quants must be contiguous uint8 [N, Kp/2]");
  const int64_t Kp = quants.size(1) * 2;
  TORCH_CHECK(K > 0 && Kp % kQ4SuperBlock == 0 && Kp >= K && Kp - K < kQ4SuperBlock,
              "q4_linear: quants [N, ", Kp / 2, "] do not hold ", K, " inputs padded to a multiple of ", kQ4SuperBlock);
  const int64_t N = quants.size(0);
  const int64_t scale_row_bytes = Kp / kQ4SuperBlock * kQ4ScaleBytes;
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.size(0) == N && scales.size(1) == scale_row_bytes,
              "q4_linear: scales must be contiguous uint8 [N, ", scale_row_bytes, "]");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q4_linear");
  auto y = torch::empty({M, N}, in.x.options());
  if (M == 0 || N == 0) return y;

  const Layout L(Kp);
  const int64_t ldc = L.U * 16;
  const Q4Activations act = q4_activations_scratch(M, Kp, ldc);
  const float* xp = in.x.data_ptr<float>();
  const Isa isa = active_isa();
  const bool avx2_vnni = avx2_vnni_variant(isa);
  const QuantizeUnit quantize_unit = pick_quantize_unit(isa);
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) {
    quantize_rows_q4(quantize_unit, xp, K, L, a, b, act.q, act.scales, act.sums);
  });

  const uint8_t* W = quants.data_ptr<uint8_t>();
  const uint8_t* S = scales.data_ptr<uint8_t>();
  const float* bp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = kQ4Rows * (Kp / 2 + scale_row_bytes);
  run_weight_tiles(N, M, Kp, tile_bytes, [&](int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
    if (at_least(isa, Isa::avx512))  // and amx, which has no tile kernel of this layout
      avx512::block_linear_block<avx512::Q4Units>(W, S, act.q, act.scales, act.sums, Kp, bp, yp, N, n0, n1, m0, m1);
    else if (avx2_vnni)
      avx2_vnni::block_linear_block<avx2_vnni::Q4Units>(W, S, act.q, act.scales, act.sums, Kp, bp, yp, N, n0, n1,
                                                        m0, m1);
    else if (isa == Isa::avx2)
      avx2::block_linear_block<avx2::Q4Units>(W, S, act.q, act.scales, act.sums, Kp, bp, yp, N, n0, n1, m0, m1);
    else
      q4_linear_block_scalar(W, S, act.q, act.scales, act.sums, L, bp, yp, N, n0, n1, m0, m1);
  });
  return y;
}
