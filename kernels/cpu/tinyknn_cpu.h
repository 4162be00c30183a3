// tinyknn CPU library: the extern "C" ABI that tinyknn/cpu/library.py binds with ctypes.
//
// Every function returns a tk_status (0 = success). On failure tk_last_error() returns a message for the
// calling thread; no C++ exception ever crosses this boundary (worker-thread errors included).
// Bump TK_ABI_VERSION whenever a signature or a meaning here changes (library.py checks it).
#pragma once
#include <stdint.h>

#define TK_ABI_VERSION 9  // 8 added the GPU one-query search as one native call; 9 removed it (no faster)

#ifdef __cplusplus
extern "C" {
#endif

enum tk_status { TK_OK = 0, TK_INVALID_ARGUMENT = 1, TK_OUT_OF_MEMORY = 2, TK_INTERNAL = 3 };
enum tk_metric { TK_L2 = 0, TK_INNER_PRODUCT = 1, TK_COSINE = 2 };
enum tk_dtype { TK_FLOAT32 = 0, TK_FLOAT16 = 1, TK_BFLOAT16 = 2, TK_INT8 = 3, TK_UINT8 = 4 };
enum tk_row_copy { TK_ROW_COPY_OFF = 0, TK_ROW_COPY_AUTO = 1, TK_ROW_COPY_ALWAYS = 2 };

typedef struct tk_index tk_index;
typedef struct tk_range tk_range;

int tk_abi_version(void);
// The thread's last error message ("" when none).
const char* tk_last_error(void);
// What this build uses: compiler, vector width, F16C (a short human-readable line).
const char* tk_build_info(void);
// The digest of the sources this build was compiled from (tinyknn/cpu/build.py passes it), "" if none.
const char* tk_sources_digest(void);
// One number of this build's shape, by name (TK_INVALID_ARGUMENT for an unknown name): "lanes",
// "panel_rows", "tile_queries", "sketch_max_queries", "sketch_min_panels", "winograd_min_queries",
// "winograd_min_panels", "winograd_min_dim", "direct_max_queries"; tests size their databases from them. "margin:<k>": the
// rows the screen keeps beyond k (verify.h).
int tk_build_param(const char* name, int64_t* value);
// Runs n_tasks empty tasks on `threads` of the library's pool, task `failing_task` throwing std::bad_alloc
// (TK_OUT_OF_MEMORY, whichever thread ran it): tests check that worker failures come back as statuses.
int tk_pool_selftest(int threads, int n_tasks, int failing_task);

int tk_index_new(int64_t dim, int metric, int dtype, tk_index** out);
int tk_index_free(tk_index* index);
// vectors: n rows of dim elements in the index's dtype (float32; float16 or bfloat16 bits; int8; uint8), C
// order; ids: n int64.
int tk_index_add(tk_index* index, const void* vectors, int64_t n, const int64_t* ids);
int tk_index_reset(tk_index* index);
// Drops rows n_rows and later (0 <= n_rows <= size): what an add that failed part way had added.
int tk_index_truncate(tk_index* index, int64_t n_rows);
int tk_index_size(tk_index* index, int64_t* n);
// Copies the first n rows (n <= size; rows only ever append, so they are a stable snapshot):
// vectors gets n * dim elements of the index's dtype, ids n int64.
int tk_index_export(tk_index* index, int64_t n, void* vectors, int64_t* ids);
// How many searches of this index the float16 sketch screened, and how many it handed back to the
// full scan (see sketch_search.h); for tests and diagnostics.
int tk_index_sketch_counts(tk_index* index, int64_t* answered, int64_t* declined);
// The same for the Winograd pass of many-query float32 l2 searches (see winograd_search.h).
int tk_index_winograd_counts(tk_index* index, int64_t* answered, int64_t* declined);
// Queries whose screened candidates could not be proven and were answered by an exhaustive float64
// pass (verify.h); for tests and diagnostics.
int tk_index_exact_fallbacks(tk_index* index, int64_t* count);
// on = 0: every later search of this index screens with the full float32 scan (no sketch, no Winograd
// pass), the reference those passes are tested and measured against; on = 1 (the default): they are used.
int tk_index_use_first_passes(tk_index* index, int on);
// queries: nq float32 rows of dim; distances (float32) and ids (int64): nq * k each, nearest first,
// padded with id -1 and +inf (-inf for ip and cosine) beyond the index's size. The answer is the
// exactness contract's (kernels/exact.cuh): float64 distances, equal ones by the smaller id.
int tk_index_search(tk_index* index, const float* queries, int64_t nq, int64_t k, int threads,
                    float* distances, int64_t* ids);
// The same over the rows rows[0 .. n_rows) only (row positions, sorted, unique, in [0, size)); the cost
// follows n_rows (they are gathered into a temporary index first, or, for a few queries, read from the row
// copy: tk_index_row_copy).
int tk_index_search_rows(tk_index* index, const float* queries, int64_t nq, int64_t k, int threads,
                         const int64_t* rows, int64_t n_rows, float* distances, int64_t* ids);
// The row-major copy that filtered searches of a few queries read scattered rows from (row_copy.h, direct.h):
// TK_ROW_COPY_AUTO (the default) builds it once filtered searches have lost about its cost without it and
// uses it where it reads less than the gather; TK_ROW_COPY_ALWAYS builds it now (TK_OUT_OF_MEMORY when it
// cannot) and answers every filtered search of up to "direct_max_queries" queries from it; TK_ROW_COPY_OFF
// drops it and never builds it. `threads` build it.
int tk_index_row_copy(tk_index* index, int mode, int threads);
// Rows the copy holds (-1: none), filtered searches answered from it, times it was built.
int tk_index_row_copy_counts(tk_index* index, int64_t* rows, int64_t* searches, int64_t* builds);
// Removes the rows positions[0 .. n) (sorted, unique, in [0, size)) at once: the last live rows move into
// the holes. *n_moved rows moved: from moved_from[j] to moved_to[j] (each array has room for n; both
// ascending). Fails only in its checks, before anything changes.
int tk_index_remove_rows(tk_index* index, const int64_t* positions, int64_t n, int64_t* moved_from,
                         int64_t* moved_to, int64_t* n_moved);
// Reorders the rows: new row i is old row order[i] (order: every position in [0, size) once, n = size). A
// copy of the rows is made first (fails with nothing changed), then swapped in; `threads` gather it.
int tk_index_permute_rows(tk_index* index, const int64_t* order, int64_t n, int threads);
// Copies rows positions[0 .. n) (any order, in [0, size)) into vectors (n * dim elements of the dtype).
int tk_index_get_rows(tk_index* index, const int64_t* positions, int64_t n, void* vectors);
// Every row (rows == NULL) or every row of rows[0 .. n_rows) whose contract float64 distance is strictly
// inside `radius` (l2: below; ip, cosine: above), into a new result (*out): each query's hits ordered by
// (distance, id). Read it with tk_range_counts (nq counts) and tk_range_copy, free it with tk_range_free.
int tk_index_range_search(tk_index* index, const float* queries, int64_t nq, double radius, const int64_t* rows,
                          int64_t n_rows, int threads, tk_range** out);
int tk_range_total(tk_range* range, int64_t* total);
int tk_range_copy(tk_range* range, int64_t* counts, float* distances, int64_t* ids);
int tk_range_free(tk_range* range);

#ifdef __cplusplus
}
#endif
