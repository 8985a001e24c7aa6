// The scalar path: the executable specification of every kernel. Each SIMD path (vector_kernels.h,
// linear_*.h) performs these operations in this order, lane by lane, and is tested bit for bit against them.

// fixed-order helpers (scalar emulation of the SIMD trees)

inline float hsum16_scalar(const float* a) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  float t0 = t4[0] + t4[2];
  float t1 = t4[1] + t4[3];
  return t0 + t1;
}

// Cephes-style expf, same operation sequence as exp16_avx.
constexpr float kExpLo = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f,
                kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;

inline float exp_scalar(float x) {
  const float xc = std::max(x, kExpLo);
  const float fx = std::nearbyint(xc * kLog2e);
  float r = std::fma(fx, -kC1, xc);
  r = std::fma(fx, -kC2, r);
  const float r2 = r * r;
  float y = kP0;
  y = std::fma(y, r, kP1);
  y = std::fma(y, r, kP2);
  y = std::fma(y, r, kP3);
  y = std::fma(y, r, kP4);
  y = std::fma(y, r, kP5);
  y = std::fma(y, r2, r);
  y = y + 1.0f;
  const int32_t n = static_cast<int32_t>(fx);
  const int32_t bits = (n + 127) << 23;
  float p2;
  std::memcpy(&p2, &bits, 4);
  y = y * p2;
  return x < kExpLo ? 0.0f : y;
}

// Quantizes the nb blocks of 32 values starting at block b0 of one activation row xr (K values, zero beyond
// K): block l's values in natural order go to q[32 l .. 32 l + 32), its scale d = amax / 127 to d[l] and the
// sum of its int8 values to sum[l] (round to nearest even, clamp to +-127). d and sum have room for 16.
using QuantizeUnit = void (*)(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum);

// values of block k0 / 32 that lie within the row's K (the rest of the block is zero padding)
inline int64_t values_in_block(int64_t K, int64_t k0) { return std::max<int64_t>(0, std::min<int64_t>(32, K - k0)); }

void quantize_unit_scalar(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum) {
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const int64_t kn = values_in_block(K, k0);
    float amax = 0.0f;
    for (int64_t i = 0; i < kn; ++i) amax = std::max(amax, std::fabs(xr[k0 + i]));
    d[l] = amax / 127.0f;
    const float id = d[l] > 0.0f ? 1.0f / d[l] : 0.0f;
    sum[l] = 0;
    for (int i = 0; i < 32; ++i) {
      int v = 0;
      if (i < kn) {
        float r = std::nearbyint(xr[k0 + i] * id);
        r = std::min(127.0f, std::max(-127.0f, r));
        v = static_cast<int>(r);
      }
      q[32 * l + i] = static_cast<int8_t>(v);
      sum[l] += v;
    }
  }
}

// ---- the int8 linear, vnni layout: one weight row x one activation row (see linear.h)

// w: first chunk of the row, cs: byte distance between consecutive 64-byte chunks
// ws: the row's fp16 block scales [Kp/32]
void dot_row_scalar(const uint8_t* w, int64_t cs, const int8_t* x, const int32_t* corr, const float* xs, const Layout& L,
                    const uint16_t* ws, const float* bias, float* y) {
  float fa[16] = {0};
  int32_t ia[16];
  for (int64_t u = 0; u < L.U; ++u) {
    const int nb = L.nb(u);
    const int64_t b0 = L.b0(u);
    float wl[16];
    for (int l = 0; l < 16; ++l) wl[l] = half_to_float(ws[b0 + l / (16 / nb)]);
    const int steps = nb / 2;
    const int64_t off = b0 * 32;
    for (int l = 0; l < 16; ++l) ia[l] = corr[u * 16 + l];
    for (int j = 0; j < steps; ++j) {
      const uint8_t* wp = w + (off / 64 + j) * cs;
      const int8_t* xp = x + off + j * 64;
      for (int l = 0; l < 16; ++l) {
        int32_t s = 0;
        for (int b = 0; b < 4; ++b) s += int32_t(wp[l * 4 + b]) * int32_t(xp[l * 4 + b]);
        ia[l] += s;
      }
    }
    for (int l = 0; l < 16; ++l) {
      const float s = xs[u * 16 + l] * wl[l];
      fa[l] = std::fma(static_cast<float>(ia[l]), s, fa[l]);
    }
  }
  float v = hsum16_scalar(fa);
  if (bias) v = v + *bias;
  *y = v;
}

// A K/V cache element as fp32: an fp32 cache as it is, an fp16 cache (stored as its uint16_t bits) converted
// exactly (every fp16 value is an fp32 value), so the attention arithmetic is the same fp32 sequence for both.
inline float kv_value(float v) { return v; }
inline float kv_value(uint16_t h) { return half_to_float(h); }

// scalar attention for one (row, head) over n keys; key j is at cache position key_pos(j) of K / V
// (which point at position 0 of the (slot, kv head)).  The operation sequence depends only on the
// keys' order, not on where they are stored: a tree row whose keys are a prefix range plus its
// ancestors gives bitwise the result of the same keys stored contiguously.  T: the cache element type.
template <class KeyPos, class T>
void attn_keys_scalar(const float* q, const T* K, const T* V, int64_t n, KeyPos key_pos, int64_t D,
                      float scale, float* out, float* sbuf) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    float acc[16] = {0};
    const T* k = K + key_pos(j) * D;
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      for (int l = 0; l < 16 && d0 + l < D; ++l) acc[l] = std::fma(q[d0 + l], kv_value(k[d0 + l]), acc[l]);
    const float s = hsum16_scalar(acc) * scale;
    sbuf[j] = s;
    mx = std::max(mx, s);
  }
  float ps[16] = {0};
  for (int64_t j0 = 0; j0 < n; j0 += 16)
    for (int l = 0; l < 16 && j0 + l < n; ++l) {
      const float e = exp_scalar(sbuf[j0 + l] - mx);
      sbuf[j0 + l] = e;
      ps[l] = ps[l] + e;
    }
  const float sum = hsum16_scalar(ps);
  for (int64_t d = 0; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(sbuf[j], kv_value(V[key_pos(j) * D + d]), acc);
    out[d] = acc / sum;
  }
}

// scalar attention for one (row, head) over the contiguous keys [a, b)
template <class T>
void attn_row_scalar(const float* q, const T* K, const T* V, int64_t a, int64_t b, int64_t D, float scale,
                     float* out, float* sbuf) {
  attn_keys_scalar(q, K, V, b - a, [a](int64_t j) { return a + j; }, D, scale, out, sbuf);
}

// scalar attention for one (row, head) over the logical keys [a, b) then extra[0 .. ne)
template <class T>
void attn_tree_row_scalar(const float* q, const T* K, const T* V, int64_t a, int64_t b, const int32_t* extra,
                          int64_t ne, int64_t D, float scale, float* out, float* sbuf) {
  const int64_t np = b - a;
  attn_keys_scalar(q, K, V, np + ne, [a, np, extra](int64_t j) { return j < np ? a + j : int64_t(extra[j - np]); },
                   D, scale, out, sbuf);
}

// Gated activation of one element: act(gate) * up with act = GELU (tanh form) or SiLU, both written
// as x * sigmoid(z) = x / (1 + exp(-z)) (GELU-tanh: z = 2 * sqrt(2/pi) * (x + 0.044715 x^3));
// exp's argument is clamped at 88 so a very negative x gives 0 rather than an overflow.
constexpr float kGeluC = 0.7978845608028654f;
constexpr float kGeluA = 0.044715f;
constexpr float kExpHi = 88.0f;

inline float gated_scalar(float x, float up, bool gelu) {
  float t;
  if (gelu) {
    const float inner = x + kGeluA * (x * x * x);
    t = -2.0f * (kGeluC * inner);
  } else {
    t = -x;
  }
  t = std::min(t, kExpHi);
  return (x / (1.0f + exp_scalar(t))) * up;
}


// One piece of a row's argmax: its largest value, the first index holding it (offset added) and whether a NaN
// was seen (the caller then leaves the row to torch.argmax, whose NaN rule it keeps).
struct ArgmaxPart {
  float value;
  int64_t index;
  bool nan;
};

// Folds x[j, n) into part in index order: a NaN is noted, a strictly greater value replaces the maximum.
inline void argmax_scan(const float* x, int64_t j, int64_t n, ArgmaxPart& part) {
  for (; j < n; ++j) {
    if (std::isnan(x[j])) {
      part.nan = true;
    } else if (x[j] > part.value) {
      part.value = x[j];
      part.index = j;
    }
  }
}

ArgmaxPart argmax_range_scalar(const float* x, int64_t n, int64_t offset) {
  ArgmaxPart part{x[0], 0, std::isnan(x[0])};
  argmax_scan(x, 1, n, part);
  part.index += offset;
  return part;
}

// AVX-512 VNNI path


// One RMS norm row: 16 lane sums of squares (lane l takes elements l, l+16, ...),
// the fixed hsum16 tree, then out = (x * rsqrt(mean + eps)) * w.
inline void rms_norm_row_scalar(const float* x, const float* w, int64_t D, float eps, float* out) {
  float acc[16] = {0};
  for (int64_t j0 = 0; j0 < D; j0 += 16)
    for (int l = 0; l < 16 && j0 + l < D; ++l) acc[l] = acc[l] + x[j0 + l] * x[j0 + l];
  const float mean = hsum16_scalar(acc) / static_cast<float>(D);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t j = 0; j < D; ++j) out[j] = (x[j] * r) * w[j];
}

// Rotate-half RoPE of one head row: out = x * cos + rotate_half(x) * sin (products rounded
// separately, as torch computes it).
inline void rope_row_scalar(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];
  for (int64_t j = half; j < D; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

// n fp32 values -> fp16 bits, rounded to nearest even (c10::Half, as tensor.to(torch.float16))
inline void floats_to_halves_scalar(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = c10::Half(src[j]).x;
}

void linear_block_scalar(const uint8_t* W, const int8_t* X, const int32_t* corr, const float* xs, const Layout& L,
                         const uint16_t* wscale, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                         int64_t m0, int64_t m1) {
  const int64_t ldc = L.U * 16;
  const int64_t nfull = N / 4 * 4;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m)
      dot_row_scalar(n < nfull ? W + (n / 4) * 4 * L.Kp + (n % 4) * 64 : W + n * L.Kp, n < nfull ? 256 : 64,
                     X + m * L.Kp, corr + m * ldc, xs + m * ldc, L, wscale + n * (L.Kp / 32),
                     bias ? bias + n : nullptr, y + m * N + n);
}

// amx layout (see linear_amx.h): output rows [n0, n1) x activation rows [m0, m1).
void linear_amx_layout_scalar(const int8_t* W, const uint16_t* tscale, const int8_t* xq, const float* xs, int64_t Kp,
                              const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const int64_t NB = Kp / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t t = n / kAmxRows, r = n % kAmxRows;
    for (int64_t m = m0; m < m1; ++m) {
      float fa = 0.0f;
      for (int64_t b = 0; b < NB; ++b) {
        const int8_t* wt = W + (t * NB + b) * kAmxTile;
        const int8_t* xb = xq + m * Kp + b * 32;
        int32_t dot = 0;
        for (int q = 0; q < 8; ++q)
          for (int i = 0; i < 4; ++i) dot += int32_t(wt[q * 64 + r * 4 + i]) * int32_t(xb[q * 4 + i]);
        const float s = xs[m * NB + b] * half_to_float(tscale[(t * NB + b) * kAmxRows + r]);
        fa = std::fma(static_cast<float>(dot), s, fa);
      }
      if (bias) fa = fa + bias[n];
      y[m * N + n] = fa;
    }
  }
}
