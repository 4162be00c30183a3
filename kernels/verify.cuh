// tinyknn: the verify step that puts every GPU search under the exactness contract (kernels/exact.cuh),
// and the band search that settles what the verify step cannot prove. Part of the GPU kernel templates;
// see search.cuh for how a search uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "merge.cuh"
#include "exact.cuh"

namespace tinyknn {

// ---- rigorous bounds: how far below a float32 key the contract's float64 key of the same row can be ----
// u = 2^-24 (float32 rounding), eta = 2^-150 (the absolute error an operation can add when its result
// underflows: NVRTC keeps subnormals), u64 = 2^-53; gamma(n) = n u / (1 - n u) bounds the relative error
// of a float32 sum of n terms in ANY order (each lane's partial sums, the butterfly, an FMA or not).
// Each kernel's key is a float32 evaluation of the metric over the padded row (n = row_stride terms; the
// zero padding adds exact zeros); the float64 distance (exact.cuh) is within gamma64 of the true value.
// `QueryStats` holds the float64 facts a bound needs about the query; `RowStats` those about the database
// (from the ingest kernel: the largest |x|^2 and the smallest non-zero |x|^2, in float64, rounded outwards).
struct Bounds {
  static TINYKNN_D double gamma(int n) { return n * 5.9604644775390625e-08 / (1.0 - n * 5.9604644775390625e-08); }
  static TINYKNN_D double gamma64(int n) { return n * 1.1102230246251565e-16 / (1.0 - n * 1.1102230246251565e-16); }
  static constexpr double eta = 7.006492321624085e-46;   // 2^-150
};

// The lowest float64 key (nearer is smaller) any row can have whose float32 key is >= `key32`, for keys
// computed by Metric's own kernel (scan / exact tiled). qq: the query's float64 sum of squares.
// max_xx / min_xx: the largest / smallest non-zero float64 |x|^2 of the database.
template <class Metric> struct KeyBound;

template <> struct KeyBound<L2> {
  static constexpr bool uses_qq = false;     // the verify step skips the query's float64 |q|^2 for l2
  // key = sum of (q - x)^2: each term within (1 + u)^3 of its true value (the subtraction and the
  // square), the sum within gamma(n) of the sum of the rounded terms, plus 2n + 4 underflows.
  static TINYKNN_D double lowest(float key32, int n, double, double, double) {
    const double true_lowest = ((double)key32 - (2.0 * n + 4.0) * Bounds::eta) / (1.0 + Bounds::gamma(n + 3));
    return true_lowest * (1.0 - Bounds::gamma64(n + 3));
  }
};

template <> struct KeyBound<InnerProduct> {
  static constexpr bool uses_qq = true;
  // key = -sum of q x: |error| <= gamma(n) sum |q x| + 2 n eta <= gamma(n) |q| |x| + 2 n eta.
  static TINYKNN_D double lowest(float key32, int n, double qq, double max_xx, double) {
    const double scale = sqrt(qq) * sqrt(max_xx) * (1.0 + 1e-15);
    return (double)key32 - Bounds::gamma(n) * scale - 2.0 * n * Bounds::eta - Bounds::gamma64(n + 1) * scale;
  }
};

template <> struct KeyBound<Cosine> {
  static constexpr bool uses_qq = true;
  // key = -(dot * inv_q) * inv_x, inv_q = rsqrtf of the float32 sum of squares (within 2^-22 of its value),
  // inv_x = the float32 rounding of 1 / sqrt(float64 |x|^2). The float32 sums of squares are within
  // gamma(n) s + 2 n eta of s; the dot within gamma(n) |q||x| + 2 n eta. Every relative term is doubled to
  // cover second-order products; a bound that comes out above 1 simply proves nothing.
  static TINYKNN_D double lowest(float key32, int n, double qq, double, double min_xx) {
    if (!(qq > 0.0) || !(min_xx > 0.0)) return -1e300;
    const double g = Bounds::gamma(n), u = 5.9604644775390625e-08;
    const double query_scale = g + 2.0 * n * Bounds::eta / qq + 2.4e-7;      // the float32 inverse norm
    const double relative = 2.0 * (g + 0.5 * query_scale + 2.0 * u + 4.0 * u);
    const double underflow = 4.0 * n * Bounds::eta / (sqrt(qq) * sqrt(min_xx));
    return (double)key32 - relative - underflow - Bounds::gamma64(n + 8);
  }
};

// l2's filter key of large batches (L2Expanded: |x|^2 - 2 q.x in float32, |x|^2 from the ingest's float32
// sum): within E = 2.5 (n + 4) u (|q|^2 + max |x|^2) + (6n + 16) eta of |x - q|^2 - |q|^2 (merge.cuh's
// derivation of the first version, unchanged).
struct FilterKeyBound {
  static constexpr bool uses_qq = true;
  static TINYKNN_D double lowest(float key32, int n, double qq, double max_xx, double) {
    const double u = 5.9604644775390625e-08;
    const double error = 2.5 * (n + 4) * u * (qq * (1.0 + 1e-15) + max_xx) + (6.0 * n + 16.0) * Bounds::eta;
    return ((double)key32 + qq * (1.0 - 1e-15) - error) * (1.0 - Bounds::gamma64(n + 3));
  }
};

// ---- double keys as ordered integers (a <= b exactly when the bits compare so; -0.0 never occurs) ----
TINYKNN_D unsigned long long ordered_bits64(double key) {
  const unsigned long long u = (unsigned long long)__double_as_longlong(key);
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
TINYKNN_D double from_ordered_bits64(unsigned long long u) {
  return __longlong_as_double((long long)((u >> 63) ? (u & 0x7fffffffffffffffull) : ~u));
}
constexpr unsigned long long EMPTY_KEY64 = 0xffffffffffffffffull;   // after every real key (+inf's bits are lower)
constexpr long long EMPTY_ID = 0x7fffffffffffffffll;

// Sorts n (a power of two) (key, id, position) triples in shared memory by (key, id), ascending, with all
// the block's threads (bitonic network). Ends with a __syncthreads().
TINYKNN_D void block_sort_exact(unsigned long long* keys, long long* ids, int* positions, int n) {
  for (int size = 2; size <= n; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int low = 2 * i - (i & (stride - 1));
        const int high = low + stride;
        const bool ascending = (low & size) == 0;
        const unsigned long long a = keys[low], b = keys[high];
        const long long ia = ids[low], ib = ids[high];
        const bool out_of_order = a > b || (a == b && ia > ib);
        if (out_of_order == ascending) {
          keys[low] = b;
          keys[high] = a;
          ids[low] = ib;
          ids[high] = ia;
          const int p = positions[low];
          positions[low] = positions[high];
          positions[high] = p;
        }
      }
      __syncthreads();
    }
  }
}

// The same order for n <= 32 (a power of two) (key, id) pairs, by warp 0 in registers (a bitonic network
// over its lanes): one warp's shuffles instead of the block's 15 synchronised rounds for n = 32 (~2 us of a
// one-query search's last block on the H200, 0.5 us this way). Positions are left as they were. Ends with a
// __syncthreads().
TINYKNN_D void warp_sort_exact(unsigned long long* keys, long long* ids, int n) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    unsigned long long key = lane < n ? keys[lane] : EMPTY_KEY64;
    long long id = lane < n ? ids[lane] : EMPTY_ID;
    for (int size = 2; size <= 32; size *= 2) {
      for (int stride = size / 2; stride > 0; stride /= 2) {
        const unsigned long long other_key = __shfl_xor_sync(FULL_WARP, key, stride);
        const long long other_id = __shfl_xor_sync(FULL_WARP, id, stride);
        const bool mine_first = key < other_key || (key == other_key && id <= other_id);
        const bool keep_smaller = ((lane & stride) == 0) == ((lane & size) == 0);
        if (mine_first != keep_smaller) {
          key = other_key;
          id = other_id;
        }
      }
    }
    if (lane < n) {
      keys[lane] = key;
      ids[lane] = id;
    }
  }
  __syncthreads();
}

// The database's float64 facts for the bounds, kept by the ingest kernel in `row_stats` (4 uints):
// [0] float bits of max |x|^2 rounded up, [1] ~(float bits of min non-zero |x|^2 rounded down) (0: none).
TINYKNN_D double stats_max_xx(const unsigned* row_stats) { return (double)__uint_as_float(__ldg(row_stats)); }
TINYKNN_D double stats_min_xx(const unsigned* row_stats) {
  const unsigned stored = __ldg(row_stats + 1);
  return stored ? (double)__uint_as_float(~stored) : 0.0;
}

// The contract distance (exact.cuh: the same operations in the same order) of a padded stored row read
// in 16-byte chunks, so that one thread keeps several loads in flight.
template <class Metric, class T>
TINYKNN_D double exact_distance_by_chunks(const float* query, const T* row, int dim, double qq) {
  constexpr int N = Chunk<T>::N;
  const uint4* chunks = reinterpret_cast<const uint4*>(row);
  double a = 0.0, b = 0.0;
  const int whole = dim / N;
  constexpr int AHEAD = N > 8 ? 1 : 4;    // chunk loads in flight (16 bytes of 8-bit values are 16 steps already)
#pragma unroll AHEAD
  for (int c = 0; c < whole; ++c) {
    float x[N];
    Chunk<T>::unpack(__ldg(chunks + c), x);
#pragma unroll
    for (int e = 0; e < N; ++e) Exact<Metric>::step(a, b, __ldg(query + c * N + e), (double)x[e]);
  }
  if (whole * N < dim) {
    float x[N];
    Chunk<T>::unpack(__ldg(chunks + whole), x);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (whole * N + e < dim) Exact<Metric>::step(a, b, __ldg(query + whole * N + e), (double)x[e]);
    }
  }
  return Exact<Metric>::finish(a, b, qq);
}

// The same distance by a group of 32 / GROUPS lanes of a warp (GROUPS rows at once, one a group): each lane
// loads one 16-byte chunk of the group's segment of the row (the next segment's load issued before this one's
// chain), then every lane of the group runs the sequential chain over the segment's elements, taken from the
// group's lanes by shuffles in order. `lane`: the lane's place in its group; `row` null: a group with no row
// (it runs on zeros, so that the warp's shuffles stay converged). All of the warp's lanes must call it.
// Why groups: every lane of a group computes the same chain, and a warp instruction costs its 32 lanes
// whatever they compute, so a whole warp on one row spent 32x the float64 work (the conversions to double,
// 16 a clock per SM, bound it: ~50 us of a one-query search on 1M x 768 for 18 candidates).
// Why unrolled: UNROLL chunks' shuffles are independent of the running sums, so they are issued ahead and only
// the chain of additions stays on the critical path. A step past the row's end adds (q, x) = (0, 0): its
// product is +0, and adding +0 leaves every sum the chain can reach unchanged (they start at +0 and so are
// never -0), so the bits are the sequential chain's.
template <class Metric, int GROUPS = 1, class T>
TINYKNN_D double exact_distance_by_warp(const float* query, const T* row, int dim, double qq, int lane) {
  static_assert(GROUPS == 1 || GROUPS == 2 || GROUPS == 4 || GROUPS == 8, "exact_distance_by_warp: 1, 2, 4 or 8 groups");
  constexpr int N = Chunk<T>::N, WIDTH = 32 / GROUPS;
  constexpr int UNROLL = N > 8 ? 2 : (WIDTH < 8 ? WIDTH : 8);
  const uint4* chunks = reinterpret_cast<const uint4*>(row);
  const int n_chunks = (dim + N - 1) / N;
  double a = 0.0, b = 0.0;
  uint4 next = row != nullptr && lane < n_chunks ? __ldg(chunks + lane) : zero_chunk();
  for (int base = 0; base < n_chunks; base += WIDTH) {
    const int mine = base + lane;
    float x[N], qv[N];
    Chunk<T>::unpack(next, x);
    next = row != nullptr && mine + WIDTH < n_chunks ? __ldg(chunks + mine + WIDTH) : zero_chunk();
#pragma unroll
    for (int e = 0; e < N; ++e) qv[e] = mine * N + e < dim ? __ldg(query + mine * N + e) : 0.0f;
    const int count = min(WIDTH, n_chunks - base);
    for (int c0 = 0; c0 < count; c0 += UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int c = c0 + u;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const float xe = __shfl_sync(FULL_WARP, x[e], c & (WIDTH - 1), WIDTH);
          const float qe = __shfl_sync(FULL_WARP, qv[e], c & (WIDTH - 1), WIDTH);
          const bool inside = c < count && (base + c) * N + e < dim;
          Exact<Metric>::step(a, b, inside ? qe : 0.0f, inside ? (double)xe : 0.0);
        }
      }
    }
  }
  return Exact<Metric>::finish(a, b, qq);
}

// ---- verify: one block per query ---------------------------------------------------------------------
// The selection kernel kept KL (> K) candidates per (query, slice) by its float32 key. The KL best of all
// slices are gathered (gather_best), their contract distances computed in float64 (one thread a candidate,
// exact.cuh's operation order), sorted by (float64 key, user id), and the K first written as float32
// distances and ids (padding where there are fewer). status[q] = 0 when the answer is proven: every row
// outside the KL has a float32 key >= the KL-th key A, so a float64 key >= Bound::lowest(A), and that is
// strictly worse than the K-th float64 key (or there were fewer than KL rows: all were candidates).
// Otherwise status[q] = 1 and threshold[q] = the K-th float64 key, which the band search uses (an upper
// bound of the true K-th key: the candidates are real rows).
// exact_squares (exact.cuh: the same sequential chain, so the same bits) by a whole warp: one coalesced
// load per 32 elements instead of one dependent load per element on the verify step's critical path.
TINYKNN_D double exact_squares_by_warp(const float* query, int dim, int lane) {
  double sum = 0.0;
  for (int base = 0; base < dim; base += 32) {
    const float mine = base + lane < dim ? __ldg(query + base + lane) : 0.0f;
    const int count = min(32, dim - base);
    for (int c = 0; c < count; ++c) {
      const double v = (double)__shfl_sync(FULL_WARP, mine, c);
      sum = exact_add(sum, exact_mul(v, v));
    }
  }
  return sum;
}

// TINYKNN_PHASE(i): a probe's stamp of phase i (bench/probes/single_phases.py compiles the library's source with
// it defined: %globaltimer and clock64 into a module global, by thread 0); nothing in the library.
#ifndef TINYKNN_PHASE
#define TINYKNN_PHASE(i)
#endif

// verify_query: the verify step of query q by the whole block (WARPS warps), over that query's n_lists
// lists at keys / positions (KL entries each), with `shared_space` (verify_shared_bytes<KL>() bytes) as scratch.
// Used by verify_kernel (a block per query) and by the single-query kernel's last block (single.cuh).
// bounds (may be null) gets its slot q zeroed for the next search.
// Candidates whose distances one warp computes at once in verify_query (exact_distance_by_warp's groups).
constexpr int VERIFY_GROUPS = 4;
template <int KL> __host__ __device__ constexpr int verify_shared_bytes() { return next_pow2(KL) * (4 + 4 + 8 + 8) + MERGE_SHARED_FIXED + 16; }

// |q|^2 in float64 for verify_query (the same bits as exact_squares), through `slot` (one double of shared
// memory): a dim-long chain on the critical path, so only where the distance (cosine) or the bound reads it
// (l2's distance and its float32 / shadow bounds do not; then 0). Every thread of the block calls it.
template <class Metric, class Bound>
TINYKNN_D double verify_query_squares(const float* query, int dim, double* slot) {
  if constexpr (Metric::needs_norms || Bound::uses_qq) {
    if (threadIdx.x < 32) {
      const double mine = exact_squares_by_warp(query, dim, threadIdx.x);
      if (threadIdx.x == 0) slot[0] = mine;
    }
    __syncthreads();
    return slot[0];
  }
  return 0.0;
}

// verify_query's float64 step: the contract key (ordered bits) and user id of each of the SORT candidates at
// sort_positions into exact_keys / exact_ids ((EMPTY_KEY64, EMPTY_ID) where a position is -1). Every thread of
// the block (WARPS warps) calls it; the caller synchronises before reading the results.
template <class Metric, class T, int KL, int WARPS>
TINYKNN_D void verify_distances(const float* query, const int* sort_positions, const long long* __restrict__ ids,
                                const T* __restrict__ data, int row_stride, int dim, double qq,
                                unsigned long long* exact_keys, long long* exact_ids) {
  constexpr int SORT = next_pow2(KL);
  if constexpr (KL <= 2 * WARPS) {      // a group of lanes per candidate: few of them, latency matters most
    constexpr int GROUPS = VERIFY_GROUPS, WIDTH = 32 / GROUPS;
    const int lane = (threadIdx.x & 31) % WIDTH;
    // the warp's loop is uniform (first), so its lanes stay converged for the groups' shuffles
    for (int first = (threadIdx.x >> 5) * GROUPS; first < SORT; first += WARPS * GROUPS) {
      const int i = first + (threadIdx.x & 31) / WIDTH;
      const int position = i < SORT ? sort_positions[i] : -1;
      if (!__any_sync(FULL_WARP, position >= 0)) {
        if (lane == 0 && i < SORT) {
          exact_keys[i] = EMPTY_KEY64;
          exact_ids[i] = EMPTY_ID;
        }
        continue;
      }
      // the id is loaded before the chain, so that its latency hides under it (after it, it was a round trip more)
      const long long id = lane == 0 && position >= 0 ? __ldg(ids + position) : EMPTY_ID;
      const double distance = exact_distance_by_warp<Metric, GROUPS>(
          query, position >= 0 ? data + (long long)position * row_stride : static_cast<const T*>(nullptr), dim, qq,
          lane);
      if (lane == 0 && i < SORT) {
        exact_keys[i] = position >= 0 ? ordered_bits64(exact_key<Metric>(distance)) : EMPTY_KEY64;
        exact_ids[i] = id;
      }
    }
  } else {                               // a thread per candidate
    for (int i = threadIdx.x; i < SORT; i += WARPS * 32) {
      const int position = sort_positions[i];
      unsigned long long key = EMPTY_KEY64;
      long long id = EMPTY_ID;
      if (position >= 0) {
        id = __ldg(ids + position);     // before the chain (its latency hidden under it)
        key = ordered_bits64(exact_key<Metric>(
            exact_distance_by_chunks<Metric>(query, data + (long long)position * row_stride, dim, qq)));
      }
      exact_keys[i] = key;
      exact_ids[i] = id;
    }
  }
}

// verify_distances with the candidates' rows staged in shared memory (the single-query kernel's last block,
// STAGE = 1): the whole block copies the KL candidates' rows (gather_best leaves [KL, SORT) empty) into
// `stage` in 16-byte chunks, every load issued before any is used, and the query widened to double once into
// `query64`; then one thread a candidate runs the contract's sequential chain from shared memory. In the
// groups of lanes above, the 8 lanes of a group all run their candidate's chain, and their conversions to
// double (16 a clock per SM) bound the step: 15-24 us for 18 candidates of 768 dims (bench/NOTES_SINGLE.md).
// Rows are staged_pitch_words() apart, an odd count, so the threads' reads of one element fall in different
// banks. Needs staged_bytes<KL>(row_stride * sizeof(T), dim) bytes at `stage_space` (16-byte aligned).
// AHEAD: chunks a step of the chain loads before it adds them (one step's loads waited for in full before its
// first addition: with one chunk, ~90 cycles a chunk of 4 float32 elements, 4 of them the additions' own).
TINYKNN_HD constexpr int staged_pitch_words(int row_bytes) { return (row_bytes / 4) | 1; }
template <int KL> TINYKNN_HD constexpr int staged_bytes(int row_bytes, int dim) {
  return align16(dim * 8) + KL * staged_pitch_words(row_bytes) * 4;
}
template <class Metric, class T, int KL, int WARPS, int AHEAD>
TINYKNN_D void verify_distances_staged(const float* query, const int* sort_positions, const long long* __restrict__ ids,
                                       const T* __restrict__ data, int row_stride, int dim, double qq,
                                       unsigned long long* exact_keys, long long* exact_ids, char* stage_space) {
  constexpr int SORT = next_pow2(KL), N = Chunk<T>::N;
  double* query64 = reinterpret_cast<double*>(stage_space);
  unsigned* stage = reinterpret_cast<unsigned*>(stage_space + align16(dim * 8));   // after query64
  const int chunks = row_stride * (int)sizeof(T) / 16;      // rows are padded to whole 16-byte chunks
  const int pitch = staged_pitch_words(row_stride * (int)sizeof(T));
  // STAGE_LOADS chunks a thread in flight before any is stored (one loop iteration a chunk waited for each
  // load in turn: ~7 round trips for 18 rows of 768 floats); a second round only beyond 8 x 512 chunks
  constexpr int STAGE_LOADS = 8;
  const int total = KL * chunks;
  for (int base = threadIdx.x; base < total; base += STAGE_LOADS * WARPS * 32) {
    uint4 raw[STAGE_LOADS];
#pragma unroll
    for (int u = 0; u < STAGE_LOADS; ++u) {
      const int t = base + u * WARPS * 32;
      const int i = t / chunks, c = t - i * chunks;
      const int position = t < total ? sort_positions[i] : -1;
      raw[u] = position >= 0 ? __ldg(reinterpret_cast<const uint4*>(data + (long long)position * row_stride) + c)
                             : zero_chunk();
    }
#pragma unroll
    for (int u = 0; u < STAGE_LOADS; ++u) {
      const int t = base + u * WARPS * 32;
      if (t < total) {
        const int i = t / chunks, c = t - i * chunks;
        unsigned* to = stage + i * pitch + c * 4;
        to[0] = raw[u].x;
        to[1] = raw[u].y;
        to[2] = raw[u].z;
        to[3] = raw[u].w;
      }
    }
  }
  for (int e = threadIdx.x; e < dim; e += 2 * WARPS * 32) {     // two elements a thread in flight
    const int f = e + WARPS * 32;
    const float first = __ldg(query + e), second = f < dim ? __ldg(query + f) : 0.0f;
    query64[e] = (double)first;
    if (f < dim) query64[f] = (double)second;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < SORT; i += WARPS * 32) {
    const int position = i < KL ? sort_positions[i] : -1;
    unsigned long long key = EMPTY_KEY64;
    long long id = EMPTY_ID;
    if (position >= 0) {
      id = __ldg(ids + position);       // before the chain (its latency hidden under it)
      const unsigned* words = stage + i * pitch;
      double a = 0.0, b = 0.0;
      auto add_chunk = [&](int c, uint4 w, bool whole) {     // chunk c's elements, in order, onto the chain
        float x[N];
        Chunk<T>::unpack(w, x);
#pragma unroll
        for (int e = 0; e < N; ++e) {
          if (whole || c * N + e < dim) Exact<Metric>::step_wide(a, b, query64[c * N + e], (double)x[e]);
        }
      };
      auto chunk_words = [&](int c) {
        return make_uint4(words[4 * c], words[4 * c + 1], words[4 * c + 2], words[4 * c + 3]);
      };
      int c = 0;
      if constexpr (AHEAD > 1) {
        for (; c + AHEAD <= dim / N; c += AHEAD) {     // AHEAD whole chunks loaded, then added in order
          uint4 w[AHEAD];
#pragma unroll
          for (int u = 0; u < AHEAD; ++u) w[u] = chunk_words(c + u);
#pragma unroll
          for (int u = 0; u < AHEAD; ++u) add_chunk(c + u, w[u], true);
        }
      }
      for (; c * N < dim; ++c) add_chunk(c, chunk_words(c), false);
      key = ordered_bits64(exact_key<Metric>(Exact<Metric>::finish(a, b, qq)));
    }
    exact_keys[i] = key;
    exact_ids[i] = id;
  }
}

// verify_query's shared memory (shared_space, verify_shared_bytes<KL>() of it): the SORT candidates' float64
// keys and ids, their float32 keys and positions, gather_best's histogram, the query's |q|^2.
template <int KL> struct VerifyShared {
  static constexpr int SORT = next_pow2(KL);
  unsigned long long* exact_keys;
  long long* exact_ids;
  float* sort_keys;
  int* sort_positions;
  unsigned* histogram;
  double* query_qq;
  TINYKNN_D explicit VerifyShared(float4* shared_space)
      : exact_keys(reinterpret_cast<unsigned long long*>(shared_space)),
        exact_ids(reinterpret_cast<long long*>(exact_keys + SORT)),
        sort_keys(reinterpret_cast<float*>(exact_ids + SORT)),
        sort_positions(reinterpret_cast<int*>(sort_keys + SORT)),
        histogram(reinterpret_cast<unsigned*>(sort_positions + SORT)),
        query_qq(reinterpret_cast<double*>(histogram + 260)) {}
};

// verify_query's answer for query q from its sorted float64 candidates: the K first (padded with the empty
// answer) into out_distances / out_ids, and, by thread 0, status[q] (0: proven, the KL-th float32 key's bound
// above the K-th exact key), threshold[q] (that K-th key, the band search's limit when not proven) and
// bounds[q] = 0 (the batch kernels' arrival counter, ready for the next search; null: none).
template <class Metric, class Bound, int K, int WARPS>
TINYKNN_D void verify_answer(long long q, const unsigned long long* exact_keys, const long long* exact_ids,
                             unsigned kl_bits, double qq, int row_stride, const unsigned* __restrict__ row_stats,
                             float* __restrict__ out_distances, long long* __restrict__ out_ids,
                             int* __restrict__ status, double* __restrict__ threshold, unsigned* bounds) {
  for (int j = threadIdx.x; j < K; j += WARPS * 32) {
    const bool real = exact_keys[j] != EMPTY_KEY64;
    const double key = real ? from_ordered_bits64(exact_keys[j]) : 0.0;
    out_distances[q * K + j] = real ? __double2float_rn(Metric::larger_is_better ? -key : key)
                                    : from_key<Metric>(positive_infinity());
    out_ids[q * K + j] = real ? exact_ids[j] : -1;
  }
  if (threadIdx.x == 0) {
    const float kl_key = from_ordered_bits(kl_bits);
    bool proven = !(kl_key < positive_infinity()) || exact_keys[K - 1] == EMPTY_KEY64;
    double kth = 0.0;
    if (!proven) {
      kth = from_ordered_bits64(exact_keys[K - 1]);
      proven = Bound::lowest(kl_key, row_stride, qq, stats_max_xx(row_stats), stats_min_xx(row_stats)) > kth;
    }
    status[q] = proven ? 0 : 1;
    threshold[q] = kth;
    if (bounds != nullptr) bounds[q] = 0u;
  }
}

// bounded_scratch (BOUNDED_SHARED bytes of shared memory, or null): the KL best are gathered by the lists'
// minima (merge.cuh's bounded_gather) where that can, else by gather_best.
// stage_space (null: the groups of lanes, verify_distances): verify_distances_staged's room, where nothing of
// the gather is read any more (single.cuh's copied lists and bounded_scratch may lie under it).
template <class Metric, class Bound, class T, int K, int KL, int WARPS, int AHEAD = 1>
TINYKNN_D void verify_query(long long q, const float* keys, const int* positions, int n_lists,
                            const long long* __restrict__ ids, float* __restrict__ out_distances,
                            long long* __restrict__ out_ids, unsigned* bounds, const T* __restrict__ data,
                            const float* __restrict__ queries, int row_stride, int dim,
                            const unsigned* __restrict__ row_stats, int* __restrict__ status,
                            double* __restrict__ threshold, float4* shared_space,
                            unsigned long long* bounded_scratch = nullptr, char* stage_space = nullptr) {
  static_assert(K < KL, "verify: the selection must keep more candidates than it returns");
  constexpr int SORT = next_pow2(KL);
  const VerifyShared<KL> v(shared_space);
  unsigned long long* exact_keys = v.exact_keys;
  long long* exact_ids = v.exact_ids;
  float* sort_keys = v.sort_keys;
  int* sort_positions = v.sort_positions;
  unsigned* histogram = v.histogram;

  const long long total = (long long)n_lists * KL;
  unsigned kl_bits;
  if (bounded_scratch == nullptr || total > (long long)BOUNDED_MAX_LISTS * KL ||
      !bounded_gather<KL, SORT, KL>(keys, positions, (int)total, bounded_scratch, sort_keys, sort_positions,
                                    kl_bits)) {
    kl_bits = gather_best<KL, SORT>(keys, positions, total, sort_keys, sort_positions, histogram, histogram + 258);
  }
  TINYKNN_PHASE(6);
  const float* query = queries + q * row_stride;
  const double qq = verify_query_squares<Metric, Bound>(query, dim, v.query_qq);
  if (stage_space != nullptr) {
    verify_distances_staged<Metric, T, KL, WARPS, AHEAD>(query, sort_positions, ids, data, row_stride, dim, qq,
                                                         exact_keys, exact_ids, stage_space);
  } else {
    verify_distances<Metric, T, KL, WARPS>(query, sort_positions, ids, data, row_stride, dim, qq, exact_keys, exact_ids);
  }
  __syncthreads();
  TINYKNN_PHASE(7);
  if constexpr (SORT <= 32) {
    warp_sort_exact(exact_keys, exact_ids, SORT);
  } else {
    block_sort_exact(exact_keys, exact_ids, sort_positions, SORT);
  }
  TINYKNN_PHASE(8);
  verify_answer<Metric, Bound, K, WARPS>(q, exact_keys, exact_ids, kl_bits, qq, row_stride, row_stats, out_distances,
                                         out_ids, status, threshold, bounds);
  TINYKNN_PHASE(9);
}

// ---- verify: one block per query ---------------------------------------------------------------------
// The selection kernel kept KL (> K) candidates per (query, slice) by its float32 key. The KL best of all
// slices are gathered (gather_best), their contract distances computed in float64 (one thread a candidate,
// exact.cuh's operation order), sorted by (float64 key, user id), and the K first written as float32
// distances and ids (padding where there are fewer). status[q] = 0 when the answer is proven: every row
// outside the KL has a float32 key >= the KL-th key A, so a float64 key >= Bound::lowest(A), and that is
// strictly worse than the K-th float64 key (or there were fewer than KL rows: all were candidates).
// Otherwise status[q] = 1 and threshold[q] = the K-th float64 key, which the band search uses (an upper
// bound of the true K-th key: the candidates are real rows).
template <class Metric, class Bound, class T, int K, int KL, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
verify_kernel(const float* __restrict__ keys, const int* __restrict__ positions, int n_lists,
              const long long* __restrict__ ids, float* __restrict__ out_distances, long long* __restrict__ out_ids,
              unsigned* __restrict__ bounds, const T* __restrict__ data, const float* __restrict__ queries,
              int row_stride, int dim, const unsigned* __restrict__ row_stats, int* __restrict__ status,
              double* __restrict__ threshold) {
  static_assert(SMEM >= verify_shared_bytes<KL>(), "verify_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  require_dynamic_smem(verify_shared_bytes<KL>());
  const long long q = blockIdx.x, total = (long long)n_lists * KL;
  verify_query<Metric, Bound, T, K, KL, WARPS>(q, keys + q * total, positions + q * total, n_lists, ids,
                                               out_distances, out_ids, bounds, data, queries, row_stride, dim,
                                               row_stats, status, threshold, shared_space);
}

// ---- band: every row whose float64 key is <= a query's threshold ------------------------------------
// For the queries verify could not prove (a list of their indices in `which`): grid (row blocks, queries),
// one thread per row computes the contract distance and, when its key is <= threshold[which[f]], appends
// (key, user id) to the query's band (capacity `capacity`; the count keeps growing past it so the host
// can tell and search again with more room). The host sorts each band by (key, id) and keeps the K first.
template <class Metric, class T>
__global__ void __launch_bounds__(256, 1)
band_kernel(const T* __restrict__ data, const long long* __restrict__ ids, long long n_data, int row_stride, int dim,
            const float* __restrict__ queries, const int* __restrict__ which, const double* __restrict__ threshold,
            int capacity, double* __restrict__ band_keys, long long* __restrict__ band_ids,
            unsigned* __restrict__ counts) {
  __shared__ double query_qq;
  const int f = blockIdx.y;
  const int q = which[f];
  const float* query = queries + (long long)q * row_stride;
  if (threadIdx.x == 0) query_qq = Metric::needs_norms ? exact_squares(query, dim) : 0.0;
  __syncthreads();
  const double limit = threshold[q];
  for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < n_data;
       row += (long long)gridDim.x * blockDim.x) {
    const double key = exact_key<Metric>(exact_distance_by_chunks<Metric>(query, data + row * row_stride, dim, query_qq));
    if (key <= limit) {
      const unsigned slot = atomicAdd(counts + f, 1u);
      if (slot < (unsigned)capacity) {
        band_keys[(long long)f * capacity + slot] = key;
        band_ids[(long long)f * capacity + slot] = __ldg(ids + row);
      }
    }
  }
}

}  // namespace tinyknn
