// Shared by every kernel: the kernel paths (ISAs) and which one runs, scratch memory, the packed row layout of
// the "vnni" weight layout, and the threading helpers. Only who computes what depends on the threading helpers,
// never how.

constexpr int64_t kGroup = 512;
constexpr int64_t kChunk = 64;

// ---- kernel paths

// The kernel paths, slowest first. Every path performs the same operations in the same order (scalar.h is the
// executable specification), so all give the same bits; a path runs only where the CPU has its instructions.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };
constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512", "amx"};

inline bool cpu_has_avx2() {
#ifdef SPECDEC_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// AVX-VNNI: the 256-bit vpdpbusd, VEX-encoded (the avx2 path's int8 and 4-bit linears use it where present).
// SPECDEC_AVX_VNNI=0 in the environment turns it off (read once per process), so that the tests also run the avx2
// path's plain code on a CPU that has AVX-VNNI.
inline bool cpu_has_avx_vnni() {
#ifdef SPECDEC_X86
  static const bool ok = [] {
    const char* setting = std::getenv("SPECDEC_AVX_VNNI");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    return cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
  }();
  return ok;
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#ifdef SPECDEC_X86
  static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

inline bool cpu_has_amx() {
#ifdef SPECDEC_X86
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    if (!(tile && int8 && cpu_has_avx512())) return false;
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it
    // the first tile instruction raises SIGILL. The permission is per process.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2: return cpu_has_avx2();
    case Isa::avx512: return cpu_has_avx512();
    default: return cpu_has_amx();
  }
}

inline Isa best_isa() {
  for (int i = 3; i > 0; --i)
    if (cpu_supports(Isa(i))) return Isa(i);
  return Isa::scalar;
}

// The path this process runs: the best the CPU has, or the one set_isa chose (SPECDEC_KERNEL_ISA, tests). Read
// once at the top of every entry point, never inside a loop.
inline std::atomic<int>& selected_isa() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}
inline Isa active_isa() { return Isa(selected_isa().load(std::memory_order_relaxed)); }

// Whether path isa runs as the avx2 path's vpdpbusd (VEX) variant, namespace avx2_vnni.
inline bool avx2_vnni_variant(Isa isa) { return isa == Isa::avx2 && cpu_has_avx_vnni(); }

// The rows of the next block when `left` rows remain, in blocks of at most max_rows split as evenly as such blocks
// allow (tiles of 5: 6 rows as 3 + 3, 8 as 4 + 4; tiles of 4: 5 as 3 + 2).
inline int even_block_rows(int64_t left, int max_rows) {
  const int64_t blocks = (left + max_rows - 1) / max_rows;
  return static_cast<int>((left + blocks - 1) / blocks);
}
inline bool at_least(Isa isa, Isa level) { return static_cast<int>(isa) >= static_cast<int>(level); }

// exact fp16 -> fp32 (identical to vcvtph2ps)
inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// --------------------------------------------------------------------------
// thread-local 64-byte aligned scratch

struct Scratch {
  std::unique_ptr<uint8_t[]> mem;
  size_t cap = 0;
  uint8_t* get(size_t bytes) {
    if (bytes + 64 > cap) {
      cap = std::max(bytes + 64, cap * 2);
      mem.reset(new uint8_t[cap]);
    }
    uintptr_t p = reinterpret_cast<uintptr_t>(mem.get());
    return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
  }
};

inline size_t align64(size_t v) { return (v + 63) & ~size_t(63); }

// The units of a row padded to Kp (see the top of the file): unit u covers blocks
// [b0(u), b0(u) + nb(u)), i.e. bytes [32 * b0(u), 32 * (b0(u) + nb(u))) of the packed row.
struct Layout {
  int64_t Kp, G, T, U;
  int tail_nb[3] = {0, 0, 0};
  explicit Layout(int64_t kp) : Kp(kp), G(kp / kGroup), T(0) {
    int64_t rest = (kp % kGroup) / 32;  // tail blocks, even
    for (int nb = 8; nb >= 2; nb /= 2)
      if (rest >= nb) {
        tail_nb[T++] = nb;
        rest -= nb;
      }
    U = G + T;
  }
  int nb(int64_t u) const { return u < G ? 16 : tail_nb[u - G]; }
  int64_t b0(int64_t u) const {
    if (u <= G) return u * 16;
    int64_t b = G * 16;
    for (int64_t t = 0; t < u - G; ++t) b += tail_nb[t];
    return b;
  }
};

constexpr int64_t kParallelRowValues = 8192;
// Runs rows(r0, r1) over [0, R) on the intra-op threads once the call has 2 rows or more and touches at least
// kParallelRowValues values (a prefill, or a verify block's activation; a decode step's row stays on one
// thread). Each row is computed alone, so the split has no influence on the result.
template <class Rows>
void parallel_rows(int64_t R, int64_t values, const Rows& rows) {
  if (values < kParallelRowValues || R < 2) {
    rows(0, R);
  } else {
    at::parallel_for(0, R, 1, rows);
  }
}

// Tiles of tile_bytes handed out in chunks of at least ~48 KiB of work (so that a small call stays on one thread),
// otherwise two chunks per thread: each thread then streams long runs of consecutive weights, which its
// prefetches follow across tiles (eight chunks per thread measured 6-11 % slower per matrix at 1 and 8 rows, and
// 5-13 % slower at 40 and 128 rows, the weights cold: every chunk boundary restarts the stream). A call walked
// once per block of rows (not single_pass: a prefill, a large batch) caps its chunks at ~512 KiB of weights, which
// stay in the cache while every row block uses them (1 MiB measured up to 14 % slower on Qwen-1.5B's attention
// matrices at 128 rows).
inline int64_t chunk_tiles(int64_t tiles, int64_t tile_bytes, int64_t M, bool single_pass) {
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (48 * 1024) / (tile_bytes * std::max<int64_t>(1, M / 2)));
  const int64_t two_per_thread = std::max(grain, (tiles + 2 * nth - 1) / (2 * nth));
  if (single_pass) return two_per_thread;
  return std::min(std::max<int64_t>(1, (512 * 1024) / tile_bytes), two_per_thread);
}

// Runs worker(next) on every intra-op thread (one call when a single worker suffices): each worker takes chunk
// indices from the shared counter until nchunks are taken, so a thread slowed down by other load does not hold
// back the whole call. Which thread computes a chunk has no influence on the result.
template <class Worker>
void run_chunk_workers(int64_t nchunks, const Worker& worker) {
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), nchunks);
  std::atomic<int64_t> next{0};
  if (workers <= 1 || at::in_parallel_region()) {
    worker(next);
  } else {
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(next); });
  }
}

// The threading of the block-quantized linears (q4, q6): weight rows in tiles of 4 of tile_bytes, handed out in
// chunks of tiles (chunk_tiles); each chunk is walked for every block of activation rows (a multiple of 12, so of
// every path's tile rows; ~96 KiB of activations of K values each) while its weights stay in cache:
// block(n0, n1, m0, m1) computes weight rows [n0, n1) x activation rows [m0, m1). Who computes a tile, and with
// which other rows, never changes its result.
template <class Block>
void run_weight_tiles(int64_t N, int64_t M, int64_t K, int64_t tile_bytes, const Block& block) {
  constexpr int64_t kTile = 4;
  const int64_t ntiles = (N + kTile - 1) / kTile;
  const int64_t mb = std::max<int64_t>(12, ((96 * 1024) / K) / 12 * 12);
  const int64_t chunk = chunk_tiles(ntiles, tile_bytes, M, M <= mb);
  const int64_t nchunks = (ntiles + chunk - 1) / chunk;
  run_chunk_workers(nchunks, [&](std::atomic<int64_t>& next) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) {
      const int64_t n0 = c * chunk * kTile, n1 = std::min(N, (c + 1) * chunk * kTile);
      for (int64_t m0 = 0; m0 < M; m0 += mb) block(n0, n1, m0, std::min(M, m0 + mb));
    }
  });
}

// Weight bytes of one K slice of a 4-row tile: a tile wider than this is walked slice by slice, every
// activation row block over one slice before the next, so that the slice stays in L1 while it is reused.
constexpr int64_t kSliceBytes = 8 * 1024;
constexpr int64_t kMaxSlicedRows = 48;  // activation rows of one block on the sliced path (see q8_linear's mb)

// amx layout (linear_amx.h)
constexpr int64_t kAmxRows = 16;    // output rows per weight tile
constexpr int64_t kAmxTile = 512;   // bytes of one (row tile, block) weight tile

// Row tiles [t0, t1) cut into S consecutive runs walked side by side: side_by_side(t) for t[s] = the i-th tile of
// run s, i = 0, 1, ...; then alone(&t) for each tile left over.
template <int S, class SideBySide, class Alone>
inline void walk_row_tiles(int64_t t0, int64_t t1, const SideBySide& side_by_side, const Alone& alone) {
  const int64_t run = (t1 - t0) / S;
  for (int64_t i = 0; i < run; ++i) {
    int64_t t[S];
    for (int s = 0; s < S; ++s) t[s] = t0 + s * run + i;
    side_by_side(t);
  }
  for (int64_t t = t0 + S * run; t < t1; ++t) alone(&t);
}

// Clips the key ranges [a[i], b[i]) of up to 4 pairs to the key block [j0, j1): per pair [lo[i], hi[i]),
// and [c0, c1) the keys all of them share (empty when c0 >= c1).
inline void clip_key_ranges(const int32_t* a, const int32_t* b, int64_t nr, int64_t j0, int64_t j1,
                                   int64_t* lo, int64_t* hi, int64_t& c0, int64_t& c1) {
  c0 = j0;
  c1 = j1;
  for (int64_t i = 0; i < nr; ++i) {
    lo[i] = std::max<int64_t>(a[i], j0);
    hi[i] = std::min<int64_t>(b[i], j1);
    c0 = std::max(c0, lo[i]);
    c1 = std::min(c1, hi[i]);
  }
}

