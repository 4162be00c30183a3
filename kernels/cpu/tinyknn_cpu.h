// tinyknn CPU library: the extern "C" ABI that tinyknn/cpu/library.py binds with ctypes.
//
// Every function returns a tk_status (0 = success). On failure tk_last_error() returns a message for the
// calling thread; no C++ exception ever crosses this boundary (worker-thread errors included).
// Bump TK_ABI_VERSION whenever a signature or a meaning here changes (library.py checks it).
#pragma once
#include <stdint.h>

#define TK_ABI_VERSION 3

#ifdef __cplusplus
extern "C" {
#endif

enum tk_status { TK_OK = 0, TK_INVALID_ARGUMENT = 1, TK_OUT_OF_MEMORY = 2, TK_INTERNAL = 3 };
enum tk_metric { TK_L2 = 0, TK_INNER_PRODUCT = 1, TK_COSINE = 2 };
enum tk_dtype { TK_FLOAT32 = 0, TK_FLOAT16 = 1 };

typedef struct tk_index tk_index;

int tk_abi_version(void);
// The thread's last error message ("" when none).
const char* tk_last_error(void);
// What this build uses: compiler, vector width, F16C (a short human-readable line).
const char* tk_build_info(void);

int tk_index_new(int64_t dim, int metric, int dtype, tk_index** out);
int tk_index_free(tk_index* index);
// vectors: n rows of dim elements in the index's dtype (float32, or float16 bits), C order; ids: n int64.
int tk_index_add(tk_index* index, const void* vectors, int64_t n, const int64_t* ids);
int tk_index_reset(tk_index* index);
int tk_index_size(tk_index* index, int64_t* n);
// Copies the first n rows (n <= size; rows only ever append, so they are a stable snapshot):
// vectors gets n * dim elements of the index's dtype, ids n int64.
int tk_index_export(tk_index* index, int64_t n, void* vectors, int64_t* ids);
// queries: nq float32 rows of dim; distances (float32) and ids (int64): nq * k each, nearest first,
// padded with id -1 and +inf (-inf for ip and cosine) beyond the index's size.
// How many searches of this index the float16 sketch answered, and how many it handed back to the
// exact scan (see sketch_search.h); for tests and diagnostics.
int tk_index_sketch_counts(tk_index* index, int64_t* answered, int64_t* declined);
// The same for the Winograd pass of many-query float32 l2 searches (see winograd_search.h).
int tk_index_winograd_counts(tk_index* index, int64_t* answered, int64_t* declined);
// on = 0: every later search of this index is the full exact scan (no sketch, no Winograd pass), the
// reference those passes are tested and measured against; on = 1 (the default): they are used.
int tk_index_use_first_passes(tk_index* index, int on);
int tk_index_search(tk_index* index, const float* queries, int64_t nq, int64_t k, int threads,
                    float* distances, int64_t* ids);

#ifdef __cplusplus
}
#endif
