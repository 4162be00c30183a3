// tinyknn: the GPU kernel templates. NVRTC instantiates them by name expression (tinyknn/jit/render.py
// chooses every template argument, including the dynamic shared memory SMEM a launch provides; each
// kernel static_asserts that SMEM covers its layout).
//
// A search launches scan_kernel (small batches) or tiled_kernel (large batches), each writing the k
// best (key, position) of every (query, database slice), then merge_kernel, which merges the slices
// of a query, sorts, maps positions to user ids and turns keys back into distances.
// Output of scan/tiled: keys[(q * n_slices + slice) * K + j], positions likewise (int32 rows).
// bounds[q] (zeroed before the launch) lets the slices of one query share their k-th best key, so a
// slice skips candidates another slice already beats k times (topk.cuh, read_bound).
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- ingest: any float rows -> the padded storage layout (+ inverse norms, + a bad-value flag) ----
TINYKNN_D void store_as(float& out, float value) { out = value; }
TINYKNN_D void store_as(half_bits& out, float value) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(value)); }
TINYKNN_D void store_as(float& out, double value) { out = (float)value; }
TINYKNN_D void store_as(half_bits& out, double value) { asm("cvt.rn.f16.f64 %0, %1;" : "=h"(out) : "d"(value)); }

// Largest magnitude a stored value may have (same rule as tinyknn/_validate.py): float16's largest
// finite value, or 2^50 so that float32 sums of squares cannot overflow.
template <class T> struct StorageLimit { static constexpr double value = 1125899906842624.0; };
template <> struct StorageLimit<half_bits> { static constexpr double value = 65504.0; };

// One warp per row. src holds n_rows rows of dim elements of float16/32/64 (src_itemsize 2/4/8),
// src_row_stride elements apart. dst gets dst_row_stride (>= dim) elements per row, zero padded.
// status |= 1 when a value is NaN, infinite or beyond StorageLimit. inv_norms may be null.
// Not on the search path, so dim is a run-time value: one kernel per storage type serves every dim.
template <class T>
__global__ void __launch_bounds__(256)
ingest_kernel(const void* __restrict__ src, int src_itemsize, long long src_row_stride, long long n_rows, int dim,
              T* __restrict__ dst, int dst_row_stride, float* __restrict__ inv_norms, int* __restrict__ status) {
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < n_rows; row += warps) {
    float sum_of_squares = 0.0f;
    bool bad = false;
    for (int e = lane; e < dst_row_stride; e += 32) {
      T out;
      store_as(out, 0.0f);
      if (e < dim) {
        const long long at = row * src_row_stride + e;
        double value;
        if (src_itemsize == 8) {
          value = static_cast<const double*>(src)[at];
          store_as(out, value);
        } else if (src_itemsize == 4) {
          const float f = static_cast<const float*>(src)[at];
          value = f;
          store_as(out, f);
        } else {
          const float f = half_to_float(static_cast<const half_bits*>(src)[at]);
          value = f;
          store_as(out, f);
        }
        bad |= !(value <= StorageLimit<T>::value && value >= -StorageLimit<T>::value);  // NaN fails both
      }
      dst[row * dst_row_stride + e] = out;
      const float stored = to_float(out);
      sum_of_squares += stored * stored;
    }
    sum_of_squares = sum_over_lanes<32>(sum_of_squares);
    if (lane == 0 && inv_norms != nullptr) inv_norms[row] = inverse_norm(sum_of_squares);
    if (__any_sync(FULL_WARP, bad) && lane == 0) atomicOr(status, 1);
  }
}

// ---- scan: small batches. grid (n_slices, ceil(n_queries / QB)), WARPS warps per block ----------
// Each block reads its slice of the database once for QB queries. G lanes share a row (CPL 16-byte
// loads each), so a warp covers 32 / G rows per step; each warp keeps a list per query (WarpLists), and the
// block's warps merge their lists (warp q % WARPS merges query q) before writing them.
template <class Metric, class T, int DIM, int K, int QB, int G, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
scan_kernel(const T* __restrict__ data, const float* __restrict__ data_inv_norms, long long n_data,
            long long rows_per_slice, const float* __restrict__ queries, int n_queries, int /*row_stride: STRIDE*/,
            float* __restrict__ out_keys, int* __restrict__ out_positions, unsigned* __restrict__ bounds) {
  using Layout = RowLayout<T, DIM>;
  static_assert(is_pow2(G) && G <= 32, "G (lanes per row) must be a power of two <= 32");
  constexpr int CPL = (Layout::CHUNKS + G - 1) / G;            // chunks per lane
  constexpr int QROW = G * CPL * Layout::PER_CHUNK;           // floats per query row in shared memory
  constexpr int KP = padded_k(K);
  constexpr bool IN_REGISTERS = QB * KP <= 256;
  constexpr int QUERY_BYTES = align16(QB * QROW * 4);
  constexpr int NEED = QUERY_BYTES + align16(QB * 4) + WARPS * QB * KP * 8;
  static_assert(SMEM >= NEED, "scan_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  float* query_s = reinterpret_cast<float*>(shared_space);
  float* query_inv = query_s + QUERY_BYTES / 4;
  float* list_keys = query_inv + align16(QB * 4) / 4;
  int* list_positions = reinterpret_cast<int*>(list_keys + WARPS * QB * KP);
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q0 = blockIdx.y * QB;
  const int queries_here = n_queries - q0 < QB ? n_queries - q0 : QB;
  for (int i = threadIdx.x; i < QB * QROW; i += WARPS * 32) {
    const int q = i / QROW, e = i % QROW;
    query_s[i] = (q0 + q < n_queries && e < Layout::STRIDE) ? queries[(long long)(q0 + q) * Layout::STRIDE + e] : 0.0f;
  }
  __syncthreads();
  if constexpr (Metric::needs_norms) {
    for (int q = warp; q < QB; q += WARPS) {
      const float inv = warp_inverse_norm(query_s + q * QROW, QROW, lane);
      if (lane == 0) query_inv[q] = inv;
    }
    __syncthreads();
  }

  WarpLists<K, QB, IN_REGISTERS> lists;
  lists.init(list_keys + warp * QB * KP, list_positions + warp * QB * KP);

  const long long begin = (long long)blockIdx.x * rows_per_slice;
  const long long end = begin + rows_per_slice < n_data ? begin + rows_per_slice : n_data;
  constexpr int ROWS_PER_STEP = 32 / G;
  const int part = lane % G;
  for (int base = (int)begin + warp * ROWS_PER_STEP; base < (int)end; base += WARPS * ROWS_PER_STEP) {
    const int row = base + lane / G;   // positions are int32: the searcher keeps n_data < 2^31
    const bool valid = row < end;
    const uint4* row_chunks = reinterpret_cast<const uint4*>(data) + (long long)row * Layout::CHUNKS;
    uint4 raw[CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = part + i * G;
      raw[i] = (valid && (CPL * G == Layout::CHUNKS || c < Layout::CHUNKS)) ? __ldg(row_chunks + c) : zero_chunk();
    }
    float data_inv = 1.0f;
    if constexpr (Metric::needs_norms) data_inv = valid ? __ldg(data_inv_norms + row) : 0.0f;
    float bound[QB];   // what the other slices already guarantee for each query (see read_bound)
#pragma unroll
    for (int q = 0; q < QB; ++q) bound[q] = q < queries_here ? read_bound(bounds + q0 + q) : 0.0f;
    float keys[QB][1];
#pragma unroll
    for (int q = 0; q < QB; ++q) {
      keys[q][0] = positive_infinity();
      if (q >= queries_here) continue;     // a last, partial group: no work for absent queries
      float even = 0.0f, odd = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        accumulate_chunk<Metric, T>(even, odd, raw[i], query_s + q * QROW + (part + i * G) * Layout::PER_CHUNK);
      }
      const float sum = sum_over_lanes<G>(even + odd);
      const float query_inv_q = Metric::needs_norms ? query_inv[q] : 1.0f;
      const float key = to_key<Metric>(Metric::finish(sum, query_inv_q, data_inv));
      keys[q][0] = (valid && part == 0 && key < bound[q]) ? key : positive_infinity();
    }
    const unsigned changed = lists.offer(keys, row);
    if (changed) {
#pragma unroll
      for (int q = 0; q < QB; ++q) {
        if ((changed >> q) & 1u) {
          const float threshold = lists.threshold(q);
          if (lane == 0) publish_bound(bounds + q0 + q, threshold);
        }
      }
    }
  }

  // Merge the block's warps: every warp's lists go to shared memory, warp q % WARPS merges query q
  // (register lists into a fresh list; shared lists in place, offering the other warps' lists).
  if constexpr (IN_REGISTERS) {
#pragma unroll
    for (int q = 0; q < QB; ++q) lists.store(q, list_keys + (warp * QB + q) * KP, list_positions + (warp * QB + q) * KP);
  }
  __syncthreads();
  for (int q = warp; q < QB; q += WARPS) {
    const long long out = ((long long)(q0 + q) * gridDim.x + blockIdx.x) * K;
    if constexpr (IN_REGISTERS) {
      WarpLists<K, 1, true> merged;
      merged.init(nullptr, nullptr);
      for (int w = 0; w < WARPS; ++w) merged.offer_stored(0, list_keys + (w * QB + q) * KP, list_positions + (w * QB + q) * KP);
      if (q0 + q < n_queries) merged.store(0, out_keys + out, out_positions + out);
    } else {
      for (int w = 0; w < WARPS; ++w) {
        if (w != warp) lists.offer_stored(q, list_keys + (w * QB + q) * KP, list_positions + (w * QB + q) * KP);
      }
      if (q0 + q < n_queries) lists.store(q, out_keys + out, out_positions + out);
    }
  }
}

// ---- tiled: large batches. grid (n_slices, ceil(n_queries / BQ)), WARPS warps per block ---------
// The block walks its slice in tiles of BN rows. Each step stages DEPTH dimensions of BQ queries and
// BN rows in shared memory (transposed, loaded one step ahead into registers); warp w computes
// queries [w * TQ, (w + 1) * TQ) against all BN rows, lane l rows [l * TN, (l + 1) * TN): a TQ x TN
// register tile, like a GEMM. So a warp ends a tile holding every candidate of its own queries and
// offers them straight to its per-query lists: no distance tile, no extra barrier.
template <int N>
TINYKNN_D void load_shared(const float* from, float (&to)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(from + i);
      to[i] = v.x; to[i + 1] = v.y; to[i + 2] = v.z; to[i + 3] = v.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(from + i);
      to[i] = v.x; to[i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) to[i] = from[i];
  }
}

constexpr int TILED_DEPTH = 16;

// The dimension only sets how many staging steps a tile takes (a run-time loop anyway), so it is a
// run-time value here: row_stride (elements per padded row, a multiple of 16 bytes) serves every dim.
// REGISTER_LISTS: the warp's TQ lists in registers (when TQ * padded k <= 256) or in shared memory;
// shared lists leave the registers to the tile, which keeps two blocks resident per SM.
template <class Metric, class T, int K, int BQ, int BN, int WARPS, bool REGISTER_LISTS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 2)
tiled_kernel(const T* __restrict__ data, const float* __restrict__ data_inv_norms, long long n_data,
             long long rows_per_slice, const float* __restrict__ queries, int n_queries, int row_stride,
             float* __restrict__ out_keys, int* __restrict__ out_positions, unsigned* __restrict__ bounds) {
  constexpr int PER_CHUNK = Chunk<T>::N;
  constexpr int THREADS = WARPS * 32;
  constexpr int DEPTH = TILED_DEPTH;
  constexpr int TN = BN / 32, TQ = BQ / WARPS;
  static_assert(BN % 128 == 0 && BQ % WARPS == 0, "tiled_kernel: BN must be a multiple of 128, BQ of WARPS");
  constexpr int KP = padded_k(K);
  constexpr bool IN_REGISTERS = REGISTER_LISTS;
  static_assert(!REGISTER_LISTS || TQ * KP <= 256, "tiled_kernel: register lists hold at most 256 slots a lane");
  constexpr int QP = BQ + 4, XP = BN + 4;                     // padded shared rows (float4-aligned)
  constexpr int LIST_BYTES = IN_REGISTERS ? 0 : BQ * KP * 8;
  constexpr int STAGE_BYTES = align16(DEPTH * (QP + XP) * 4);
  constexpr int NEED = LIST_BYTES + STAGE_BYTES + align16(BQ * 4);
  static_assert(SMEM >= NEED, "tiled_kernel: SMEM is smaller than its shared memory layout");
  const int steps = (row_stride + DEPTH - 1) / DEPTH;           // staging steps per tile
  const int chunks = row_stride / PER_CHUNK;                    // 16-byte chunks per row
  constexpr int Q_UNITS = BQ * DEPTH / 4;                       // float4 loads of queries per step
  constexpr int X_PER_ROW = DEPTH / PER_CHUNK;                  // 16-byte chunks per row per step
  constexpr int X_UNITS = BN * X_PER_ROW;
  constexpr int Q_LOADS = (Q_UNITS + THREADS - 1) / THREADS, X_LOADS = (X_UNITS + THREADS - 1) / THREADS;
  static_assert(DEPTH % PER_CHUNK == 0, "a step must hold whole chunks");

  extern __shared__ float4 shared_space[];
  float* list_keys = reinterpret_cast<float*>(shared_space);
  int* list_positions = reinterpret_cast<int*>(list_keys + (IN_REGISTERS ? 0 : BQ * KP));
  float* query_s = reinterpret_cast<float*>(shared_space) + LIST_BYTES / 4;   // [DEPTH][QP]
  float* data_s = query_s + DEPTH * QP;                                       // [DEPTH][XP]
  float* query_inv = reinterpret_cast<float*>(shared_space) + (LIST_BYTES + STAGE_BYTES) / 4;
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q0 = blockIdx.y * BQ;
  if constexpr (Metric::needs_norms) {
    for (int q = warp; q < BQ; q += WARPS) {
      float inv = 0.0f;
      if (q0 + q < n_queries) inv = warp_inverse_norm(queries + (long long)(q0 + q) * row_stride, row_stride, lane);
      if (lane == 0) query_inv[q] = inv;
    }
  }

  WarpLists<K, TQ, IN_REGISTERS> lists;
  lists.init(list_keys + warp * TQ * KP, list_positions + warp * TQ * KP);

  const long long begin = (long long)blockIdx.x * rows_per_slice;
  const long long end = begin + rows_per_slice < n_data ? begin + rows_per_slice : n_data;
  const int tiles = end > begin ? (int)((end - begin + BN - 1) / BN) : 0;
  const int total = tiles * steps;

  float4 q_next[Q_LOADS];
  uint4 x_next[X_LOADS];
  auto fetch = [&](int it) {
    const long long row0 = begin + (long long)(it / steps) * BN;
    const int k0 = (it % steps) * DEPTH;
#pragma unroll
    for (int i = 0; i < Q_LOADS; ++i) {
      const int unit = threadIdx.x + i * THREADS;
      const int q = unit / (DEPTH / 4), e = k0 + (unit % (DEPTH / 4)) * 4;
      const bool ok = unit < Q_UNITS && q0 + q < n_queries && e < row_stride;
      q_next[i] = ok ? __ldg(reinterpret_cast<const float4*>(queries + (long long)(q0 + q) * row_stride + e))
                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int i = 0; i < X_LOADS; ++i) {
      const int unit = threadIdx.x + i * THREADS;
      const long long row = row0 + unit / X_PER_ROW;
      const int c = k0 / PER_CHUNK + unit % X_PER_ROW;
      const bool ok = unit < X_UNITS && row < end && c < chunks;
      x_next[i] = ok ? __ldg(reinterpret_cast<const uint4*>(data) + row * chunks + c) : zero_chunk();
    }
  };
  auto stage = [&]() {
#pragma unroll
    for (int i = 0; i < Q_LOADS; ++i) {
      const int unit = threadIdx.x + i * THREADS;
      if (unit < Q_UNITS) {
        const int q = unit / (DEPTH / 4), e = (unit % (DEPTH / 4)) * 4;
        query_s[(e + 0) * QP + q] = q_next[i].x;
        query_s[(e + 1) * QP + q] = q_next[i].y;
        query_s[(e + 2) * QP + q] = q_next[i].z;
        query_s[(e + 3) * QP + q] = q_next[i].w;
      }
    }
#pragma unroll
    for (int i = 0; i < X_LOADS; ++i) {
      const int unit = threadIdx.x + i * THREADS;
      if (unit < X_UNITS) {
        const int r = unit / X_PER_ROW, e = (unit % X_PER_ROW) * PER_CHUNK;
        float x[Chunk<T>::N];
        Chunk<T>::unpack(x_next[i], x);
#pragma unroll
        for (int j = 0; j < Chunk<T>::N; ++j) data_s[(e + j) * XP + r] = x[j];
      }
    }
  };

  float acc[TQ][TN];
  float bound[TQ];   // read when a tile starts, used when it ends (see read_bound)
  if (total > 0) fetch(0);
  for (int it = 0; it < total; ++it) {
    __syncthreads();   // the previous step's reads of the staging area are done
    stage();
    __syncthreads();
    if (it + 1 < total) fetch(it + 1);
    const int step = it % steps;
    if (step == 0) {
#pragma unroll
      for (int t = 0; t < TQ; ++t) {
        const int q = q0 + warp * TQ + t;
        bound[t] = q < n_queries ? read_bound(bounds + q) : 0.0f;
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[t][j] = 0.0f;
      }
    }
#pragma unroll
    for (int e = 0; e < DEPTH; ++e) {
      float qv[TQ], xv[TN];
      load_shared(query_s + e * QP + warp * TQ, qv);
      load_shared(data_s + e * XP + lane * TN, xv);
#pragma unroll
      for (int t = 0; t < TQ; ++t)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[t][j] = Metric::accumulate(acc[t][j], qv[t], xv[j]);
    }
    if (step == steps - 1) {
      const long long row0 = begin + (long long)(it / steps) * BN + lane * TN;
      float data_inv[TN];
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        data_inv[j] = 1.0f;
        if constexpr (Metric::needs_norms) data_inv[j] = row0 + j < end ? __ldg(data_inv_norms + row0 + j) : 0.0f;
      }
#pragma unroll
      for (int t = 0; t < TQ; ++t) {                    // the accumulators become the keys, in place
        const float query_inv_t = Metric::needs_norms ? query_inv[warp * TQ + t] : 1.0f;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const float key = to_key<Metric>(Metric::finish(acc[t][j], query_inv_t, data_inv[j]));
          acc[t][j] = row0 + j < end && key < bound[t] ? key : positive_infinity();
        }
      }
      const unsigned changed = lists.offer(acc, (int)row0);
      if (changed) {
#pragma unroll
        for (int t = 0; t < TQ; ++t) {
          const int q = q0 + warp * TQ + t;
          if (((changed >> t) & 1u) && q < n_queries) {
            const float threshold = lists.threshold(t);
            if (lane == 0) publish_bound(bounds + q, threshold);
          }
        }
      }
    }
  }

#pragma unroll
  for (int t = 0; t < TQ; ++t) {
    const int q = q0 + warp * TQ + t;
    if (q < n_queries) {
      const long long out = ((long long)q * gridDim.x + blockIdx.x) * K;
      lists.store(t, out_keys + out, out_positions + out);
    }
  }
}

// ---- merge: one block per query -------------------------------------------------------------
// The query's n_lists lists of K hold n_lists * K candidates (empty entries are (+inf, -1)). A radix
// select finds the K-th smallest key, the K winners are gathered (ties at the K-th key taken in any
// order), sorted nearest first, and written as distances and user ids (ids[position]); empty
// entries become (-1, +inf for l2 / -inf for ip and cosine). No serial insertion: the cost is a few
// passes over the candidates, whatever K.
__host__ __device__ constexpr int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

template <class Metric, int K, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
merge_kernel(const float* __restrict__ keys, const int* __restrict__ positions, int n_lists,
             const long long* __restrict__ ids, float* __restrict__ out_distances, long long* __restrict__ out_ids) {
  constexpr int THREADS = WARPS * 32;
  constexpr int SORT = next_pow2(K < 2 ? 2 : K);
  constexpr int NEED = SORT * 8 + (256 + 4) * 4;
  static_assert(SMEM >= NEED, "merge_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  float* sort_keys = reinterpret_cast<float*>(shared_space);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);   // 256 bins + 2 results
  unsigned* taken = histogram + 258;                                           // [0] below, [1] ties
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long q = blockIdx.x;
  const long long total = (long long)n_lists * K;
  const float* my_keys = keys + q * total;
  const int* my_positions = positions + q * total;

  int ties;
  const unsigned kth = block_select(my_keys, total, K, histogram, ties);
  if (threadIdx.x < 2) taken[threadIdx.x] = 0;
  for (int i = K + threadIdx.x; i < SORT; i += THREADS) {
    sort_keys[i] = positive_infinity();
    sort_positions[i] = -1;
  }
  __syncthreads();
  // Gather: keys below the K-th go to [0, K - ties), keys equal to it to [K - ties, K) while room lasts.
  const unsigned lanes_below = (1u << lane) - 1;
  for (long long base = (long long)warp * 32; base < total; base += THREADS) {
    const long long i = base + lane;
    const unsigned u = i < total ? ordered_bits(my_keys[i]) : 0xffffffffu;
    const bool below = i < total && u < kth, equal = i < total && u == kth;
    const unsigned below_mask = __ballot_sync(FULL_WARP, below), equal_mask = __ballot_sync(FULL_WARP, equal);
    unsigned below_base = 0, equal_base = 0;
    if (lane == 0) {
      if (below_mask) below_base = atomicAdd(&taken[0], (unsigned)__popc(below_mask));
      if (equal_mask) equal_base = atomicAdd(&taken[1], (unsigned)__popc(equal_mask));
    }
    below_base = __shfl_sync(FULL_WARP, below_base, 0);
    equal_base = __shfl_sync(FULL_WARP, equal_base, 0);
    int slot = -1;
    if (below) slot = (int)(below_base + __popc(below_mask & lanes_below));
    if (equal) {
      const int e = (int)(equal_base + __popc(equal_mask & lanes_below));
      if (e < ties) slot = K - ties + e;
    }
    if (slot >= 0) {
      sort_keys[slot] = my_keys[i];
      sort_positions[slot] = my_positions[i];
    }
  }
  __syncthreads();
  block_sort(sort_keys, sort_positions, SORT);
  for (int j = threadIdx.x; j < K; j += THREADS) {
    const int position = sort_positions[j];
    out_distances[q * K + j] = from_key<Metric>(sort_keys[j]);
    out_ids[q * K + j] = position >= 0 ? ids[position] : -1;
  }
}

}  // namespace tinyknn
