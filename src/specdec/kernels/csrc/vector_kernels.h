// The vectorised kernels other than the int8 linear, written once over the op set of simd_avx512.h /
// simd_avx2.h (16 fp32 lanes). Each performs, lane by lane, the operations of its scalar counterpart in
// scalar.h, so every path gives the same bits. Included inside namespace avx512 and namespace avx2, each under
// its own #pragma GCC target (see q8_kernels.cpp).

// exp_scalar's operations, 16 lanes at a time.
inline vf exp16(vf x) {
  const vf xc = max(x, set1(kExpLo));
  const vf fx = round_even(mul(xc, set1(kLog2e)));
  vf r = fmadd(fx, set1(-kC1), xc);
  r = fmadd(fx, set1(-kC2), r);
  const vf r2 = mul(r, r);
  vf y = set1(kP0);
  y = fmadd(y, r, set1(kP1));
  y = fmadd(y, r, set1(kP2));
  y = fmadd(y, r, set1(kP3));
  y = fmadd(y, r, set1(kP4));
  y = fmadd(y, r, set1(kP5));
  y = fmadd(y, r2, r);
  y = add(y, set1(1.0f));
  y = mul(y, exp2i(fx));
  return select(less(x, set1(kExpLo)), zero(), y);
}

// ---- activation quantization

// quantize_unit_scalar's operations (amax of |x| -- exact in any order --, d = amax / 127, id = 1 / d,
// nearest-even rounding of x * id, clamp to +-127, exact int sum), 16 values per instruction, in two passes
// so that the blocks' reductions and divisions overlap instead of forming one chain per block.
inline void quantize_unit(const float* xr, int64_t K, int64_t b0, int nb, int8_t* q, float* d, int32_t* sum) {
  const vf lim = set1(127.0f);
  const vf nlim = set1(-127.0f);
  vm lo[16], hi[16];
  alignas(64) float amax[16] = {0};
  alignas(64) float id[16];
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const int64_t kn = values_in_block(K, k0);
    lo[l] = first(kn);
    hi[l] = first(kn - 16);
    const vf v0 = load_first(xr + k0, lo[l]);
    const vf v1 = load_first(xr + k0 + 16, hi[l]);
    amax[l] = hmax(max(abs(v0), abs(v1)));
  }
  const vf dv = div(load(amax), set1(127.0f));  // lane-wise as the scalar divide
  store(id, select(greater(dv, zero()), div(set1(1.0f), dv), zero()));
  store(d, dv);
  for (int l = 0; l < nb; ++l) {
    const int64_t k0 = (b0 + l) * 32;
    const vf idv = set1(id[l]);
    const vf v0 = load_first(xr + k0, lo[l]);
    const vf v1 = load_first(xr + k0 + 16, hi[l]);
    const vi i0 = to_int(min(lim, max(nlim, round_even(mul(v0, idv)))));
    const vi i1 = to_int(min(lim, max(nlim, round_even(mul(v1, idv)))));
    sum[l] = hsum(i0) + hsum(i1);
    store_bytes(q + 32 * l, i0);
    store_bytes(q + 32 * l + 16, i1);
  }
}

// ---- attention
// K/V pointers are to the cache's element type T: float, or uint16_t for an fp16 cache, whose 16 values load()
// converts exactly to fp32 (vcvtph2ps); the arithmetic after the load is the same for both.

template <int NK, class T>
inline void scores(const float* q, const T* k, int64_t D, float scale, float* s) {
  vf acc[NK];
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) acc[i] = zero();
  for (int64_t d = 0; d < D; d += 16) {
    const vf qv = load(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < NK; ++i) acc[i] = fmadd(qv, load(k + i * D + d), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) s[i] = hsum(acc[i]) * scale;
}

// acc[c*16 ..] += sum_{j in [0, n)} p[j] * V[j, c*16 ..] sequentially in j (NC chunks of 16)
template <int NC, class T>
inline void pv_block(const float* p, const T* V, int64_t n, int64_t D, float* acc_mem) {
  vf acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = load(acc_mem + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    const vf pj = set1(p[j]);
    const T* v = V + j * D;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = fmadd(pj, load(v + c * 16), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) store(acc_mem + c * 16, acc[c]);
}

// Columns in groups of up to kPvChunks chunks of 16 (the accumulators of a group stay in registers).
template <class T>
inline void pv(const float* p, const T* V, int64_t n, int64_t D, float* acc_mem) {
  const int64_t nc = D / 16;
  for (int64_t c = 0; c < nc; c += kPvChunks) {
    const int64_t cc = std::min<int64_t>(kPvChunks, nc - c);
    const T* Vc = V + c * 16;
    float* a = acc_mem + c * 16;
    switch (cc) {
      case 1: pv_block<1>(p, Vc, n, D, a); break;
      case 2: pv_block<2>(p, Vc, n, D, a); break;
      case 3: pv_block<3>(p, Vc, n, D, a); break;
      case 4: pv_block<4>(p, Vc, n, D, a); break;
      case 5: pv_block<5>(p, Vc, n, D, a); break;
      case 6: pv_block<6>(p, Vc, n, D, a); break;
      case 7: pv_block<7>(p, Vc, n, D, a); break;
      default: pv_block<8>(p, Vc, n, D, a); break;
    }
  }
}

// scores of 4 pairs x 4 consecutive keys starting at k; pair p's 4 scores go to s[p][0..3]
template <class T>
inline void scores_tile(const float* const* q, const T* k, int64_t D, float scale, float* const* s) {
  vf acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = zero();
  for (int64_t d = 0; d < D; d += 16) {
    vf qv[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) qv[p] = load(q[p] + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const vf kv = load(k + j * D + d);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) acc[4 * j + p] = fmadd(qv[p], kv, acc[4 * j + p]);
    }
  }
  // lane 4p + j = hsum(acc[4j + p]) = score(pair p, key j)
  store_quarters(mul(reduce16(acc), set1(scale)), s);
}

// one pair, keys [j0, j1) -> s (indexed by absolute key)
template <class T>
inline void scores_one(const float* q, const T* K, int64_t j0, int64_t j1, int64_t D, float scale, float* s) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) scores<4>(q, K + j * D, D, scale, s + j);
  for (; j < j1; ++j) scores<1>(q, K + j * D, D, scale, s + j);
}

// 4 pairs, keys [j0, j1), NC chunks of 16 columns starting at column c0:
// acc_p[c] += sum_j p_p[j] * V[j, c] sequentially in j
template <int NC, class T>
inline void pv_tile(const float* const* p, const T* V, int64_t j0, int64_t j1, int64_t D, int64_t c0,
                    float* const* acc_mem) {
  vf acc[4][NC];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = load(acc_mem[r] + c0 + c * 16);
  for (int64_t j = j0; j < j1; ++j) {
    vf v[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) v[c] = load(V + j * D + c0 + c * 16);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const vf pj = set1(p[r][j]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = fmadd(pj, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) store(acc_mem[r] + c0 + c * 16, acc[r][c]);
}

template <class T>
inline void pv_tile4(const float* const* p, const T* V, int64_t j0, int64_t j1, int64_t D, float* const* acc_mem) {
  const int64_t nc = D / 16;
  for (int64_t c = 0; c < nc; c += kPvTileChunks) {
    switch (std::min<int64_t>(kPvTileChunks, nc - c)) {
      case 1: pv_tile<1>(p, V, j0, j1, D, c * 16, acc_mem); break;
      case 2: pv_tile<2>(p, V, j0, j1, D, c * 16, acc_mem); break;
      case 3: pv_tile<3>(p, V, j0, j1, D, c * 16, acc_mem); break;
      default: pv_tile<4>(p, V, j0, j1, D, c * 16, acc_mem); break;
    }
  }
}

// scores s[0 .. n) -> exp(s - max) in place; returns their sum (16-lane partial sums, then hsum16)
inline float softmax_numerators(float* s, int64_t n) {
  vf mv = set1(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const vm mk = first(n - j0);
    mv = select(mk, max(mv, load_first(s + j0, mk)), mv);
  }
  const vf mxv = set1(hmax(mv));
  vf ps = zero();
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const vm mk = first(n - j0);
    const vf e = select(mk, exp16(sub(load_first(s + j0, mk), mxv)), zero());
    store_first(s + j0, mk, e);
    ps = add(ps, e);
  }
  return hsum(ps);
}

// One attention work item: P (row, head) pairs that use the same kv head of the same slot. Pair r has query qs[r],
// key range [a[r], b[r]) (absolute cache positions, non-empty) and output outs[r]; K, V point at position 0 of the
// (slot, kv head). K/V are walked once in blocks of keys that stay in L1/L2 while every pair uses them. Every
// pair's result is computed with exactly the operation sequence of attn_keys_scalar (score = hsum16 tree of the
// per-lane fma chain over d, times scale; softmax with the pair's 16-lane sums; output = sequential fma over the
// keys in ascending order, / sum), so a pair's result does not depend on which other pairs share its item.
// Extra keys (tree rows): pair r then attends ne[r] more keys at cache positions ex[r][0 .. ne[r]) after its
// range, each scored alone (scores<1>) into the score buffer right after the range's scores and added to P @ V
// after the range's keys, in that order: the pair's keys in logical order, as attn_tree_row_scalar.
// scratch: P * lds floats of scores, then P * D accumulators.
template <class T>
void attn_item(int64_t P, const float* const* qs, const int32_t* a, const int32_t* b, const int32_t* const* ex,
               const int64_t* ne, float* const* outs, const T* K, const T* V, int64_t D, float scale, int64_t lds,
               float* scratch) {
  // sb[r] is indexed by the absolute key position: sb[r] + a[r] is the pair's score buffer
  std::vector<float*> sb(P), acc(P);
  int64_t jlo = INT64_MAX, jhi = 0;
  for (int64_t r = 0; r < P; ++r) {
    sb[r] = scratch + r * lds - a[r];
    acc[r] = scratch + P * lds + r * D;
    jlo = std::min<int64_t>(jlo, a[r]);
    jhi = std::max<int64_t>(jhi, b[r]);
  }
  const int64_t jb = std::max<int64_t>(16, (32 * 1024) / (D * 4)) / 4 * 4;
  // pass 1: scores
  for (int64_t j0 = jlo; j0 < jhi; j0 += jb) {
    const int64_t j1 = std::min(jhi, j0 + jb);
    for (int64_t r0 = 0; r0 < P; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, P - r0);
      int64_t lo[4], hi[4], c0, c1;
      clip_key_ranges(a + r0, b + r0, nr, j0, j1, lo, hi, c0, c1);
      const bool joint = kJointScores && nr == 4 && c1 - c0 >= 4;
      const int64_t ce = joint ? c0 + (c1 - c0) / 4 * 4 : c0;  // joint keys [c0, ce)
      if (joint) {
        for (int64_t j = c0; j < ce; j += 4) {
          float* s[4] = {sb[r0] + j, sb[r0 + 1] + j, sb[r0 + 2] + j, sb[r0 + 3] + j};
          scores_tile(qs + r0, K + j * D, D, scale, s);
        }
      }
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        if (lo[i] >= hi[i]) continue;
        if (joint) {
          scores_one(qs[r], K, lo[i], c0, D, scale, sb[r]);
          scores_one(qs[r], K, ce, hi[i], D, scale, sb[r]);
        } else {
          scores_one(qs[r], K, lo[i], hi[i], D, scale, sb[r]);
        }
      }
    }
  }
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = 0; e < ne[r]; ++e) scores<1>(qs[r], K + int64_t(ex[r][e]) * D, D, scale, sb[r] + b[r] + e);
  // softmax numerators and sums, per pair
  std::vector<float> sums(P);
  for (int64_t r = 0; r < P; ++r) {
    sums[r] = softmax_numerators(sb[r] + a[r], b[r] - a[r] + ne[r]);
    std::fill(acc[r], acc[r] + D, 0.0f);
  }
  // pass 2: P @ V, per pair sequential over keys in ascending order
  for (int64_t j0 = jlo; j0 < jhi; j0 += jb) {
    const int64_t j1 = std::min(jhi, j0 + jb);
    for (int64_t r0 = 0; r0 < P; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, P - r0);
      int64_t lo[4], hi[4], c0, c1;
      clip_key_ranges(a + r0, b + r0, nr, j0, j1, lo, hi, c0, c1);
      const bool joint = nr == 4 && c1 - c0 >= 2;
      for (int64_t i = 0; i < nr; ++i) {  // keys before the joint part (or all)
        const int64_t e = joint ? c0 : hi[i];
        if (lo[i] < e) pv(sb[r0 + i] + lo[i], V + lo[i] * D, e - lo[i], D, acc[r0 + i]);
      }
      if (!joint) continue;
      pv_tile4(sb.data() + r0, V, c0, c1, D, acc.data() + r0);
      for (int64_t i = 0; i < nr; ++i)  // keys after it
        if (c1 < hi[i]) pv(sb[r0 + i] + c1, V + c1 * D, hi[i] - c1, D, acc[r0 + i]);
    }
  }
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = 0; e < ne[r]; ++e) pv(sb[r] + b[r] + e, V + int64_t(ex[r][e]) * D, 1, D, acc[r]);
  for (int64_t r = 0; r < P; ++r) {
    const vf sv = set1(sums[r]);
    for (int64_t d = 0; d < D; d += 16) store(outs[r] + d, div(load(acc[r] + d), sv));
  }
}

// ---- row-wise kernels

// gated_scalar's operations, 16 elements at a time; the tail on the scalar path.
inline void gated_row(const float* gate, const float* up, int64_t n, bool gelu, float* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const vf x = load(gate + j);
    vf t;
    if (gelu) {
      const vf x3 = mul(mul(x, x), x);
      const vf inner = add(x, mul(set1(kGeluA), x3));
      t = mul(set1(-2.0f), mul(set1(kGeluC), inner));
    } else {
      t = sub(zero(), x);
    }
    t = min(t, set1(kExpHi));
    const vf act = div(x, add(set1(1.0f), exp16(t)));
    store(out + j, mul(act, load(up + j)));
  }
  for (; j < n; ++j) out[j] = gated_scalar(gate[j], up[j], gelu);
}

// argmax_range_scalar's answer, 16 lanes at a time: each lane keeps its first maximum (strictly greater
// replaces), the lanes are then reduced by value and, among equal values, by the smallest index; the tail
// (indices above every lane's) replaces only when strictly greater.
inline ArgmaxPart argmax_range(const float* x, int64_t n, int64_t offset) {
  if (n < 16) return argmax_range_scalar(x, n, offset);
  const vi lanes = iota();
  vf best = load(x);
  vi best_index = lanes;
  vm nan = unordered(best);
  int64_t j = 16;
  for (; j + 16 <= n; j += 16) {
    const vf v = load(x + j);
    const vm greater_lanes = greater(v, best);
    best = select(greater_lanes, v, best);
    best_index = select(greater_lanes, add(lanes, static_cast<int32_t>(j)), best_index);
    nan = either(nan, unordered(v));
  }
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  store(values, best);
  store(indices, best_index);
  ArgmaxPart part{values[0], indices[0], any(nan)};
  for (int l = 1; l < 16; ++l)
    if (values[l] > part.value || (values[l] == part.value && indices[l] < part.index)) {
      part.value = values[l];
      part.index = indices[l];
    }
  argmax_scan(x, j, n, part);
  part.index += offset;
  return part;
}

// rms_norm_row_scalar's operations 16 lanes at a time: lane l sums the squares of elements l, l + 16, ... (square, then
// add: the build does not contract them), the tail added only in its lanes, then the same hsum16 tree and scalar
// rsqrt; out = (x * r) * w element by element.
inline void rms_norm_row(const float* x, const float* w, int64_t D, float eps, float* out) {
  vf acc = zero();
  int64_t j0 = 0;
  for (; j0 + 16 <= D; j0 += 16) {
    const vf v = load(x + j0);
    acc = add(acc, mul(v, v));
  }
  const vm tail = first(D - j0);
  if (j0 < D) {
    const vf v = load_first(x + j0, tail);
    acc = select(tail, add(acc, mul(v, v)), acc);
  }
  const float mean = hsum(acc) / static_cast<float>(D);
  const vf r = set1(1.0f / std::sqrt(mean + eps));
  for (j0 = 0; j0 + 16 <= D; j0 += 16) store(out + j0, mul(mul(load(x + j0), r), load(w + j0)));
  if (j0 < D) store_first(out + j0, tail, mul(mul(load_first(x + j0, tail), r), load_first(w + j0, tail)));
}

// rope_row_scalar 16 lanes at a time with the same operations (two products, each rounded, then their sum; negating a
// product's factor negates the rounded product exactly); half = D / 2 must be a multiple of 16.
inline void rope_row(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; j += 16) {
    const vf lo = load(x + j), hi = load(x + j + half);
    store(out + j, add(mul(lo, load(cos + j)), mul(neg(hi), load(sin + j))));
    store(out + j + half, add(mul(hi, load(cos + j + half)), mul(lo, load(sin + j + half))));
  }
}

// floats_to_halves_scalar 16 at a time (vcvtps2ph rounds to nearest even too); the tail on the scalar path
inline void floats_to_halves(const float* src, int64_t n, uint16_t* dst) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) store_halves(dst + j, load(src + j));
  floats_to_halves_scalar(src + j, n - j, dst + j);
}
