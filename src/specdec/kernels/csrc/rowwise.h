// The row-wise entry points: RMS norm, QK-norm + RoPE, the gated activation, the row argmax, the embedding
// gather and the KV-cache write. Each row (token, or token x head) is computed on its own with a fixed operation
// order, so they are row invariant like the rest.

// One row on the kernel path isa (each path gives the same bits).
inline void rms_norm_row(Isa isa, const float* x, const float* w, int64_t D, float eps, float* out) {
  if (at_least(isa, Isa::avx512))
    avx512::rms_norm_row(x, w, D, eps, out);
  else if (isa == Isa::avx2)
    avx2::rms_norm_row(x, w, D, eps, out);
  else
    rms_norm_row_scalar(x, w, D, eps, out);
}

// The vector paths need D / 2 to be a multiple of 16; other widths take the scalar one (the same bits).
inline void rope_row(Isa isa, const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  if (at_least(isa, Isa::avx512) && D % 32 == 0)
    avx512::rope_row(x, cos, sin, D, out);
  else if (isa == Isa::avx2 && D % 32 == 0)
    avx2::rope_row(x, cos, sin, D, out);
  else
    rope_row_scalar(x, cos, sin, D, out);
}

inline void gated_row(Isa isa, const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  if (at_least(isa, Isa::avx512)) {
    avx512::gated_row(gate, up, n, gelu, out);
  } else if (isa == Isa::avx2) {
    avx2::gated_row(gate, up, n, gelu, out);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = gated_scalar(gate[j], up[j], gelu);
  }
}

inline ArgmaxPart argmax_range(Isa isa, const float* x, int64_t n, int64_t offset) {
  if (at_least(isa, Isa::avx512)) return avx512::argmax_range(x, n, offset);
  if (isa == Isa::avx2) return avx2::argmax_range(x, n, offset);
  return argmax_range_scalar(x, n, offset);
}

inline void floats_to_halves(Isa isa, const float* src, int64_t n, uint16_t* dst) {
  if (at_least(isa, Isa::avx512))
    avx512::floats_to_halves(src, n, dst);
  else if (isa == Isa::avx2)
    avx2::floats_to_halves(src, n, dst);
  else
    floats_to_halves_scalar(src, n, dst);
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == D, "rms_norm: weight must be [", D, "]");
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor w = w_in.contiguous();
  torch::Tensor out = torch::empty_like(x);
  const int64_t R = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const Isa isa = active_isa();
  parallel_rows(R, R * D, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(isa, xp + r * D, wp, D, e, op + r * D);
  });
  return out;
}

// qkv [T, (H + 2 Hkv) * D] (last dim contiguous) -> query [T, H, D], key [T, Hkv, D]:
// optional per-head RMS norm (Gemma 3 QK-norm), then RoPE at positions [T] from the
// tables cos, sin [P, D].
std::vector<torch::Tensor> qk_norm_rope(const torch::Tensor& qkv, int64_t H, int64_t Hkv, int64_t D,
                                        const c10::optional<torch::Tensor>& q_norm,
                                        const c10::optional<torch::Tensor>& k_norm, double eps,
                                        const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                                        const torch::Tensor& positions_in) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1,
              "qk_norm_rope: qkv must be [T, (H + 2 Hkv) * D] fp32 with a contiguous last dim");
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qk_norm_rope: qkv width ", qkv.size(1), " != (H + 2 Hkv) * D");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "qk_norm_rope: give both q_norm and k_norm or neither");
  const torch::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const torch::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), P = cos.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "qk_norm_rope: tables must be [P, D]");
  TORCH_CHECK(positions.numel() == T, "qk_norm_rope: positions must be [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "qk_norm_rope: position out of table");
  torch::Tensor query = torch::empty({T, H, D}, qkv.options());
  torch::Tensor key = torch::empty({T, Hkv, D}, qkv.options());
  torch::Tensor qn, kn;
  if (q_norm.has_value()) {
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
    TORCH_CHECK(qn.numel() == D && kn.numel() == D, "qk_norm_rope: norms must be [D]");
  }
  const float* src = qkv.data_ptr<float>();
  const int64_t lds = qkv.stride(0);
  const float e = static_cast<float>(eps);
  const Isa isa = active_isa();
  parallel_rows(T, T * (H + Hkv) * D, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos.data_ptr<float>() + pos[t] * D;
      const float* s = sin.data_ptr<float>() + pos[t] * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* x = src + t * lds + h * D;
        const bool is_q = h < H;
        if (qn.defined()) {
          rms_norm_row(isa, x, (is_q ? qn : kn).data_ptr<float>(), D, e, normed.data());
          x = normed.data();
        }
        float* out = is_q ? query.data_ptr<float>() + (t * H + h) * D : key.data_ptr<float>() + (t * Hkv + h - H) * D;
        rope_row(isa, x, c, s, D, out);
      }
    }
  });
  return {query, key};
}

// gate_up [R, 2 I] (gate first, then up) -> act(gate) * up [R, I]; activation "gelu_tanh" or "silu".
torch::Tensor gated_activation(const torch::Tensor& gate_up_in, const std::string& activation) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.scalar_type() == at::kFloat && gate_up_in.size(1) % 2 == 0,
              "gated_activation: gate_up must be [R, 2 I] fp32");
  TORCH_CHECK(activation == "gelu_tanh" || activation == "silu",
              "gated_activation: activation must be 'gelu_tanh' or 'silu', got '", activation, "'");
  const bool gelu = activation == "gelu_tanh";
  const torch::Tensor gate_up = gate_up_in.contiguous();
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({R, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const Isa isa = active_isa();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = src + r * 2 * I;
      gated_row(isa, gate, gate + I, I, gelu, dst + r * I);
    }
  };
  parallel_rows(R, R * I, rows);
  return out;
}

// Row-wise argmax of x [R, V] fp32 -> int64 [R]: the first index of the row's maximum, torch.argmax's rule (a
// row holding a NaN is left to torch.argmax). Rows are cut into pieces that the threads share; a row's pieces
// are combined in index order, so the answer does not depend on the threads.
torch::Tensor argmax_rows(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) > 0,
              "argmax_rows: x must be [R, V] fp32 with V > 0");
  TORCH_CHECK(x_in.size(1) < (int64_t(1) << 31), "argmax_rows: V must fit in int32");
  const torch::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  constexpr int64_t kPiece = 16384;
  const int64_t pieces = (V + kPiece - 1) / kPiece;
  std::vector<ArgmaxPart> parts(R * pieces);
  const float* xp = x.data_ptr<float>();
  const Isa isa = active_isa();
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / pieces, a = (t % pieces) * kPiece, n = std::min(kPiece, V - a);
      parts[t] = argmax_range(isa, xp + r * V + a, n, a);
    }
  };
  parallel_rows(R * pieces, R * V, run);
  torch::Tensor out = torch::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    ArgmaxPart best = parts[r * pieces];
    for (int64_t p = 1; p < pieces; ++p) {
      const ArgmaxPart& part = parts[r * pieces + p];
      best.nan = best.nan || part.nan;
      if (part.value > best.value) {
        best.value = part.value;
        best.index = part.index;
      }
    }
    op[r] = best.nan ? x[r].argmax().item<int64_t>() : best.index;
  }
  return out;
}

// Token ids as a flat int64 tensor, each checked to be a row of an N-row table.
torch::Tensor embedding_ids(const torch::Tensor& ids_in, int64_t N) {
  const torch::Tensor ids = ids_in.to(at::kLong).contiguous().reshape({-1});
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "embedding_rows: token id ", idp[i], " out of range [0, ", N, ")");
  return ids;
}

// Rows of a q8 weight as an embedding table: out[i, j] = (qweight byte of (ids[i], j) - 128) * scale[ids[i], j / 32]
// in fp32 (one rounding, the product QuantizedWeight.int8() * _scales() computes). unpack[j] is the packed
// column of natural column j; rows in tiles of 4 are chunk-interleaved (QuantizedWeight's layout), the last N % 4
// rows are plain.
torch::Tensor embedding_rows(const torch::Tensor& qweight, const torch::Tensor& wscale, const torch::Tensor& ids_in,
                             const torch::Tensor& unpack_in) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "embedding_rows: qweight must be contiguous uint8 [N, Kp]");
  const int64_t N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(Kp % kChunk == 0, "embedding_rows: bad padded width ", Kp);
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) == N && wscale.size(1) == Kp / 32,
              "embedding_rows: scale must be contiguous fp16 [N, Kp/32]");
  const torch::Tensor ids = embedding_ids(ids_in, N);
  const torch::Tensor unpack = unpack_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), K = unpack.numel();
  TORCH_CHECK(K <= Kp, "embedding_rows: ", K, " columns but the weight has ", Kp);
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* up = unpack.data_ptr<int64_t>();
  for (int64_t j = 0; j < K; ++j) TORCH_CHECK(up[j] >= 0 && up[j] < Kp, "embedding_rows: unpack index out of range");
  torch::Tensor out = torch::empty({n, K}, qweight.options().dtype(at::kFloat));
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  const int64_t nfull = N / 4 * 4;
  // byte (r, p) of a tiled row: W[(r / 4) * 4 * Kp + (r % 4) * 64 + in_tile[j]], with p = unpack[j]
  std::vector<int64_t> in_tile(K);
  for (int64_t j = 0; j < K; ++j) in_tile[j] = (up[j] / kChunk) * 4 * kChunk + up[j] % kChunk;
  parallel_rows(n, n * K, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = idp[i];
      const uint16_t* row_scales = ws + r * (Kp / 32);
      const bool tiled = r < nfull;
      const uint8_t* base = tiled ? W + (r / 4) * 4 * Kp + (r % 4) * kChunk : W + r * Kp;
      const int64_t* offsets = tiled ? in_tile.data() : up;
      float* dst = op + i * K;
      for (int64_t j = 0; j < K; ++j)
        dst[j] = static_cast<float>(static_cast<int>(base[offsets[j]]) - 128) * half_to_float(row_scales[j / 32]);
    }
  });
  return out;
}

// Writes keys/values [n, Hkv, D] fp32 at (slots[i], positions[i]) of the caches [S, Hkv, L, D] (fp32, or fp16
// rounded to nearest even as tensor.to(torch.float16) does): KVCache.write without torch's indexing machinery.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots_in,
              const torch::Tensor& positions_in, const torch::Tensor& keys_in, const torch::Tensor& values_in) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "kv_write: caches must be contiguous [S, Hkv, L, D], both fp32 or both fp16");
  const int64_t S = k_cache.size(0), H = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3);
  const torch::Tensor slots = slots_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
  const int64_t n = slots.numel();
  TORCH_CHECK(positions.numel() == n, "kv_write: ", n, " slots but ", positions.numel(), " positions");
  TORCH_CHECK(keys_in.dim() == 3 && keys_in.size(0) == n && keys_in.size(1) == H && keys_in.size(2) == D &&
                  keys_in.sizes() == values_in.sizes(),
              "kv_write: keys and values must be [", n, ", ", H, ", ", D, "]");
  // rows may be strided (the values are a column slice of the fused qkv projection): each row's heads contiguous
  auto rows_of = [](const torch::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.to(at::kFloat).contiguous();
  };
  const torch::Tensor keys = rows_of(keys_in), values = rows_of(values_in);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S && pp[i] >= 0 && pp[i] < L, "kv_write: (slot, position) (", sp[i], ", ",
                pp[i], ") outside the cache's [", S, ", ", L, ")");
  const bool half = k_cache.scalar_type() == at::kHalf;
  const Isa isa = active_isa();
  for (int w = 0; w < 2; ++w) {
    const torch::Tensor& rows = w == 0 ? keys : values;
    const float* src = rows.data_ptr<float>();
    const int64_t row_stride = n > 1 ? rows.stride(0) : H * D;
    void* base = (w == 0 ? k_cache : v_cache).data_ptr();  // element (s, h, p, 0) at ((s * H + h) * L + p) * D
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* row = src + i * row_stride + h * D;
        const int64_t at = ((sp[i] * H + h) * L + pp[i]) * D;
        if (!half) {
          std::memcpy(static_cast<float*>(base) + at, row, size_t(D) * sizeof(float));
          continue;
        }
        uint16_t* dst = static_cast<uint16_t*>(base) + at;
        floats_to_halves(isa, row, D, dst);
      }
  }
}

// --------------------------------------------------------------------------
// int8 linear, AMX layout ("amx"): the weights of 16 output rows and one block of 32 inputs form one AMX tile.
//
// qweight int8 [Np, Kp] (Np = N rounded up to 16, zero rows beyond N), memory order
// [Np/16 row tiles][Kp/32 blocks][8 quads][16 rows][4 values]: the 512 bytes of (row tile t, block b) hold
// w[16 t + r][32 b + 4 q + i] at q * 64 + r * 4 + i, which is the B operand of one TDPBSSD with K = 32.
// tile_scale fp16 [Np/16, Kp/32, 16]: the block scales of the tile's 16 rows.
// Activations are quantized per row and block of 32 exactly as for the other layout (quantize_unit_*), in
// natural order: xq int8 [M, Kp], xs fp32 [M, Kp/32]. Every output is then
//   fa = +0; for b = 0, 1, ...: fa = fma(float(dot_b), xs[m][b] * ws[n][b], fa);   y = fa (+ bias[n])
// with dot_b the exact int32 dot product of block b (signed x signed: no offset to cancel). The order of the
// blocks is fixed, so y does not depend on M, on the other rows or on the threads; the AMX path (one TDPBSSD
// per block and tile of up to 16 activation rows, the epilogue over the 16 output rows of a zmm) and the scalar
// path perform the same operations and give the same bits.


torch::Tensor embedding_rows_amx(const torch::Tensor& qweight, const torch::Tensor& wscale, const torch::Tensor& ids_in,
                                 int64_t in_features) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "embedding_rows_amx: qweight must be contiguous int8 [Np, Kp]");
  const int64_t Np = qweight.size(0), Kp = qweight.size(1), K = in_features;
  TORCH_CHECK(Kp % kChunk == 0 && Np % kAmxRows == 0 && K <= Kp && K > 0, "embedding_rows_amx: bad shape");
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) <= Np && wscale.size(1) == Kp / 32,
              "embedding_rows_amx: scale must be contiguous fp16 [N, Kp/32]");
  const int64_t N = wscale.size(0), NB = Kp / 32;
  const torch::Tensor ids = embedding_ids(ids_in, N);
  const int64_t n = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  torch::Tensor out = torch::empty({n, K}, qweight.options().dtype(at::kFloat));
  const int8_t* W = qweight.data_ptr<int8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  parallel_rows(n, n * K, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = idp[i];
      const int8_t* tile_row = W + (r / kAmxRows) * NB * kAmxTile + (r % kAmxRows) * 4;
      float* dst = op + i * K;
      for (int64_t k = 0; k < K; ++k)
        dst[k] = static_cast<float>(tile_row[(k / 32) * kAmxTile + (k % 32 / 4) * 64 + k % 4]) *
                 half_to_float(ws[r * NB + k / 32]);
    }
  });
  return out;
}
