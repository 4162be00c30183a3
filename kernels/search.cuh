// tinyknn: the GPU kernel templates. NVRTC instantiates them by name expression (tinyknn/jit/render.py
// chooses every template argument, including the dynamic shared memory SMEM a launch provides; each
// kernel static_asserts that SMEM covers its layout).
//
// A search launches scan_kernel (small batches) or tiled_kernel (large batches), each writing the
// KL = k + margin best (float32 key, position) of every (query, database slice), then verify_kernel,
// which gathers a query's KL best, computes their float64 distances (exact.cuh), sorts them by (distance,
// id), writes the k first and flags the queries its bound does not prove; band_kernel finds every row
// within the k-th float64 distance of those (verify.cuh), which the searcher sorts on the host. One query
// alone takes single_kernel (single.cuh): the same lists and verify step in one launch.
// Output of scan/tiled: keys[(q * n_slices + slice) * KL + j], positions likewise (int32 rows).
// bounds[q] (zeroed before the launch) lets the slices of one query share their k-th best key, so a
// slice skips candidates another slice already beats k times (topk.cuh, read_bound).

#pragma once
#include "ingest.cuh"
#include "scan.cuh"
#include "tiled.cuh"
#include "verify.cuh"
#include "single.cuh"
#include "rows.cuh"
#include "range.cuh"
#include "select.cuh"
#include "screen_steps.cuh"
