// The int8 linear's entry points (q8_linear on the "vnni" layout, q8_linear_amx on the "amx" layout, see
// linear_amx.h): activation quantization, threading, and the dispatch to the kernel path.
//
// The int8 weight-only linear (Q8_0-style activations), with a reduction order per output element that does
// not depend on the number of rows M, on the other rows, or on the thread count.
//
// Weight layout ("packed", see ops.py): qweight [N, Kp] uint8, value = q + 128,
// Kp = K rounded up to a multiple of 64 (zero padded, i.e. byte 128).
// A row is a sequence of "units" of nb blocks of 32 values (nb*32 bytes):
//   * G = Kp / 512 groups of nb = 16 blocks, then
//   * the tail of Tb = (Kp % 512) / 32 blocks (even) split into units of
//     nb = 8, 4, 2 blocks (the binary digits of Tb, largest first).
// A unit is read as nb/2 zmm (64 bytes each); block i of the unit spreads over
// s = 16/nb lanes.  Byte j*64 + l*4 + b of the unit (j < nb/2, lane l, b < 4)
// holds value j*4*s + (l % s)*4 + b of block l / s.  So nb/2 vpdpbusd
// accumulate the exact int32 dot of each block in its s lanes, and every unit
// pays one scale epilogue: groups are lane-per-block (value 4*j + b), a unit
// of 2 blocks is plain natural order (lanes 0-7 block A, 8-15 block B).
// Rows are stored in tiles of 4: memory order [tile][Kp/64 chunks][4 rows][64 B],
// so one tile is read as a single sequential stream (the hardware prefetcher
// handles one long stream much better than 4 short ones); the last N % 4 rows
// are stored as plain rows.
// Weight scales: wscale [N, Kp/32] fp16, one per weight row and block of 32
// input values (natural block order), i.e. the same blocks as the activations.
// Lane l of a unit uses the scale of the unit's block l / s.
// Activations are quantized per row and block of 32 (scale = amax/127, round
// to nearest even) into the same layout.  For every unit the accumulator is
// initialised with -128 * sum(x_block) in the first lane of each block, which cancels
// the +128 bias of the unsigned weights exactly.  Then
//   facc[lane] = fma(float(iacc[lane]), xscale[lane] * wscale[lane], facc[lane])
// (the product rounded to fp32 first, -ffp-contract=off) and
// y = hsum16(facc) (+ bias[n]), hsum16 a fixed tree.
// The scalar path performs exactly the same operations lane by lane, so both
// paths give bitwise identical results.
//
// The avx2 path reaches the same int32 per lane without vpdpbusd (see linear_avx2.h).

// A unit of nb = 16 / S blocks from natural order (block l at q[32 l ..)) into the packed layout: 4-byte group
// (j * 16 + l * S + r) of the unit <- group (j * S + r) of block l. S is a constant so that each copy is one
// move (with S a variable the compiler merged them into a call of memcpy per block and group).
template <int S>
inline void scatter_unit(const int8_t* q, int8_t* qu) {
  constexpr int nb = 16 / S;
  for (int l = 0; l < nb; ++l)
    for (int j = 0; j < nb / 2; ++j) std::memcpy(qu + (j * 16 + l * S) * 4, q + 32 * l + j * S * 4, 4 * S);
}

// Quantize activation rows [m0, m1) into the packed layout, one unit at a time.
// lane_sum_factor: each lane's accumulator start also holds this times the sum of its activation bytes (0 where the
// weights are the unsigned bytes q + 128; 128 on the avx2 path's signed dot, linear_avx2.h; 112 where they are
// q5's v = q + 16, q5_avx2.h): every path then reaches the same int32 per lane.
void quantize_rows(QuantizeUnit quantize_unit, const float* x, int64_t K, const Layout& L, int64_t m0, int64_t m1,
                   int8_t* xq, int32_t* corr, float* xs, int32_t lane_sum_factor) {
  const int64_t ldc = L.U * 16;
  alignas(64) int8_t q[16 * 32];
  float d[16];
  int32_t sum[16];
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = xq + m * L.Kp;
    int32_t* cr = corr + m * ldc;
    float* sr = xs + m * ldc;
    std::memset(cr, 0, sizeof(int32_t) * ldc);
    for (int64_t u = 0; u < L.U; ++u) {
      const int nb = L.nb(u);
      const int s = 16 / nb;  // lanes per block
      const int64_t b0 = L.b0(u);
      quantize_unit(xr, K, b0, nb, q, d, sum);
      for (int l = 0; l < nb; ++l) {
        cr[u * 16 + l * s] = -128 * sum[l];
        for (int r = 0; r < s; ++r) sr[u * 16 + l * s + r] = d[l];
      }
      int8_t* qu = qr + b0 * 32;
      switch (s) {
        case 1: scatter_unit<1>(q, qu); break;
        case 2: scatter_unit<2>(q, qu); break;
        case 4: scatter_unit<4>(q, qu); break;
        default: scatter_unit<8>(q, qu); break;
      }
      if (lane_sum_factor)
        for (int lane = 0; lane < 16; ++lane) {
          int32_t lane_sum = 0;
          for (int j = 0; j < nb / 2; ++j)
            for (int b = 0; b < 4; ++b) lane_sum += qu[j * 64 + lane * 4 + b];
          cr[u * 16 + lane] += lane_sum_factor * lane_sum;
        }
    }
  }
}

// --------------------------------------------------------------------------
// scalar linear tile (one weight row x one activation row)

// The activations as contiguous fp32 [M, K] and the bias (if any) as contiguous fp32 [N], checked.
struct LinearInputs {
  torch::Tensor x, bias;
};
LinearInputs linear_inputs(const torch::Tensor& x_in, const c10::optional<torch::Tensor>& bias_in, int64_t N,
                           const char* name) {
  LinearInputs in;
  in.x = (x_in.scalar_type() == at::kFloat && x_in.is_contiguous()) ? x_in : x_in.to(at::kFloat).contiguous();
  if (bias_in.has_value() && bias_in->defined()) {
    const torch::Tensor& bi = *bias_in;
    in.bias = (bi.scalar_type() == at::kFloat && bi.is_contiguous()) ? bi : bi.to(at::kFloat).contiguous();
    TORCH_CHECK(in.bias.numel() == N, name, ": bias must have ", N, " elements");
  }
  return in;
}

// The calling thread's scratch for M quantized activation rows: the int8 values [M, Kp], then per row `per_row`
// fp32 scales and int32 block sums (their order within a row is the layout's).
struct QuantizedRows {
  int8_t* q;
  float* scales;
  int32_t* sums;
};
QuantizedRows quantized_rows_scratch(int64_t M, int64_t Kp, int64_t per_row) {
  thread_local Scratch scratch;
  const size_t q_bytes = align64(size_t(M * Kp));
  const size_t values_bytes = align64(size_t(M * per_row) * 4);
  uint8_t* base = scratch.get(q_bytes + 2 * values_bytes);
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + q_bytes),
          reinterpret_cast<int32_t*>(base + q_bytes + values_bytes)};
}


inline QuantizeUnit pick_quantize_unit(Isa isa) {
  if (at_least(isa, Isa::avx512)) return avx512::quantize_unit;
  if (isa == Isa::avx2) return avx2::quantize_unit;
  return quantize_unit_scalar;
}

// The body the linears on the vnni layout share (q8_linear, q5_linear): the activations quantized into the layout
// (lane_sum_factor(isa, avx2_vnni): see quantize_rows), then weight rows in tiles of 4 (of tile_bytes as stored),
// handed out in chunks, each chunk walked for every m-block of ~96 KiB of activations: block(isa, avx2_vnni, xq, corr,
// xs, L, y, n0, n1, m0, m1) computes weight rows [n0, n1) x activation rows [m0, m1) on the path isa (avx2_vnni: the
// avx2 path's AVX-VNNI variant).
template <class Factor, class Block>
torch::Tensor vnni_layout_linear(const LinearInputs& in, int64_t N, int64_t Kp, int64_t tile_bytes,
                                 const Factor& lane_sum_factor, const Block& block) {
  const torch::Tensor& x = in.x;
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const Layout L(Kp);
  const QuantizedRows act = quantized_rows_scratch(M, Kp, L.U * 16);
  int8_t* xq = act.q;
  float* xs = act.scales;
  int32_t* corr = act.sums;  // -128 * the block sums (see quantize_rows)

  const float* xp = x.data_ptr<float>();
  const Isa isa = active_isa();
  // the avx2 path's dots: vpdpbusd where the CPU has AVX-VNNI, else the signed dot (see linear_avx2.h)
  const bool avx2_vnni = avx2_vnni_variant(isa);
  const QuantizeUnit quantize_unit = pick_quantize_unit(isa);
  const int32_t factor = lane_sum_factor(isa, avx2_vnni);
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) {
    quantize_rows(quantize_unit, xp, K, L, a, b, xq, corr, xs, factor);
  });
  float* yp = y.data_ptr<float>();

  // Tiling: weight rows in tiles of 4; each chunk of tiles is walked for every m-block of ~96 KiB of activations.
  constexpr int64_t NR = 4;
  const int64_t ntiles = (N + NR - 1) / NR;
  const int64_t mb = std::max<int64_t>(3, ((96 * 1024) / Kp) / 3 * 3);
  const int64_t chunk = chunk_tiles(ntiles, tile_bytes, M, M <= mb);
  const int64_t nchunks = (ntiles + chunk - 1) / chunk;
  auto run_chunk = [&](int64_t c) {
    const int64_t t0 = c * chunk, t1 = std::min(ntiles, t0 + chunk);
    const int64_t n0 = t0 * NR, n1 = std::min(N, t1 * NR);
    for (int64_t m0 = 0; m0 < M; m0 += mb)
      block(isa, avx2_vnni, xq, corr, xs, L, yp, n0, n1, m0, std::min(M, m0 + mb));
  };
  run_chunk_workers(nchunks, [&](std::atomic<int64_t>& next) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) run_chunk(c);
  });
  return y;
}

// Checks of the fp16 block scales of a vnni-layout weight: [N, Kp/32], contiguous.
void check_block_scales(const torch::Tensor& wscale, int64_t N, int64_t Kp, const char* name) {
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.dim() == 2 &&
                  wscale.size(0) == N && wscale.size(1) == Kp / 32,
              name, ": scale must be contiguous fp16 [N, Kp/32]");
}

torch::Tensor q8_linear(const torch::Tensor& x_in, const torch::Tensor& qweight, const torch::Tensor& wscale,
                        const c10::optional<torch::Tensor>& bias_in, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear: x must be 2-D [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "q8_linear: qweight must be contiguous uint8 [N, Kp]");
  const int64_t K = x_in.size(1), N = qweight.size(0), Kp = qweight.size(1);
  TORCH_CHECK(K == in_features, "q8_linear: x has ", K, " features, weight expects ", in_features);
  TORCH_CHECK(Kp % kChunk == 0 && Kp >= K && Kp < K + kChunk, "q8_linear: bad padded width ", Kp);
  check_block_scales(wscale, N, Kp, "q8_linear");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q8_linear");
  const uint8_t* W = qweight.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  const float* bp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
  // the avx2 path's signed dot (not its AVX-VNNI variant) starts each lane 128 times its activation sum higher
  const auto lane_sum_factor = [](Isa isa, bool avx2_vnni) { return isa == Isa::avx2 && !avx2_vnni ? 128 : 0; };
  return vnni_layout_linear(in, N, Kp, 4 * Kp, lane_sum_factor, [&](Isa isa, bool avx2_vnni, const int8_t* xq,
                                                                     const int32_t* corr, const float* xs,
                                                                     const Layout& L, float* yp, int64_t n0,
                                                                     int64_t n1, int64_t m0, int64_t m1) {
    if (at_least(isa, Isa::avx512))
      avx512::linear_block(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1, Kp);
    else if (avx2_vnni)
      avx2_vnni::linear_block(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1, Kp);
    else if (isa == Isa::avx2)
      avx2::linear_block(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1, Kp);
    else
      linear_block_scalar(W, xq, corr, xs, L, ws, bp, yp, N, n0, n1, m0, m1);
  });
}

// Quantize activation rows [m0, m1) into natural order: xq [M, Kp], block scales xs and sums xsum [M, Kp/32].
void quantize_rows_natural(QuantizeUnit quantize_unit, const float* x, int64_t K, int64_t Kp, int64_t m0, int64_t m1,
                           int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t NB = Kp / 32;
  float d[16];
  int32_t sum[16];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b0 = 0; b0 < NB; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, NB - b0));
      quantize_unit(x + m * K, K, b0, nb, xq + m * Kp + b0 * 32, d, sum);
      std::memcpy(xs + m * NB + b0, d, sizeof(float) * nb);
      std::memcpy(xsum + m * NB + b0, sum, sizeof(int32_t) * nb);
    }
}

torch::Tensor q8_linear_amx_layout(const torch::Tensor& x_in, const torch::Tensor& qweight,
                                   const torch::Tensor& tile_scale, const c10::optional<torch::Tensor>& bias_in,
                                   int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2, "q8_linear_amx: x must be 2-D [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "q8_linear_amx: qweight must be contiguous int8 [Np, Kp]");
  const int64_t M = x_in.size(0), K = x_in.size(1), Np = qweight.size(0), Kp = qweight.size(1), N = out_features;
  TORCH_CHECK(K == in_features, "q8_linear_amx: x has ", K, " features, weight expects ", in_features);
  TORCH_CHECK(Kp % kChunk == 0 && Kp >= K && Kp < K + kChunk, "q8_linear_amx: bad padded width ", Kp);
  TORCH_CHECK(Np % kAmxRows == 0 && N <= Np && N > Np - kAmxRows, "q8_linear_amx: ", Np, " packed rows for ", N, " outputs");
  const int64_t NB = Kp / 32, tiles = Np / kAmxRows;
  TORCH_CHECK(tile_scale.scalar_type() == at::kHalf && tile_scale.is_contiguous() && tile_scale.dim() == 3 &&
                  tile_scale.size(0) == tiles && tile_scale.size(1) == NB && tile_scale.size(2) == kAmxRows,
              "q8_linear_amx: tile_scale must be contiguous fp16 [Np/16, Kp/32, 16]");
  const LinearInputs in = linear_inputs(x_in, bias_in, N, "q8_linear_amx");
  const torch::Tensor& x = in.x;
  const torch::Tensor& bias = in.bias;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const QuantizedRows act = quantized_rows_scratch(M, Kp, NB);
  int8_t* xq = act.q;
  float* xs = act.scales;
  int32_t* xsum = act.sums;
  const float* xp = x.data_ptr<float>();
  const Isa isa = active_isa();
  const bool avx2_vnni = avx2_vnni_variant(isa);
  const QuantizeUnit quantize_unit = pick_quantize_unit(isa);
  parallel_rows(M, M * K, [&](int64_t a, int64_t b) { quantize_rows_natural(quantize_unit, xp, K, Kp, a, b, xq, xs, xsum); });

  const int8_t* W = qweight.data_ptr<int8_t>();
  const uint16_t* ts = reinterpret_cast<const uint16_t*>(tile_scale.data_ptr<at::Half>());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Row tiles in chunks (chunk_tiles), each chunk walked for every block of 16 activation rows while its weights
  // stay in cache. Who computes a tile never changes its result.
  const int64_t chunk = chunk_tiles(tiles, NB * kAmxTile, M, M <= kAmxRows);
  const int64_t nchunks = (tiles + chunk - 1) / chunk;
  // A thread checks its tile configuration once per call (another library may have loaded its own since).
  auto run_chunks = [&](std::atomic<int64_t>& next) {
    int configured = 0;
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) {
      const int64_t t0 = c * chunk, t1 = std::min(tiles, t0 + chunk);
      if (isa == Isa::amx)
        amx::linear_amx_layout_amx(W, ts, xq, xs, xsum, Kp, bp, yp, N, t0, t1, 0, M, configured);
      else if (isa == Isa::avx512)
        amx::linear_amx_layout_vnni(W, ts, xq, xs, xsum, Kp, bp, yp, N, t0, t1, 0, M);
      else if (avx2_vnni)
        avx2_vnni::linear_amx_layout_avx2(W, ts, xq, xs, xsum, Kp, bp, yp, N, t0, t1, 0, M);
      else if (isa == Isa::avx2)
        avx2::linear_amx_layout_avx2(W, ts, xq, xs, xsum, Kp, bp, yp, N, t0, t1, 0, M);
      else
        linear_amx_layout_scalar(W, ts, xq, xs, Kp, bp, yp, N, t0 * kAmxRows, std::min(N, t1 * kAmxRows), 0, M);
    }
  };
  run_chunk_workers(nchunks, run_chunks);
  return y;
}
