// tinyknn: the scan kernel (small batches). Part of the GPU kernel templates; see search.cuh for how a search
// uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- scan: small batches. grid (n_slices, ceil(n_queries / QB)), WARPS warps per block ----------
// Each block reads its slice of the database once for QB queries. G lanes share a row (CPL 16-byte
// loads each), so a warp covers 32 / G rows per step; each warp keeps a list per query (WarpLists), and the
// block's warps merge their lists (warp q % WARPS merges query q) before writing them.
// LISTED: only the rows named by `listed_rows` (sorted int32 positions, n_data of them) are read, as in
// single_kernel: the slices split the list and the lists hold the stored rows' positions.
template <class Metric, class T, int DIM, int K, int QB, int G, int WARPS, int SMEM, bool LISTED = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
scan_kernel(const T* __restrict__ data, const float* __restrict__ data_inv_norms, long long n_data,
            long long rows_per_slice, const float* __restrict__ queries, int n_queries, int /*row_stride: STRIDE*/,
            float* __restrict__ out_keys, int* __restrict__ out_positions, unsigned* __restrict__ bounds,
            const int* __restrict__ listed_rows) {
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
    int at = row;       // the stored row: the slice's row itself, or where the list names it
    if constexpr (LISTED) at = valid ? __ldg(listed_rows + row) : 0;
    uint4 raw[CPL];
    load_row_chunks<T, DIM, G, CPL>(data, at, valid, part, raw);
    float data_inv = 1.0f;
    if constexpr (Metric::needs_norms) data_inv = valid ? __ldg(data_inv_norms + at) : 0.0f;
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
    const unsigned changed = lists.offer(keys, at);
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

}  // namespace tinyknn
