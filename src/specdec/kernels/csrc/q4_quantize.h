// The scale search of quantize_q4 (kernels/q4.py), per sub-block of 32 weights: llama.cpp's make_qkx2_quants
// (rmin -1, rdelta 0.1) with quantize_row_q4_K_ref's importance weights rms(x) + |x|. For each of the min/max grid
// and search_steps + 1 stretched grids, the quants of the grid and the weighted least-squares scale and min for
// them; the fit of least weighted squared error is kept (the first of equals; a stretched grid only where strictly
// better than the min/max grid's). Run once per weight at load; the same arithmetic as q4.py's torch version
// (_fit_sub_blocks_torch) summed in another order, so the two agree to rounding, not bit for bit.

constexpr int kQ4FitValues = 32;
constexpr float kQ4QuantMax = 15.0f;

// round half to even (torch.round, rint) of 0 <= v < 2^22, without a libm call: v + 1.5 * 2^23 has a unit ulp
inline float q4_round_nonnegative(float v) {
  const float magic = 12582912.0f;
  return (v + magic) - magic;
}

struct Q4FitSums {
  float sum_l, sum_l2, sum_xl;  // sum w l, sum w l^2, sum w x l over the sub-block
};

// The sums in 8 interleaved partial sums each (independent chains the compiler vectorizes), then added pairwise.
constexpr int kQ4FitLanes = 8;

inline float q4_sum_lanes(const float (&lanes)[kQ4FitLanes]) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

inline Q4FitSums q4_fit_sums(const float* shifted, const float* x, const float* importance, float inverse_scale) {
  float sum_l[kQ4FitLanes] = {0}, sum_l2[kQ4FitLanes] = {0}, sum_xl[kQ4FitLanes] = {0};
  for (int i0 = 0; i0 < kQ4FitValues; i0 += kQ4FitLanes)
    for (int j = 0; j < kQ4FitLanes; ++j) {
      const int i = i0 + j;
      const float level = std::min(q4_round_nonnegative(shifted[i] * inverse_scale), kQ4QuantMax);
      const float weighted_level = importance[i] * level;
      sum_l[j] += weighted_level;
      sum_l2[j] += weighted_level * level;
      sum_xl[j] += weighted_level * x[i];
    }
  return {q4_sum_lanes(sum_l), q4_sum_lanes(sum_l2), q4_sum_lanes(sum_xl)};
}

// x [32] -> (scale, offset >= 0) with x ~ scale * q - offset, q in 0..15 (see q4.py, _fit_sub_blocks).
inline void q4_fit_sub_block(const float* x, int64_t search_steps, float* scale_out, float* offset_out) {
  float sum_sq = 0.0f, low = x[0], high = x[0];
  for (int i = 0; i < kQ4FitValues; ++i) {
    sum_sq += x[i] * x[i];
    low = std::min(low, x[i]);
    high = std::max(high, x[i]);
  }
  low = std::min(low, 0.0f);
  const bool flat = high == low;
  const float span = flat ? 1.0f : high - low;
  float best_scale = span / kQ4QuantMax, best_min = low;
  if (search_steps <= 0) {
    *scale_out = flat ? 0.0f : best_scale;
    *offset_out = -low;
    return;
  }
  const float rms = std::sqrt(sum_sq / kQ4FitValues);
  float importance[kQ4FitValues], shifted[kQ4FitValues];
  float sum_w = 0.0f, sum_x = 0.0f, sum_xx = 0.0f;
  for (int i = 0; i < kQ4FitValues; ++i) {
    importance[i] = rms + std::fabs(x[i]);
    shifted[i] = x[i] - low;
    sum_w += importance[i];
    sum_x += importance[i] * x[i];
    sum_xx += importance[i] * x[i] * x[i];
  }
  auto weighted_error = [&](float scale, float minimum, const Q4FitSums& s) {
    return scale * scale * s.sum_l2 + 2 * scale * minimum * s.sum_l - 2 * scale * s.sum_xl +
           minimum * minimum * sum_w - 2 * minimum * sum_x + sum_xx;
  };
  float best_error = weighted_error(best_scale, best_min, q4_fit_sums(shifted, x, importance, kQ4QuantMax / span));
  for (int64_t step = 0; step <= search_steps; ++step) {
    const float grid = static_cast<float>(-1.0 + 0.1 * static_cast<double>(step) + kQ4QuantMax);
    const Q4FitSums s = q4_fit_sums(shifted, x, importance, grid / span);
    const float det = sum_w * s.sum_l2 - s.sum_l * s.sum_l;
    if (!(det > 0.0f)) continue;
    float scale = (sum_w * s.sum_xl - sum_x * s.sum_l) / det;
    float minimum = (s.sum_l2 * sum_x - s.sum_l * s.sum_xl) / det;
    if (minimum > 0.0f) {
      scale = s.sum_l2 > 0.0f ? s.sum_xl / s.sum_l2 : s.sum_xl;
      minimum = 0.0f;
    }
    const float error = weighted_error(scale, minimum, s);
    if (error < best_error) {
      best_error = error;
      best_scale = scale;
      best_min = minimum;
    }
  }
  *scale_out = flat ? 0.0f : best_scale;
  *offset_out = -(flat ? low : best_min);
}

// x [B, 32] fp32 -> [B, 2]: (scale, offset) per sub-block.
torch::Tensor q4_fit_sub_blocks(const torch::Tensor& x_in, int64_t search_steps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == kQ4FitValues, "q4_fit_sub_blocks: x must be [B, 32]");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
              "q4_fit_sub_blocks: x must be a CPU float32 tensor");
  const torch::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0);
  torch::Tensor fit = torch::empty({B, 2}, x.options());
  const float* xp = x.data_ptr<float>();
  float* out = fit.data_ptr<float>();
  at::parallel_for(0, B, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      q4_fit_sub_block(xp + b * kQ4FitValues, search_steps, out + 2 * b, out + 2 * b + 1);
  });
  return fit;
}
