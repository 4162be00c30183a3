// tinyknn: the tiled kernel (large batches). Part of the GPU kernel templates; see search.cuh for how a search
// uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- tiled: large batches. grid (n_slices, ceil(n_queries / BQ)), WARPS warps per block ---------
// The block walks its slice in tiles of BN rows. Each step stages DEPTH dimensions of BQ queries and
// BN rows in shared memory (transposed, loaded one step ahead into registers); warp w computes
// queries [w * TQ, (w + 1) * TQ) against all BN rows, lane l rows [l * TN, (l + 1) * TN): a TQ x TN
// register tile, like a GEMM. So a warp ends a tile holding every candidate of its own queries and
// offers them straight to its per-query lists: no distance tile, no extra barrier.
// LISTED: only the rows named by `listed_rows` (sorted int32 positions, n_data of them) are read: the slices
// and tiles split the list, each thread looks up its rows' positions once a tile, and the lists (which hold
// list entries while the tiles go by) are written as the stored rows' positions.
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

// The dimension only sets how many staging steps a tile takes (a run-time loop anyway), so it is a
// run-time value here: row_stride (elements per padded row, a multiple of 16 bytes) serves every dim.
// REGISTER_LISTS: the warp's TQ lists in registers (when TQ * padded k <= 256) or in shared memory;
// shared lists leave the registers to the tile, which keeps two blocks resident per SM.
template <class Metric, class T, int K, int BQ, int BN, int WARPS, int DEPTH, bool REGISTER_LISTS, int SMEM,
          bool LISTED = false>
__global__ void __launch_bounds__(WARPS * 32, 2)
tiled_kernel(const T* __restrict__ data, const float* __restrict__ data_inv_norms, long long n_data,
             long long rows_per_slice, const float* __restrict__ queries, int n_queries, int row_stride,
             float* __restrict__ out_keys, int* __restrict__ out_positions, unsigned* __restrict__ bounds,
             const int* __restrict__ listed_rows) {
  constexpr int PER_CHUNK = Chunk<T>::N;
  constexpr int THREADS = WARPS * 32;
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

  // What each thread loads per step, fixed for the whole kernel except the step's offsets: no
  // division on the way (the step counters below advance by increments).
  const float* query_rows[Q_LOADS];
  bool query_ok[Q_LOADS];
#pragma unroll
  for (int i = 0; i < Q_LOADS; ++i) {
    const int unit = threadIdx.x + i * THREADS;
    const int q = unit / (DEPTH / 4);
    query_ok[i] = unit < Q_UNITS && q0 + q < n_queries;
    query_rows[i] = queries + (long long)(query_ok[i] ? q0 + q : 0) * row_stride + (unit % (DEPTH / 4)) * 4;
  }
  const uint4* data_chunks = reinterpret_cast<const uint4*>(data);

  float4 q_next[Q_LOADS];
  uint4 x_next[X_LOADS];
  int fetch_at[X_LOADS];          // LISTED: the stored rows of this thread's loads in the tile being fetched
  int fetch_tile = -1;
  auto fetch = [&](int tile, int step) {
    const long long row0 = begin + (long long)tile * BN;
    const int k0 = step * DEPTH;
    if constexpr (LISTED) {
      if (tile != fetch_tile) {
        fetch_tile = tile;
#pragma unroll
        for (int i = 0; i < X_LOADS; ++i) {
          const long long row = row0 + (threadIdx.x + i * THREADS) / X_PER_ROW;
          fetch_at[i] = row < end ? __ldg(listed_rows + row) : 0;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < Q_LOADS; ++i) {
      const int e = k0 + ((threadIdx.x + i * THREADS) % (DEPTH / 4)) * 4;
      const bool ok = query_ok[i] && e < row_stride;
      q_next[i] = ok ? __ldg(reinterpret_cast<const float4*>(query_rows[i] + k0)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int i = 0; i < X_LOADS; ++i) {
      const int unit = threadIdx.x + i * THREADS;
      const long long row = row0 + unit / X_PER_ROW;
      const int c = k0 / PER_CHUNK + unit % X_PER_ROW;
      const bool ok = unit < X_UNITS && row < end && c < chunks;
      const long long at = LISTED ? (long long)fetch_at[i] : row;
      x_next[i] = ok ? __ldg(data_chunks + at * chunks + c) : zero_chunk();
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
  int tile = 0, step = 0, next_tile = 0, next_step = 0;   // the step computed, the step fetched
  auto advance = [&](int& t, int& s) {
    if (++s == steps) {
      s = 0;
      ++t;
    }
  };
  if (total > 0) {
    fetch(0, 0);
    advance(next_tile, next_step);
  }
  for (int it = 0; it < total; ++it) {
    __syncthreads();   // the previous step's reads of the staging area are done
    stage();
    __syncthreads();
    if (it + 1 < total) {
      fetch(next_tile, next_step);
      advance(next_tile, next_step);
    }
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
      const long long row0 = begin + (long long)tile * BN + lane * TN;
      float data_inv[TN];   // inverse norms (cosine) or squared norms (L2Expanded) of the rows
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        data_inv[j] = 1.0f;
        if constexpr (Metric::needs_norms || Metric::squared_row_norms) {
          const long long at = LISTED && row0 + j < end ? __ldg(listed_rows + row0 + j) : row0 + j;
          data_inv[j] = row0 + j < end ? __ldg(data_inv_norms + at) : 0.0f;
        }
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
    advance(tile, step);
  }

#pragma unroll
  for (int t = 0; t < TQ; ++t) {
    const int q = q0 + warp * TQ + t;
    if (q < n_queries) {
      const long long out = ((long long)q * gridDim.x + blockIdx.x) * K;
      lists.store(t, out_keys + out, out_positions + out);
      if constexpr (LISTED) {     // list entries -> stored rows: each lane its own entries, as store wrote them
        for (int j = lane; j < K; j += 32) {
          const int entry = out_positions[out + j];
          if (entry >= 0) out_positions[out + j] = __ldg(listed_rows + entry);
        }
      }
    }
  }
}

}  // namespace tinyknn
