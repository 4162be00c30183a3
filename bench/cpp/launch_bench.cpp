// The C++ side of bench/launch_overhead.py: the floor that Python launch paths are measured against.
//
// Built on the benchmark machine by bench/cpp/build.sh into liblaunch_bench.so and called through
// ctypes. Everything runs on the calling thread, in the context that thread has current (tinyknn's
// primary context), on kernels and buffers that Python set up, so both sides launch the same thing.
// No C++ exception crosses the C ABI: every function returns a CUresult (0 = success).

#include <cuda.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

using Clock = std::chrono::steady_clock;

double elapsed_ns(Clock::time_point a, Clock::time_point b) {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
}

}  // namespace

extern "C" {

// One kernel launch, fully described (what cuLaunchKernel takes).
struct lb_launch {
    CUfunction function;
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_bytes;
    CUstream stream;
    void** params;
};

// One recorded step of a search, replayed one call at a time.
enum lb_kind {
    LB_LAUNCH = 0, LB_H2D = 1, LB_D2H = 2, LB_SYNC = 3, LB_MEMSET = 4, LB_D2D = 5, LB_GRAPH = 6,
    LB_EVENT_RECORD = 7, LB_EVENT_SYNC = 8, LB_STREAM_WAIT = 9
};

struct lb_op {
    int kind;
    lb_launch launch;        // LB_LAUNCH
    CUdeviceptr device;      // H2D/D2H/MEMSET destination or source; D2D destination
    CUdeviceptr device_src;  // D2D source
    void* host;              // H2D source / D2H destination
    size_t nbytes;
    unsigned int byte_value; // MEMSET
    CUstream stream;         // copies, memset, sync, graph, event record, stream wait
    CUgraphExec graph;       // LB_GRAPH
    CUevent event;           // LB_EVENT_RECORD, LB_EVENT_SYNC, LB_STREAM_WAIT
};

int lb_noop(void) { return 0; }

static inline CUresult launch_one(const lb_launch* l) {
    return cuLaunchKernel(l->function, l->grid[0], l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2],
                          l->shared_bytes, l->stream, l->params, nullptr);
}

// One launch per call, the record prepared once (the C++ analogue of a pre-packed launch).
int lb_launch_record(const lb_launch* l) { return static_cast<int>(launch_one(l)); }

// One launch per call with every argument passed (what a Python wrapper converts per call).
int lb_launch_args(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                   unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void** params) {
    return static_cast<int>(cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, nullptr));
}

// Host time per launch over `bursts` bursts of `per_burst` launches; the stream drains between bursts.
int lb_bursts(const lb_launch* l, int per_burst, int bursts, double* out_ns_per_launch) {
    for (int b = 0; b < bursts; ++b) {
        const auto t0 = Clock::now();
        for (int i = 0; i < per_burst; ++i) {
            const CUresult err = launch_one(l);
            if (err != CUDA_SUCCESS) return static_cast<int>(err);
        }
        const auto t1 = Clock::now();
        const CUresult err = cuStreamSynchronize(l->stream);
        if (err != CUDA_SUCCESS) return static_cast<int>(err);
        out_ns_per_launch[b] = elapsed_ns(t0, t1) / per_burst;
    }
    return 0;
}

// Wall time of `count` back-to-back launches and the final synchronisation (queue-bound rate).
int lb_sustained(const lb_launch* l, long long count, double* out_seconds) {
    const auto t0 = Clock::now();
    for (long long i = 0; i < count; ++i) {
        const CUresult err = launch_one(l);
        if (err != CUDA_SUCCESS) return static_cast<int>(err);
    }
    const CUresult err = cuStreamSynchronize(l->stream);
    if (err != CUDA_SUCCESS) return static_cast<int>(err);
    *out_seconds = elapsed_ns(t0, Clock::now()) * 1e-9;
    return 0;
}

// The same burst measurement for an instantiated graph replayed with cuGraphLaunch.
int lb_graph_bursts(CUgraphExec graph, CUstream stream, int per_burst, int bursts, double* out_ns_per_launch) {
    for (int b = 0; b < bursts; ++b) {
        const auto t0 = Clock::now();
        for (int i = 0; i < per_burst; ++i) {
            const CUresult err = cuGraphLaunch(graph, stream);
            if (err != CUDA_SUCCESS) return static_cast<int>(err);
        }
        const auto t1 = Clock::now();
        const CUresult err = cuStreamSynchronize(stream);
        if (err != CUDA_SUCCESS) return static_cast<int>(err);
        out_ns_per_launch[b] = elapsed_ns(t0, t1) / per_burst;
    }
    return 0;
}

static CUresult run_op(const lb_op* op, double* sync_ns) {
    switch (op->kind) {
        case LB_LAUNCH: return launch_one(&op->launch);
        case LB_H2D: return cuMemcpyHtoDAsync(op->device, op->host, op->nbytes, op->stream);
        case LB_D2H: return cuMemcpyDtoHAsync(op->host, op->device, op->nbytes, op->stream);
        case LB_MEMSET:
            return cuMemsetD8Async(op->device, static_cast<unsigned char>(op->byte_value), op->nbytes, op->stream);
        case LB_D2D: return cuMemcpyDtoDAsync(op->device, op->device_src, op->nbytes, op->stream);
        case LB_GRAPH: return cuGraphLaunch(op->graph, op->stream);
        case LB_EVENT_RECORD: return cuEventRecord(op->event, op->stream);
        case LB_STREAM_WAIT: return cuStreamWaitEvent(op->stream, op->event, 0);
        case LB_SYNC:
        case LB_EVENT_SYNC: {
            const auto t0 = Clock::now();
            const CUresult err = op->kind == LB_SYNC ? cuStreamSynchronize(op->stream) : cuEventSynchronize(op->event);
            *sync_ns += elapsed_ns(t0, Clock::now());
            return err;
        }
        default: return CUDA_ERROR_INVALID_VALUE;
    }
}

// Replay a recorded search `reps` times, one driver call per step. Per rep: total wall time and the
// host time spent issuing (total minus the time blocked in stream synchronisations).
int lb_replay(const lb_op* ops, int n_ops, int reps, double* out_total_ns, double* out_issue_ns) {
    for (int r = 0; r < reps; ++r) {
        double sync_ns = 0.0;
        const auto t0 = Clock::now();
        for (int i = 0; i < n_ops; ++i) {
            const CUresult err = run_op(&ops[i], &sync_ns);
            if (err != CUDA_SUCCESS) return static_cast<int>(err);
        }
        const double total = elapsed_ns(t0, Clock::now());
        out_total_ns[r] = total;
        out_issue_ns[r] = total - sync_ns;
    }
    return 0;
}

// A prepared one-query search as one native call (a probe of what Python could get by handing a repeated
// search to native code): the query copied into the pinned stage, the search's graph launched, the query's
// values checked while it runs (|x| <= max_abs, NaN failing the test: tinyknn's check_values), the wait,
// the results copied from the pinned staging into the caller's arrays. Returns a CUresult, -1 where a value
// is refused (nothing written), -2 where the search could not prove its answer (the caller's slow path).
struct lb_search {
    CUgraphExec graph;
    CUstream stream;
    float* stage;            // pinned, dim floats (the graph copies it to the device)
    const float* distances;  // pinned staging the graph writes: k floats, k int64 ids, one int32 status
    const long long* ids;
    const int* status;
    int dim;
    int k;
    float max_abs;
};

// The search with the query already in the pinned stage (Python's np.copyto put it there, or lb_search_one)
// and the caller's arrays given as addresses Python keeps: no per-call array address (numpy's .ctypes costs
// ~1 us each from Python). The stage's values are checked while the graph runs.
int lb_search_staged(const lb_search* s, float* out_distances, long long* out_ids) {
    CUresult err = cuGraphLaunch(s->graph, s->stream);
    if (err != CUDA_SUCCESS) return static_cast<int>(err);
    bool good = true;
    for (int i = 0; i < s->dim; ++i) good &= std::fabs(s->stage[i]) <= s->max_abs;
    err = cuStreamSynchronize(s->stream);
    if (err != CUDA_SUCCESS) return static_cast<int>(err);
    if (!good) return -1;
    std::memcpy(out_distances, s->distances, sizeof(float) * s->k);
    std::memcpy(out_ids, s->ids, sizeof(long long) * s->k);
    return s->status[0] ? -2 : 0;
}

// lb_search_one: the query copied into the stage first, then the same.
int lb_search_one(const lb_search* s, const float* query, float* out_distances, long long* out_ids) {
    std::memcpy(s->stage, query, sizeof(float) * s->dim);
    return lb_search_staged(s, out_distances, out_ids);
}

}  // extern "C"
