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
#include "ingest.cuh"
#include "scan.cuh"
#include "tiled.cuh"
#include "merge.cuh"
