// tinyknn native library: a prepared one-query GPU search issued from native code (tinyknn/gpu/native_search.py).
// From Python, each driver call through cuda.bindings and each layer around it costs about what the device's
// own work for a small search does; here the search's captured graph is launched, the query's values are checked
// while the device works, the wait and the copy of the answer happen in one call (ctypes releases the GIL).
// The library does not link CUDA: the driver's cuGraphLaunch and cuStreamSynchronize come as function pointers
// (cuGetProcAddress, in Python), so the same build serves machines with and without a GPU.
#include <cmath>
#include <cstring>

#include "tinyknn_cpu.h"

extern "C" {

__attribute__((visibility("default"))) int tk_gpu_search_one(const tk_gpu_search* s, float* out_distances,
                                                             int64_t* out_ids) {
  if (s == nullptr || s->graph_launch == nullptr || s->stream_synchronize == nullptr) return TK_GPU_INCOMPLETE;
  int err = s->graph_launch(s->graph, s->stream);
  if (err != 0) return err;
  // The contract's check of a float32 query (tinyknn/inputs/validate.py, check_values): finite, |x| <= max_abs.
  // NaN fails every comparison, so `!(|x| <= max_abs)` refuses it as well as infinity and large values.
  bool good = true;
  for (int64_t i = 0; i < s->dim; ++i) good &= std::fabs(s->stage[i]) <= s->max_abs;
  err = s->stream_synchronize(s->stream);
  if (err != 0) return err;
  if (!good) return TK_GPU_REFUSED;
  if (out_distances != nullptr) std::memcpy(out_distances, s->distances, sizeof(float) * (size_t)s->k);
  if (out_ids != nullptr) std::memcpy(out_ids, s->ids, sizeof(int64_t) * (size_t)s->k);
  return s->status[0] != 0 ? TK_GPU_UNPROVEN : 0;
}

}  // extern "C"
