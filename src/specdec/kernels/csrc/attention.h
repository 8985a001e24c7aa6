// The attention entry point: (row, head) pairs grouped into work items by slot and kv head, the items shared by
// the threads, each item computed by the kernel path's attn_item (vector_kernels.h) or pair by pair on the scalar
// path (scalar.h). Who computes a pair never changes its result.


// How the (row, head) pairs of one (slot, kv head) are cut into work items: a group of P pairs is cut into
// ceil(P / cap) pieces of equal size, rounded up to a multiple of 4 (the pair tile of attn_item) when the
// pieces hold 4 or more; the last piece takes the rest. Appends the pieces' sizes.
inline void append_attention_pieces(int64_t pairs, int64_t cap, std::vector<int64_t>& sizes) {
  const int64_t pieces = (pairs + cap - 1) / cap;
  int64_t size = (pairs + pieces - 1) / pieces;
  if (size >= 4) size = (size + 3) / 4 * 4;
  for (int64_t p0 = 0; p0 < pairs; p0 += size) sizes.push_back(std::min(size, pairs - p0));
}

// The item sizes (pairs per item, groups in order) for the cap (most pairs per item) whose items finish first on
// nth threads that take them in order, each the next item when free (as the attention loop does), at a cost per
// item of its pairs (a pair outside a tile of 4 costing half again as much) plus one pair's worth for reading the
// keys and values once more. Caps 32, 28, ..., 4, 3, 2, 1; ties go to the larger cap. Only the split depends on
// this, never a pair's arithmetic.
std::vector<int64_t> attention_split(const std::vector<int64_t>& group_pairs, int64_t nth) {
  std::vector<int64_t> best, sizes;
  double best_time = INFINITY;
  std::vector<double> free_at(std::max<int64_t>(1, nth));
  for (int64_t cap = 32; cap >= 1; cap = cap > 4 ? cap - 4 : cap - 1) {
    sizes.clear();
    for (const int64_t pairs : group_pairs) append_attention_pieces(pairs, cap, sizes);
    std::fill(free_at.begin(), free_at.end(), 0.0);
    for (const int64_t n : sizes)
      *std::min_element(free_at.begin(), free_at.end()) += 1.0 + double(n / 4 * 4) + 1.5 * double(n % 4);
    const double time = *std::max_element(free_at.begin(), free_at.end());
    if (time < best_time - 1e-9) best_time = time, best.swap(sizes);
  }
  return best;
}

torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                        const torch::Tensor& slots_in, const torch::Tensor& start_in, const torch::Tensor& end_in,
                        double scale_d, const c10::optional<torch::Tensor>& extra_in) {
  TORCH_CHECK(q_in.dim() == 3, "attention: q must be [M, Hq, D]");
  TORCH_CHECK(k_in.dim() == 4 && v_in.dim() == 4, "attention: caches must be [S, Hkv, L, D]");
  TORCH_CHECK(k_in.sizes() == v_in.sizes(), "attention: k_cache and v_cache shapes differ");
  const auto f32 = [](const torch::Tensor& t) {
    return (t.scalar_type() == at::kFloat && t.is_contiguous()) ? t : t.to(at::kFloat).contiguous();
  };
  const auto i32 = [](const torch::Tensor& t) {
    return (t.scalar_type() == at::kInt && t.is_contiguous()) ? t : t.to(at::kInt).contiguous();
  };
  // The caches are fp32 or fp16 (both the same); an fp16 cache is read as it is, never converted as a whole.
  TORCH_CHECK(k_in.scalar_type() == v_in.scalar_type(), "attention: k_cache is ", k_in.scalar_type(),
              " but v_cache is ", v_in.scalar_type());
  const bool half_kv = k_in.scalar_type() == at::kHalf;
  const auto kv = [&](const torch::Tensor& t) { return half_kv ? t.contiguous() : f32(t); };
  const torch::Tensor q = f32(q_in), kc = kv(k_in), vc = kv(v_in);
  const torch::Tensor slots = i32(slots_in), ks = i32(start_in), ke = i32(end_in);
  const int64_t M = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = kc.size(0), Hkv = kc.size(1), Lmax = kc.size(2);
  TORCH_CHECK(kc.size(3) == D, "attention: head dim mismatch");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "attention: Hq must be a multiple of Hkv");
  TORCH_CHECK(slots.numel() == M && ks.numel() == M && ke.numel() == M, "attention: slots/ranges must be [M]");
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int32_t* a = ks.data_ptr<int32_t>();
  const int32_t* b = ke.data_ptr<int32_t>();
  // extra keys (tree rows): row m then attends [a[m], b[m]) followed by extra[m, 0 .. ne[m]) (cache
  // positions, the leading non-negative entries of the row; -1 pads)
  torch::Tensor extra;
  int64_t E = 0;
  if (extra_in.has_value() && extra_in->defined()) {
    extra = i32(*extra_in);
    TORCH_CHECK(extra.dim() == 2 && extra.size(0) == M, "attention: extra_keys must be [M, E]");
    E = extra.size(1);
  }
  const int32_t* ep = E ? extra.data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> ne(M, 0);
  int64_t maxn = 0;
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sp[m] >= 0 && sp[m] < S, "attention: slot out of range");
    TORCH_CHECK(a[m] >= 0 && b[m] <= Lmax, "attention: key range out of bounds");
    while (ne[m] < E && ep[m * E + ne[m]] >= 0) {
      TORCH_CHECK(ep[m * E + ne[m]] < Lmax, "attention: extra key position out of bounds");
      ++ne[m];
    }
    maxn = std::max<int64_t>(maxn, std::max<int64_t>(0, b[m] - a[m]) + ne[m]);
  }
  auto out = torch::empty({M, Hq, D}, q.options());
  if (M == 0 || Hq == 0) return out;
  const float scale = static_cast<float>(scale_d);
  const int64_t group = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  // element offsets below are in cache elements; kp / vp are cast to the element type where they are read
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  const int64_t esize = kc.element_size();
  float* op = out.data_ptr<float>();
  const Isa isa = D % 16 == 0 ? active_isa() : Isa::scalar;  // the vector paths take D in chunks of 16

  // Work items: (row, head) pairs of the same slot and kv head, so that K/V are
  // read once per item.  How pairs are grouped into items (and items onto
  // threads) only decides who computes what, never how: each pair's result is
  // computed with the same operation sequence whatever its item.
  std::vector<int64_t> order(M);
  for (int64_t m = 0; m < M; ++m) order[m] = m;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return sp[x] < sp[y]; });
  std::vector<int64_t> run_start;  // runs of rows with the same slot and a non-empty key sequence
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t m = order[i];
    TORCH_CHECK(ne[m] == 0 || b[m] >= a[m], "attention: a row with extra keys needs key_end >= key_start");
    if (b[m] <= a[m] && ne[m] == 0) {
      std::fill(op + m * Hq * D, op + (m + 1) * Hq * D, 0.0f);
      continue;
    }
    if (rows.empty() || sp[rows.back()] != sp[m]) run_start.push_back(int64_t(rows.size()));
    rows.push_back(m);
  }
  run_start.push_back(int64_t(rows.size()));
  const int64_t nruns = int64_t(run_start.size()) - 1;
  if (nruns <= 0) return out;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> group_pairs;  // pairs per (run, kv head), in item order
  for (int64_t r = 0; r < nruns; ++r)
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) group_pairs.push_back((run_start[r + 1] - run_start[r]) * group);
  const std::vector<int64_t> item_pairs = attention_split(group_pairs, nth);  // pairs per item, in item order
  size_t next_item = 0;
  // pairs in item order: run, kv head, rows of the run, heads of the group
  const int64_t npairs = int64_t(rows.size()) * Hq;
  std::vector<const float*> pq(npairs);
  std::vector<float*> po(npairs);
  std::vector<int32_t> pa(npairs), pb(npairs);
  std::vector<const int32_t*> pe(npairs);  // the pair's extra keys (tree rows)
  std::vector<int64_t> pne(npairs);
  struct Item {
    int64_t p0, np;
    const void *K, *V;  // position 0 of the (slot, kv head): const float* or, for an fp16 cache, const uint16_t*
  };
  std::vector<Item> items;
  int64_t idx = 0;
  for (int64_t r = 0; r < nruns; ++r) {
    const int64_t slot = sp[rows[run_start[r]]];
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const int64_t first = idx;
      for (int64_t i = run_start[r]; i < run_start[r + 1]; ++i) {
        const int64_t m = rows[i];
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h, ++idx) {
          pq[idx] = qp + (m * Hq + h) * D;
          po[idx] = op + (m * Hq + h) * D;
          pa[idx] = a[m];
          pb[idx] = b[m];
          pe[idx] = ne[m] ? ep + m * E : nullptr;
          pne[idx] = ne[m];
        }
      }
      const int64_t base = (slot * Hkv + kvh) * Lmax * D;
      for (int64_t p0 = first; p0 < idx; ++next_item) {
        items.push_back({p0, item_pairs[next_item], kp + base * esize, vp + base * esize});
        p0 += item_pairs[next_item];
      }
    }
  }
  const int64_t lds = (maxn + 16 + 15) / 16 * 16;
  auto run_typed = [&](const Item& it, const auto* K, const auto* V) {
    thread_local Scratch sbuf_mem;
    if (isa != Isa::scalar) {
      float* sbuf = reinterpret_cast<float*>(sbuf_mem.get(size_t(it.np * (lds + D) + 16) * 4));
      const auto item = [&](auto attn_item) {
        attn_item(it.np, pq.data() + it.p0, pa.data() + it.p0, pb.data() + it.p0, pe.data() + it.p0,
                  pne.data() + it.p0, po.data() + it.p0, K, V, D, scale, lds, sbuf);
      };
      using Elem = std::remove_cv_t<std::remove_pointer_t<decltype(K)>>;
      if (at_least(isa, Isa::avx512))
        item(avx512::attn_item<Elem>);
      else
        item(avx2::attn_item<Elem>);
      return;
    }
    float* sbuf = reinterpret_cast<float*>(sbuf_mem.get(size_t(lds + 16) * 4));
    for (int64_t r = it.p0; r < it.p0 + it.np; ++r) {
      if (pne[r])
        attn_tree_row_scalar(pq[r], K, V, pa[r], pb[r], pe[r], pne[r], D, scale, po[r], sbuf);
      else
        attn_row_scalar(pq[r], K, V, pa[r], pb[r], D, scale, po[r], sbuf);
    }
  };
  auto run_item = [&](const Item& it) {
    if (half_kv)
      run_typed(it, static_cast<const uint16_t*>(it.K), static_cast<const uint16_t*>(it.V));
    else
      run_typed(it, static_cast<const float*>(it.K), static_cast<const float*>(it.V));
  };
  const int64_t nitems = int64_t(items.size());
  const int64_t workers = std::min(nth, nitems);
  if (workers <= 1 || at::in_parallel_region() || npairs * maxn * D < (1 << 14)) {
    for (const Item& it : items) run_item(it);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t i = next.fetch_add(1); i < nitems; i = next.fetch_add(1)) run_item(items[i]);
    });
  }
  return out;
}
