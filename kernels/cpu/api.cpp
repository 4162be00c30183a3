// The extern "C" boundary: every entry point runs its body inside guarded(), which turns any C++
// exception (including those rethrown from worker threads by ThreadPool) into a status code and a
// thread-local message. Nothing throws across ctypes.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

#include "database.h"
#include "errors.h"
#include "search.h"
#include "tinyknn_cpu.h"

using namespace tinyknn;

struct tk_index {
  std::unique_ptr<AnyIndex> impl;
};

struct tk_range {
  RangeAnswer answer;
};

namespace {

thread_local std::string last_error;

template <class Body>
int guarded(Body&& body) {
  try {
    last_error.clear();
    body();
    return TK_OK;
  } catch (const InvalidArgument& error) {
    last_error = error.what();
    return TK_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
    return TK_OUT_OF_MEMORY;
  } catch (const std::exception& error) {
    last_error = std::string("internal error: ") + error.what();
    return TK_INTERNAL;
  } catch (...) {
    last_error = "internal error: unknown exception";
    return TK_INTERNAL;
  }
}

AnyIndex& open(tk_index* index) {
  require(index != nullptr && index->impl != nullptr, "index handle is null");
  return *index->impl;
}


}  // namespace

extern "C" {

__attribute__((visibility("default"))) int tk_abi_version(void) { return TK_ABI_VERSION; }

__attribute__((visibility("default"))) const char* tk_last_error(void) { return last_error.c_str(); }

__attribute__((visibility("default"))) const char* tk_build_info(void) {
  static const std::string info = std::string("compiler ") + __VERSION__ + "; " + build_features();
  return info.c_str();
}

#ifndef TINYKNN_SOURCES_DIGEST
#define TINYKNN_SOURCES_DIGEST ""
#endif

__attribute__((visibility("default"))) const char* tk_sources_digest(void) { return TINYKNN_SOURCES_DIGEST; }

__attribute__((visibility("default"))) int tk_build_param(const char* name, int64_t* value) {
  return guarded([&] {
    require(name != nullptr && value != nullptr, "a pointer is null");
    const std::string key(name);
    if (key.rfind("margin:", 0) == 0) {
      const int64_t k = std::strtoll(name + 7, nullptr, 10);
      require(k >= 1, "margin:<k> needs k >= 1");
      *value = screen_margin(k);
      return;
    }
    const struct { const char* name; int64_t value; } params[] = {
        {"lanes", kLanes},
        {"panel_rows", kPanel},
        {"tile_queries", kTileQueries},
        {"sketch_max_queries", kSketchMaxQueries},
        {"sketch_min_panels", kSketchMinPanels},
        {"winograd_min_queries", kWinogradMinQueries},
        {"winograd_min_panels", kWinogradMinPanels},
        {"winograd_min_dim", kWinogradMinDim},
        {"direct_max_queries", kDirectMaxQueries},
    };
    for (const auto& param : params) {
      if (key == param.name) {
        *value = param.value;
        return;
      }
    }
    throw InvalidArgument("unknown build parameter: " + key);
  });
}

__attribute__((visibility("default"))) int tk_pool_selftest(int threads, int n_tasks, int failing_task) {
  return guarded([&] {
    require(n_tasks >= 0, "n_tasks must be >= 0");
    ThreadPool::shared().run(n_tasks, threads, [&](int task) {
      if (task == failing_task) throw std::bad_alloc();
    });
  });
}

__attribute__((visibility("default"))) int tk_index_new(int64_t dim, int metric, int dtype, tk_index** out) {
  return guarded([&] {
    require(out != nullptr, "output handle pointer is null");
    *out = nullptr;
    std::unique_ptr<tk_index> index(new tk_index{make_index(dim, metric, dtype)});
    *out = index.release();
  });
}

__attribute__((visibility("default"))) int tk_index_free(tk_index* index) {
  return guarded([&] { delete index; });
}

__attribute__((visibility("default"))) int tk_index_add(tk_index* index, const void* vectors, int64_t n,
                                                        const int64_t* ids) {
  return guarded([&] {
    require(n >= 0, "n must be >= 0");
    require(n == 0 || (vectors != nullptr && ids != nullptr), "vectors or ids pointer is null");
    open(index).add(vectors, n, ids);
  });
}

__attribute__((visibility("default"))) int tk_index_reset(tk_index* index) {
  return guarded([&] { open(index).reset(); });
}

__attribute__((visibility("default"))) int tk_index_truncate(tk_index* index, int64_t n_rows) {
  return guarded([&] { open(index).truncate(n_rows); });
}

__attribute__((visibility("default"))) int tk_index_size(tk_index* index, int64_t* n) {
  return guarded([&] {
    require(n != nullptr, "output pointer is null");
    *n = open(index).size();
  });
}

__attribute__((visibility("default"))) int tk_index_export(tk_index* index, int64_t n, void* vectors,
                                                           int64_t* ids) {
  return guarded([&] {
    require(n >= 0, "n must be >= 0");
    require(n == 0 || (vectors != nullptr && ids != nullptr), "vectors or ids pointer is null");
    open(index).export_to(n, vectors, ids);
  });
}

__attribute__((visibility("default"))) int tk_index_sketch_counts(tk_index* index, int64_t* answered,
                                                                 int64_t* declined) {
  return guarded([&] {
    require(answered != nullptr && declined != nullptr, "output pointer is null");
    open(index).sketch_counts().read(answered, declined);
  });
}

__attribute__((visibility("default"))) int tk_index_winograd_counts(tk_index* index, int64_t* answered,
                                                                   int64_t* declined) {
  return guarded([&] {
    require(answered != nullptr && declined != nullptr, "output pointer is null");
    open(index).winograd_counts().read(answered, declined);
  });
}

__attribute__((visibility("default"))) int tk_index_exact_fallbacks(tk_index* index, int64_t* count) {
  return guarded([&] {
    require(count != nullptr, "output pointer is null");
    *count = open(index).exact_fallbacks();
  });
}

__attribute__((visibility("default"))) int tk_index_use_first_passes(tk_index* index, int on) {
  return guarded([&] { open(index).use_first_passes(on != 0); });
}

__attribute__((visibility("default"))) int tk_index_search(tk_index* index, const float* queries, int64_t nq,
                                                           int64_t k, int threads, float* distances,
                                                           int64_t* ids) {
  return guarded([&] {
    require(nq >= 0, "the number of queries must be >= 0");
    require(k >= 1, "k must be >= 1");
    require(k <= ((int64_t)1 << 40), "k must be <= 2^40");
    require(nq == 0 || (queries != nullptr && distances != nullptr && ids != nullptr), "a pointer is null");
    open(index).search(queries, nq, k, threads < 1 ? 1 : threads, distances, ids);
  });
}

__attribute__((visibility("default"))) int tk_index_search_rows(tk_index* index, const float* queries, int64_t nq,
                                                                int64_t k, int threads, const int64_t* rows,
                                                                int64_t n_rows, float* distances, int64_t* ids) {
  return guarded([&] {
    require(nq >= 0 && n_rows >= 0, "the numbers of queries and rows must be >= 0");
    require(k >= 1 && k <= ((int64_t)1 << 40), "k must be in [1, 2^40]");
    require(nq == 0 || (queries != nullptr && distances != nullptr && ids != nullptr), "a pointer is null");
    require(n_rows == 0 || rows != nullptr, "the rows pointer is null");
    open(index).search_rows(queries, nq, k, threads < 1 ? 1 : threads, rows, n_rows, distances, ids);
  });
}

__attribute__((visibility("default"))) int tk_index_row_copy(tk_index* index, int mode, int threads) {
  return guarded([&] { open(index).set_row_copy(mode, threads < 1 ? 1 : threads); });
}

__attribute__((visibility("default"))) int tk_index_row_copy_counts(tk_index* index, int64_t* rows, int64_t* searches,
                                                                    int64_t* builds) {
  return guarded([&] {
    require(rows != nullptr && searches != nullptr && builds != nullptr, "output pointer is null");
    open(index).row_copy_counts(rows, searches, builds);
  });
}

__attribute__((visibility("default"))) int tk_index_remove_rows(tk_index* index, const int64_t* positions, int64_t n,
                                                                int64_t* moved_from, int64_t* moved_to,
                                                                int64_t* n_moved) {
  return guarded([&] {
    require(n >= 0, "n must be >= 0");
    require(n_moved != nullptr && (n == 0 || (positions != nullptr && moved_from != nullptr && moved_to != nullptr)),
            "a pointer is null");
    *n_moved = open(index).remove_rows(positions, n, moved_from, moved_to);
  });
}

__attribute__((visibility("default"))) int tk_index_permute_rows(tk_index* index, const int64_t* order, int64_t n,
                                                                 int threads) {
  return guarded([&] {
    require(n >= 0, "n must be >= 0");
    require(n == 0 || order != nullptr, "a pointer is null");
    open(index).permute_rows(order, n, threads < 1 ? 1 : threads);
  });
}

__attribute__((visibility("default"))) int tk_index_get_rows(tk_index* index, const int64_t* positions, int64_t n,
                                                             void* vectors) {
  return guarded([&] {
    require(n >= 0, "n must be >= 0");
    require(n == 0 || (positions != nullptr && vectors != nullptr), "a pointer is null");
    open(index).get_rows(positions, n, vectors);
  });
}

__attribute__((visibility("default"))) int tk_index_range_search(tk_index* index, const float* queries, int64_t nq,
                                                                 double radius, const int64_t* rows, int64_t n_rows,
                                                                 int threads, tk_range** out) {
  return guarded([&] {
    require(out != nullptr, "output handle pointer is null");
    *out = nullptr;
    require(nq >= 0 && n_rows >= 0, "the numbers of queries and rows must be >= 0");
    require(nq == 0 || queries != nullptr, "the queries pointer is null");
    require(std::isfinite(radius), "radius must be finite");
    std::unique_ptr<tk_range> range(new tk_range{});
    open(index).range_search(queries, nq, radius, rows, n_rows, threads < 1 ? 1 : threads, range->answer);
    *out = range.release();
  });
}

__attribute__((visibility("default"))) int tk_range_total(tk_range* range, int64_t* total) {
  return guarded([&] {
    require(range != nullptr && total != nullptr, "a pointer is null");
    *total = (int64_t)range->answer.ids.size();
  });
}

__attribute__((visibility("default"))) int tk_range_copy(tk_range* range, int64_t* counts, float* distances,
                                                         int64_t* ids) {
  return guarded([&] {
    require(range != nullptr, "range result handle is null");
    const RangeAnswer& answer = range->answer;
    std::copy(answer.counts.begin(), answer.counts.end(), counts);
    std::copy(answer.distances.begin(), answer.distances.end(), distances);
    std::copy(answer.ids.begin(), answer.ids.end(), ids);
  });
}

__attribute__((visibility("default"))) int tk_range_free(tk_range* range) {
  return guarded([&] { delete range; });
}

}  // extern "C"
