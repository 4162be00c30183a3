// Probe (bench/probes/single_phases.py): the single-query kernel of kernels/single.cuh copied with phase stamps
// and candidate variants of its fixed cost (the copies of single_kernel's stream loop and verify_query's lines
// are deliberate: stamps go between their lines, and the library's files stay as they are). Rendered after the library's kernels (cuda_source.kernel_source), so
// everything of namespace tinyknn is in scope; nothing of the library is changed. See SINGLE_PHASES.md.
//
// Template switches (each variant keeps the verify step's proof; SINGLE_PHASES.md says why):
//   STAMP  1: thread 0 records %globaltimer and clock64() at the phase boundaries (probe_stamp).
//   SEL    0: the slice's KL best by gather_best (the library's radix select); 1: by warps (probe_warp_best),
//             which also leaves every list sorted by (key, position); 2: by the minima of groups of its keys
//             (bounded_gather; sorted too), gather_best where it cannot.
//   GATHER 0: the tail gathers the KL best of all lists by gather_best; 1: by merging the sorted lists
//             (probe_merge_lists; needs SEL 1); 2: by the lists' minima (merge.cuh's bounded_gather: the KL-th
//             smallest minimum bounds the KL-th smallest key; the entries under it ranked), gather_best where it
//             cannot.
//   SORTW  0: the tail sorts the float64 candidates with the block's bitonic network; 1: with one warp's
//             shuffles (SORT <= 32; the library's choice there since verify.cuh's warp_sort_exact).
//   TAIL   0: the last block to arrive runs the tail; 1: the stream kernel stops after its list and
//             probe_tail_kernel (one block) runs the tail as a second launch; 2: as 0, and each block asks for
//             its list's stored rows in L2 once the list is written (prefetch.global.L2, a hint: the rows the
//             tail reads in float64 are never streamed when the float16 shadow is, so they come from DRAM).
#pragma once

namespace tinyknn {

// Stamp slots: a block's row of PROBE_STAMPS (globaltimer, clock64) pairs.
constexpr int PROBE_STAMPS = 10;
enum ProbePhase {
  PROBE_START = 0,     // entry
  PROBE_QUERY = 1,     // the query in shared memory
  PROBE_STREAMED = 2,  // every row's key in shared memory
  PROBE_LISTED = 3,    // the slice's list written and fenced
  PROBE_ARRIVED = 4,   // the arrival counter answered
  PROBE_COPIED = 5,    // (tail) the lists in shared memory
  PROBE_GATHERED = 6,  // (tail) the KL best of all lists
  PROBE_DISTANCES = 7, // (tail) their float64 distances
  PROBE_SORTED = 8,    // (tail) sorted by (key, id)
  PROBE_DONE = 9,      // (tail) answer, proof and status written
};

template <int STAMP>
TINYKNN_D void probe_stamp(unsigned long long* stamps, int row, int phase) {
  if constexpr (STAMP) {
    if (threadIdx.x == 0) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      const long long clock = clock64();
      stamps[(row * PROBE_STAMPS + phase) * 2] = now;
      stamps[(row * PROBE_STAMPS + phase) * 2 + 1] = (unsigned long long)clock;
    }
  }
}

// (key, position) as one 64-bit value ordered by key, then position; empty entries are ~0 (after everything).
constexpr unsigned long long PROBE_EMPTY = ~0ull;
TINYKNN_D unsigned long long probe_pack(float key, int position) {
  return position < 0 ? PROBE_EMPTY : ((unsigned long long)ordered_bits(key) << 32) | (unsigned)position;
}
// The warp's smallest packed value (two redux.sync: the key bits, then the positions of that key).
TINYKNN_D unsigned long long probe_warp_min(unsigned long long mine) {
  const unsigned high = __reduce_min_sync(FULL_WARP, (unsigned)(mine >> 32));
  const unsigned low = __reduce_min_sync(FULL_WARP, (unsigned)(mine >> 32) == high ? (unsigned)mine : 0xffffffffu);
  return ((unsigned long long)high << 32) | low;
}
TINYKNN_D void probe_unpack(unsigned long long packed, float& key, int& position) {
  key = packed == PROBE_EMPTY ? positive_infinity() : from_ordered_bits((unsigned)(packed >> 32));
  position = packed == PROBE_EMPTY ? -1 : (int)(unsigned)packed;
}

// Warp 0's merge of the WARPS sorted lists of KL in scratch (lane l holds list l's head) into out [0, KL).
template <int KL, int WARPS>
TINYKNN_D void probe_merge_scratch(const unsigned long long* scratch, float* out_keys, int* out_positions) {
  const int lane = threadIdx.x & 31;
  int cursor = 0;
  unsigned long long head = lane < WARPS ? scratch[lane * KL] : PROBE_EMPTY;
  for (int j = 0; j < KL; ++j) {
    const unsigned long long winner = probe_warp_min(head);
    if (head == winner && winner != PROBE_EMPTY) {
      ++cursor;
      head = cursor < KL ? scratch[lane * KL + cursor] : PROBE_EMPTY;
    }
    if (lane == 0) probe_unpack(winner, out_keys[j], out_positions[j]);
  }
}

// The slice's KL best by warps (SEL 1). Level 1: warp w takes the keys [w * chunk, (w + 1) * chunk) into
// registers (PER a lane) and extracts its KL smallest one by one (its lane minimum, the warp minimum, the
// winner drops it) into scratch[w * KL ..]. Level 2: warp 0 merges the WARPS sorted lists the same way, lane l
// holding list l's head. Out: list_keys / list_positions [0, KL), ascending by (key, position), padded with
// (+inf, -1). The same set as gather_best's up to ties at the KL-th key (any of them serves: the slice's
// other rows have keys >= the KL-th, all the verify step's proof uses).
template <int KL, int WARPS, int PER>
TINYKNN_D void probe_warp_best(const float* keys, const int* positions, int count, unsigned long long* scratch,
                               float* list_keys, int* list_positions) {
  static_assert(WARPS <= 32, "probe_warp_best: level 2 holds one list a lane");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = (count + WARPS - 1) / WARPS;
  const int first = warp * chunk, last = min(count, first + chunk);
  unsigned long long held[PER];
#pragma unroll
  for (int r = 0; r < PER; ++r) {
    const int i = first + lane + 32 * r;
    held[r] = i < last ? probe_pack(keys[i], positions[i]) : PROBE_EMPTY;
  }
  for (int j = 0; j < KL; ++j) {
    unsigned long long best = PROBE_EMPTY;
#pragma unroll
    for (int r = 0; r < PER; ++r) best = held[r] < best ? held[r] : best;
    const unsigned long long winner = probe_warp_min(best);
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      if (held[r] == winner) held[r] = PROBE_EMPTY;   // positions are distinct: one entry of one lane
    }
    if (lane == 0) scratch[warp * KL + j] = winner;
  }
  __syncthreads();
  if (warp == 0) probe_merge_scratch<KL, WARPS>(scratch, list_keys, list_positions);
  __syncthreads();
}

// The KL best of n_lists sorted lists (GATHER 1): warp w merges lists [w * per, (w + 1) * per) (lane l the
// lists l, l + 32, .. of them, at most MAXR each) into scratch[w * KL ..]; warp 0 merges those WARPS lists
// into sort_keys / sort_positions [0, KL) (slots [KL, SORT) get (+inf, -1)). Returns the ordered bits of the
// KL-th key, as gather_best does: the KL smallest (key, position) of all entries, so the KL-th key is the
// same one.
template <int KL, int SORT, int WARPS, int MAXR>
TINYKNN_D unsigned probe_merge_lists(const float* keys, const int* positions, int n_lists,
                                     unsigned long long* scratch, float* sort_keys, int* sort_positions) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = (n_lists + WARPS - 1) / WARPS;
  const int first = warp * per, last = min(n_lists, first + per);
  int cursor[MAXR];
  unsigned long long head[MAXR];
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    const int list = first + lane + 32 * r;
    cursor[r] = 0;
    head[r] = list < last ? probe_pack(keys[list * KL], positions[list * KL]) : PROBE_EMPTY;
  }
  for (int j = 0; j < KL; ++j) {
    unsigned long long best = PROBE_EMPTY;
#pragma unroll
    for (int r = 0; r < MAXR; ++r) best = head[r] < best ? head[r] : best;
    const unsigned long long winner = probe_warp_min(best);
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      if (head[r] == winner && winner != PROBE_EMPTY) {
        const int list = first + lane + 32 * r;
        ++cursor[r];
        head[r] = cursor[r] < KL ? probe_pack(keys[list * KL + cursor[r]], positions[list * KL + cursor[r]])
                                 : PROBE_EMPTY;
      }
    }
    if (lane == 0) scratch[warp * KL + j] = winner;
  }
  for (int i = KL + threadIdx.x; i < SORT; i += WARPS * 32) {
    sort_keys[i] = positive_infinity();
    sort_positions[i] = -1;
  }
  __syncthreads();
  if (warp == 0) probe_merge_scratch<KL, WARPS>(scratch, sort_keys, sort_positions);
  __syncthreads();
  return ordered_bits(sort_keys[KL - 1]);
}

// The tail: verify_query (kernels/verify.cuh) for query 0 with stamps, the gather by GATHER and the sort by
// SORTW. Every other line is the library's: the same float64 distances, proof, status and threshold.
template <class Metric, class Bound, class T, int K, int KL, int WARPS, int STAMP, int GATHER, int SORTW>
TINYKNN_D void probe_tail(const float* keys, const int* positions, int n_lists, const long long* __restrict__ ids,
                          float* __restrict__ out_distances, long long* __restrict__ out_ids,
                          const T* __restrict__ data, const float* __restrict__ queries, int row_stride, int dim,
                          const unsigned* __restrict__ row_stats, int* __restrict__ status,
                          double* __restrict__ threshold, float4* shared_space, unsigned long long* scratch,
                          unsigned long long* stamps, int stamp_row) {
  static_assert(K < KL, "verify: the selection must keep more candidates than it returns");
  constexpr int SORT = next_pow2(KL);
  const VerifyShared<KL> v(shared_space);       // verify.cuh's layout
  unsigned long long* exact_keys = v.exact_keys;
  long long* exact_ids = v.exact_ids;
  float* sort_keys = v.sort_keys;
  int* sort_positions = v.sort_positions;
  unsigned* histogram = v.histogram;

  unsigned kl_bits;
  if (GATHER == 1 && n_lists <= WARPS * 32 * 4) {
    kl_bits = probe_merge_lists<KL, SORT, WARPS, 4>(keys, positions, n_lists, scratch, sort_keys, sort_positions);
  } else if (!(GATHER == 2 && bounded_gather<KL, SORT, KL>(keys, positions, n_lists * KL, scratch, sort_keys,
                                                             sort_positions, kl_bits))) {
    kl_bits = gather_best<KL, SORT>(keys, positions, (long long)n_lists * KL, sort_keys, sort_positions, histogram,
                                    histogram + 258);
  }
  probe_stamp<STAMP>(stamps, stamp_row, PROBE_GATHERED);
  const float* query = queries;
  const double qq = verify_query_squares<Metric, Bound>(query, dim, v.query_qq);
  verify_distances<Metric, T, KL, WARPS>(query, sort_positions, ids, data, row_stride, dim, qq, exact_keys, exact_ids);
  __syncthreads();
  probe_stamp<STAMP>(stamps, stamp_row, PROBE_DISTANCES);
  if constexpr (SORTW && SORT <= 32) {
    warp_sort_exact(exact_keys, exact_ids, SORT);     // verify.cuh's
  } else {
    block_sort_exact(exact_keys, exact_ids, sort_positions, SORT);
  }
  probe_stamp<STAMP>(stamps, stamp_row, PROBE_SORTED);
  verify_answer<Metric, Bound, K, WARPS>(0, exact_keys, exact_ids, kl_bits, qq, row_stride, row_stats, out_distances,
                                         out_ids, status, threshold, nullptr);
  __syncthreads();
  probe_stamp<STAMP>(stamps, stamp_row, PROBE_DONE);
}

// The lists into shared memory when they fit (single.cuh's last block does the same inline): keys / positions
// are pointed at the copy.
template <int KL, int WARPS, int CMAX>
TINYKNN_D void probe_copy_lists(int n_lists, float4* shared_space, const float*& keys, const int*& positions) {
  const int total = n_lists * KL;
  if (total > CMAX) return;
  float* copied_keys = reinterpret_cast<float*>(shared_space) + align16(verify_shared_bytes<KL>()) / 4;
  int* copied_positions = reinterpret_cast<int*>(copied_keys + CMAX);
  for (int i = threadIdx.x; i < total; i += WARPS * 32) {
    copied_keys[i] = __ldcg(keys + i);
    copied_positions[i] = __ldcg(positions + i);
  }
  __syncthreads();
  keys = copied_keys;
  positions = copied_positions;
}

// Shared memory beyond the library's layout: the warps' KL best (SEL 1 / GATHER 1), GATHER 2's minima and
// candidates.
template <int KL, int WARPS, int GATHER, int SEL = 0> __host__ __device__ constexpr int probe_scratch_bytes() {
  return (GATHER == 2 || SEL == 2) && BOUNDED_SHARED > WARPS * KL * 8 ? BOUNDED_SHARED : WARPS * KL * 8;
}

// single_kernel (kernels/single.cuh) with the stamps and switches above; its parameters are the library's plus
// `stamps` (a row of PROBE_STAMPS pairs per block; row gridDim.x for probe_tail_kernel).
template <class Metric, class Bound, class T, class S, int DIM, int K, int KL, int G, int WARPS, int RMAX, int UNROLL,
          int CMAX, int SMEM, int STAMP, int SEL, int GATHER, int SORTW, int TAIL>
__global__ void __launch_bounds__(WARPS * 32, 1)
probe_single_kernel(const T* __restrict__ data, const S* __restrict__ scan_rows,
                    const float* __restrict__ data_inv_norms, long long n_data, long long rows_per_slice, const float* __restrict__ queries,
                    const long long* __restrict__ ids, float* out_keys, int* out_positions,
                    float* __restrict__ out_distances, long long* __restrict__ out_ids, unsigned* arrivals,
                    const unsigned* __restrict__ row_stats, int* __restrict__ status, double* __restrict__ threshold,
                    int dim, unsigned long long* stamps) {
  static_assert(GATHER != 1 || SEL, "probe: merging the lists needs them sorted (SEL 1 or 2)");
  using Layout = RowLayout<S, DIM>;
  constexpr int STORED_STRIDE = RowLayout<T, DIM>::STRIDE;
  static_assert(is_pow2(G) && G <= 32, "G (lanes per row) must be a power of two <= 32");
  constexpr int CPL = (Layout::CHUNKS + G - 1) / G;
  constexpr int QROW = G * CPL * Layout::PER_CHUNK;
  constexpr int SORT = next_pow2(KL);
  constexpr int QUERY_BYTES = align16(QROW * 4) + 16;
  constexpr int SLICE_BYTES = QUERY_BYTES + RMAX * 8 + SORT * 8 + MERGE_SHARED_FIXED;
  constexpr int VERIFY_BYTES = align16(verify_shared_bytes<KL>()) + CMAX * 8;
  constexpr int NEED = (SLICE_BYTES > VERIFY_BYTES ? SLICE_BYTES : VERIFY_BYTES) + probe_scratch_bytes<KL, WARPS, GATHER, SEL>();
  constexpr int SCRATCH_AT = SLICE_BYTES > VERIFY_BYTES ? SLICE_BYTES : VERIFY_BYTES;
  static_assert(SMEM >= NEED, "probe_single_kernel: SMEM is smaller than its shared memory layout");
  static_assert(KL <= RMAX, "single_kernel: a slice must be able to hold a whole list");
  constexpr int PER = (RMAX + WARPS * 32 - 1) / (WARPS * 32);
  extern __shared__ float4 shared_space[];
  float* query_s = reinterpret_cast<float*>(shared_space);
  float* query_inv = query_s + align16(QROW * 4) / 4;
  float* row_keys = query_s + QUERY_BYTES / 4;
  int* row_positions = reinterpret_cast<int*>(row_keys + RMAX);
  float* sort_keys = reinterpret_cast<float*>(row_positions + RMAX);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);
  unsigned long long* scratch =
      reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(shared_space) + SCRATCH_AT);
  __shared__ unsigned last_block;
  require_dynamic_smem(NEED);
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_START);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < QROW; i += WARPS * 32) query_s[i] = i < dim ? queries[i] : 0.0f;
  __syncthreads();
  if constexpr (Metric::needs_norms) {
    if (warp == 0) {
      const float inv = warp_inverse_norm(query_s, QROW, lane);
      if (lane == 0) query_inv[0] = inv;
    }
    __syncthreads();
  }
  const float query_inv_q = Metric::needs_norms ? query_inv[0] : 1.0f;
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_QUERY);

  const long long begin = (long long)blockIdx.x * rows_per_slice;
  const long long end = begin + rows_per_slice < n_data ? begin + rows_per_slice : n_data;
  const int count = (int)(end - begin);
  constexpr int ROWS_PER_STEP = 32 / G;
  const int part = lane % G;
  for (int base = (int)begin + warp * ROWS_PER_STEP; base < (int)end; base += UNROLL * WARPS * ROWS_PER_STEP) {
    uint4 raw[UNROLL][CPL];
    float data_inv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int row = base + u * WARPS * ROWS_PER_STEP + lane / G;
      load_row_chunks<S, DIM, G, CPL>(scan_rows, row, row < end, part, raw[u]);
      data_inv[u] = 1.0f;
      if constexpr (Metric::needs_norms) data_inv[u] = row < end ? __ldg(data_inv_norms + row) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int row = base + u * WARPS * ROWS_PER_STEP + lane / G;
      float even = 0.0f, odd = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        accumulate_chunk<Metric, S>(even, odd, raw[u][i], query_s + (part + i * G) * Layout::PER_CHUNK);
      }
      const float sum = sum_over_lanes<G>(even + odd);
      if (row < end && part == 0) {
        row_keys[row - begin] = to_key<Metric>(Metric::finish(sum, query_inv_q, data_inv[u]));
        row_positions[row - begin] = row;
      }
    }
  }
  __syncthreads();
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_STREAMED);

  float* list_keys = out_keys + (long long)blockIdx.x * KL;
  int* list_positions = out_positions + (long long)blockIdx.x * KL;
  unsigned slice_bits;
  if constexpr (SEL == 1) {
    probe_warp_best<KL, WARPS, PER>(row_keys, row_positions, count, scratch, list_keys, list_positions);
  } else if (SEL == 2 && count > KL && bounded_gather<KL, SORT, SLICE_GROUP>(
                 row_keys, row_positions, count, scratch, sort_keys, sort_positions, slice_bits)) {
    for (int j = threadIdx.x; j < KL; j += WARPS * 32) {
      list_keys[j] = sort_keys[j];
      list_positions[j] = sort_positions[j];
    }
  } else if (count > KL) {
    gather_best<KL, SORT>(row_keys, row_positions, count, sort_keys, sort_positions, histogram, histogram + 258);
    for (int j = threadIdx.x; j < KL; j += WARPS * 32) {
      list_keys[j] = sort_keys[j];
      list_positions[j] = sort_positions[j];
    }
  } else {
    for (int j = threadIdx.x; j < KL; j += WARPS * 32) {
      list_keys[j] = j < count ? row_keys[j] : positive_infinity();
      list_positions[j] = j < count ? row_positions[j] : -1;
    }
  }
  if constexpr (TAIL == 2) {  // the list's stored rows into L2 while the other blocks stream (a hint only)
    __syncthreads();          // the list is in global memory, written by other threads of this block
    constexpr int LINES = (STORED_STRIDE * (int)sizeof(T) + 127) / 128;
    for (int i = threadIdx.x; i < KL * LINES; i += WARPS * 32) {
      const int p = list_positions[i / LINES];
      if (p >= 0) {
        const char* line = reinterpret_cast<const char*>(data + (long long)p * STORED_STRIDE) + (i % LINES) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
      }
    }
  }
  if constexpr (TAIL == 1) {     // probe_tail_kernel runs the tail after this launch
    __syncthreads();
    probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_LISTED);
    return;
  }
  __threadfence();
  __syncthreads();
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_LISTED);
  if (threadIdx.x == 0) last_block = atomicInc(arrivals, gridDim.x - 1) == gridDim.x - 1 ? 1u : 0u;
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_ARRIVED);
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  const float* keys = out_keys;
  const int* positions = out_positions;
  probe_copy_lists<KL, WARPS, CMAX>(gridDim.x, shared_space, keys, positions);
  probe_stamp<STAMP>(stamps, blockIdx.x, PROBE_COPIED);
  probe_tail<Metric, Bound, T, K, KL, WARPS, STAMP, GATHER, SORTW>(
      keys, positions, gridDim.x, ids, out_distances, out_ids, data, queries, STORED_STRIDE, dim, row_stats, status,
      threshold, shared_space, scratch, stamps, blockIdx.x);
}

// TAIL 1: the tail as its own launch (one block of WARPS warps) after probe_single_kernel<.., TAIL = 1>.
// Its stamps go to row n_lists (after the stream kernel's blocks).
template <class Metric, class Bound, class T, int DIM, int K, int KL, int WARPS, int CMAX, int SMEM, int STAMP,
          int GATHER, int SORTW>
__global__ void __launch_bounds__(WARPS * 32, 1)
probe_tail_kernel(const float* out_keys, const int* out_positions, int n_lists, const long long* __restrict__ ids,
                  float* __restrict__ out_distances, long long* __restrict__ out_ids, const T* __restrict__ data,
                  const float* __restrict__ queries, const unsigned* __restrict__ row_stats,
                  int* __restrict__ status, double* __restrict__ threshold, int dim, unsigned long long* stamps) {
  constexpr int STORED_STRIDE = RowLayout<T, DIM>::STRIDE;
  constexpr int VERIFY_BYTES = align16(verify_shared_bytes<KL>()) + CMAX * 8;
  static_assert(SMEM >= VERIFY_BYTES + probe_scratch_bytes<KL, WARPS, GATHER>(), "probe_tail_kernel: SMEM too small");
  extern __shared__ float4 shared_space[];
  unsigned long long* scratch =
      reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(shared_space) + VERIFY_BYTES);
  require_dynamic_smem(VERIFY_BYTES + probe_scratch_bytes<KL, WARPS, GATHER>());
  probe_stamp<STAMP>(stamps, n_lists, PROBE_START);
  const float* keys = out_keys;
  const int* positions = out_positions;
  probe_copy_lists<KL, WARPS, CMAX>(n_lists, shared_space, keys, positions);
  probe_stamp<STAMP>(stamps, n_lists, PROBE_COPIED);
  probe_tail<Metric, Bound, T, K, KL, WARPS, STAMP, GATHER, SORTW>(
      keys, positions, n_lists, ids, out_distances, out_ids, data, queries, STORED_STRIDE, dim, row_stats, status,
      threshold, shared_space, scratch, stamps, n_lists);
}

}  // namespace tinyknn
