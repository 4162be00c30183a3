// tinyknn: moving whole stored rows on the device (filtered searches gather their rows, remove fills holes
// with the last rows, get copies rows out). Part of the GPU kernel templates; see search.cuh.
#pragma once
#include "distance.cuh"

namespace tinyknn {

// Row i of the output is row from[i] of the input (to == nullptr) or goes to row to[i] of the output:
// its words_per_row 16-byte words of data, and its id and norm where those arrays are given. One warp a
// row. In place (src == dst) is safe when no row is both read and written, as remove's moves guarantee.
__global__ void __launch_bounds__(256, 1)
copy_rows_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int words_per_row,
                 const long long* __restrict__ from, const long long* __restrict__ to, long long count,
                 const long long* __restrict__ src_ids, long long* __restrict__ dst_ids,
                 const float* __restrict__ src_norms, float* __restrict__ dst_norms) {
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < count; i += warps) {
    const long long source = from[i], target = to != nullptr ? to[i] : i;
    for (int w = lane; w < words_per_row; w += 32) {
      dst[target * words_per_row + w] = src[source * words_per_row + w];
    }
    if (lane == 0 && src_ids != nullptr) dst_ids[target] = src_ids[source];
    if (lane == 0 && src_norms != nullptr) dst_norms[target] = src_norms[source];
  }
}

}  // namespace tinyknn
