// tinyknn: the tensor-core screen. Products of rounded inputs on the tensor cores (mma.sync, sm_80 and
// later), compared against a per-query threshold under a rigorous error bound, so that every row whose
// exact distance could be within the threshold survives; the survivors are verified exactly elsewhere.
// No distance matrix goes to global memory.
//
// ---- Layout -----------------------------------------------------------------------------------
// Rows (database) and queries are the same element type, row-major, each row padded with zeros to
// row_bytes, a multiple of 16 bytes (tinyknn's storage layout; the kernel reads 16-byte chunks with
// cp.async and zero-fills the chunks past row_bytes up to the next BKB bytes, so zero padding to the
// MMA K step (32 bytes: 16 fp16/bf16 or 32 int8 elements) is NOT required of the caller).
// The element type only changes the mma instruction: fp16 and bf16 use m16n8k16 (f32 accumulate),
// int8 / uint8 m16n8k32 (s32 accumulate); both consume 32 bytes of K per instruction with the same
// fragment byte layout, so the staging, ldmatrix and epilogue are shared.
//
// Grid: one block per (query tile of BQ, row tile of BN), linearised with the query tile fastest
// (blockIdx.x = row_tile * n_query_tiles + query_tile), so the blocks that read one row tile run at
// the same time and the database streams from HBM about once (the other query tiles hit L2).
// Block: WARPS_Q x WARPS_N warps; warp (wq, wn) computes queries [wq * BQ/WARPS_Q, ...) against rows
// [wn * BN/WARPS_N, ...) as MT x NT mma tiles (16 queries x 8 rows each).
// Staging: STAGES-deep cp.async ring of BKB bytes of K per stage for BQ queries and BN rows, one
// barrier per stage; shared rows are padded by 16 bytes (pitch BKB + 16), which makes both the
// cp.async stores and the 8-row ldmatrix reads bank-conflict free.
//
// ---- How mma.sync rounds, and the bound (bench/NOTES_SCREEN.md derives it in full) --------------
// * fp16 x fp16 and bf16 x bf16 products are exact in fp32 (11 + 11 and 8 + 8 significand bits <= 24).
// * Accumulation is in fp32 but NOT round-to-nearest: the products of one instruction and the
//   accumulator are aligned to the largest exponent and truncated, and the sum is normalised with
//   truncation (Volta..Hopper measurements; the block size, 4, 8 or 16 products, differs by chip).
//   We model each instruction as at most 32 truncations, each losing < 2^-23 of the largest magnitude
//   involved, so one instruction errs by at most 2^-18 (|c| + sum |p|). Over n = ceil(dim / 16)
//   instructions the dot product errs by at most  g = n 2^-18 (1 + n 2^-18) sum_i |q~_i x~_i|
//   <= g |q~| |x~|  (Cauchy-Schwarz). Subnormal products/accumulators flushed: < 2^-126 each.
// * Inputs: the query is rounded to the 16-bit type, |q_i - q~_i| <= u |q_i| + a (fp16: u = 2^-11,
//   a = 2^-25; bf16: u = 2^-8, a = 2^-134); a float32 database read through a 16-bit shadow x~ adds
//   |q . (x - x~)| <= |q| (u |x| + a sqrt(dim)).
// * So |key(q, x) - computed key| <= e_q * r_x + f_q, with r_x >= max(|x|, |x~|) per row and e_q,
//   f_q per query (l2 carries a factor 2: key = |x|^2 - 2 q.x). The host computes e_q, f_q (rounded
//   up) and passes them; the kernel only evaluates  lower = key~ - (e_q r_x + f_q)  with directed
//   rounding (fma.rm / fma.rp / add.rm), so the float32 arithmetic of the epilogue loses nothing.
// * int8 / uint8: products and sums are exact in s32; only the conversion to float32 rounds, and it
//   is done downward / upward as each bound needs (e_q = f_q = 0 is then rigorous).
//
// ---- Modes (template bool THRESHOLD) ---------------------------------------------------------
// screen (false):   l2 key = |x|^2 - 2 q.x (sq_norms: a LOWER bound of |x|^2 per row), ip key = -q.x.
//                   Row r survives query q unless  lower(q, r) > thresholds[q]  (key units; NaN
//                   survives). Survivors: counts[q] += 1 (atomic), survivors[q * capacity + slot] =
//                   r for slot < capacity; past capacity the count still grows, so the host sees
//                   the overflow (counts[q] > capacity) and falls back for that query.
// threshold (true): upper(q, r) = key~ + (e_q r_x + f_q), rounded up (sq_norms: an UPPER bound of
//                   |x|^2). Each block writes, per query, the K smallest upper bounds of its BN rows
//                   (ascending, +inf past its rows) to out_upper[(q * n_row_tiles + row_tile) * K + j].
//                   K (KT, render_screen.threshold_keep) may be below the search's k: the k-th smallest
//                   of any k or more of these values bounds the true k-th key from above, since they
//                   are upper bounds of k distinct rows' keys (each tile's bounds are of its own rows,
//                   one each), all within it. Keeping fewer per tile only loosens T when a tile holds
//                   more than K of the sample's k best (bench/NOTES_SCREEN.md, "Fewer bounds per tile").
// Rows are logical r in [0, n_rows), read from physical row r * row_step (a strided sample when
// row_step > 1); sq_norms and row_norms are indexed by the physical row; survivors hold r. Row tile t
// holds rows t BN .. t BN + BN - 1 in screen mode; in threshold mode rows t, t + n_rtiles, t + 2 n_rtiles,
// ...: rows stored near each other (a cluster inserted at once) spread over many tiles, so a tile rarely
// holds more than K of a query's best (sample_row).
#pragma once
// topk.cuh brings distance.cuh (TINYKNN_D, require_dynamic_smem) and ordered_bits.
#include "topk.cuh"

namespace tinyknn {

// ---- element types and their mma instruction -------------------------------------------------
struct ScreenF16 {};
struct ScreenBF16 {};
struct ScreenS8 {};
struct ScreenU8 {};

template <class E> struct ScreenMma;

template <> struct ScreenMma<ScreenF16> {
  typedef float Acc;
  TINYKNN_D static void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  TINYKNN_D static float low(float c) { return c; }
  TINYKNN_D static float high(float c) { return c; }
};

template <> struct ScreenMma<ScreenBF16> {
  typedef float Acc;
  TINYKNN_D static void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  TINYKNN_D static float low(float c) { return c; }
  TINYKNN_D static float high(float c) { return c; }
};

// int32 sums -> float32 rounded down / up (exact below 2^24 in magnitude).
TINYKNN_D float s32_to_float_rd(int c) { float f; asm("cvt.rm.f32.s32 %0, %1;" : "=f"(f) : "r"(c)); return f; }
TINYKNN_D float s32_to_float_ru(int c) { float f; asm("cvt.rp.f32.s32 %0, %1;" : "=f"(f) : "r"(c)); return f; }

template <> struct ScreenMma<ScreenS8> {
  typedef int Acc;
  TINYKNN_D static void mma(int (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  TINYKNN_D static float low(int c) { return s32_to_float_rd(c); }
  TINYKNN_D static float high(int c) { return s32_to_float_ru(c); }
};

template <> struct ScreenMma<ScreenU8> {
  typedef int Acc;
  TINYKNN_D static void mma(int (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  TINYKNN_D static float low(int c) { return s32_to_float_rd(c); }
  TINYKNN_D static float high(int c) { return s32_to_float_ru(c); }
};

// ---- directed-rounding float32 arithmetic (PTX; independent of compiler flags) -------------------
TINYKNN_D float fma_down(float a, float b, float c) { float d; asm("fma.rm.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d; }
TINYKNN_D float fma_up(float a, float b, float c) { float d; asm("fma.rp.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d; }
TINYKNN_D float sub_down(float a, float b) { float d; asm("sub.rm.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
TINYKNN_D float add_up(float a, float b) { float d; asm("add.rp.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }

// ---- staging: cp.async and ldmatrix ---------------------------------------------------------
TINYKNN_D unsigned shared_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared; bytes = 0 writes zeros (padding, rows or queries past the end).
TINYKNN_D void copy_async16(unsigned to, const void* from, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(to), "l"(from), "r"(bytes) : "memory");
}
TINYKNN_D void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
TINYKNN_D void copy_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }

TINYKNN_D void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

TINYKNN_D unsigned load_shared_u32(const unsigned char* p) { return *reinterpret_cast<const unsigned*>(p); }

// Threshold mode: per query ql < BQ (q0 + ql < n_queries) the K smallest of its BN upper bounds
// (upper[ql * pitch + ...]), ascending, to out[(q0 + ql) * query_stride + j], by K rounds of a warp
// argmin (slot index breaks ties, so each value is taken once). Warp w serves queries w, w + WARPS, ...
template <int K, int BN, int WARPS>
TINYKNN_D void select_smallest(const float* upper, int pitch, int q0, int n_queries, int BQ, float* out,
                               long long query_stride) {
  constexpr int V = BN / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int ql = warp; ql < BQ && q0 + ql < n_queries; ql += WARPS) {
    float u[V];
#pragma unroll
    for (int v = 0; v < V; ++v) u[v] = upper[ql * pitch + lane + 32 * v];
    float* to = out + (long long)(q0 + ql) * query_stride;
#pragma unroll 1
    for (int j = 0; j < K; ++j) {
      float best = u[0];
      int where = 0;
#pragma unroll
      for (int v = 1; v < V; ++v) {
        if (u[v] < best) { best = u[v]; where = v; }
      }
      unsigned key_hi = ordered_bits(best), key_lo = (unsigned)(lane * V + where);
#pragma unroll
      for (int offset = 16; offset >= 1; offset >>= 1) {
        const unsigned other_hi = __shfl_xor_sync(FULL_WARP, key_hi, offset);
        const unsigned other_lo = __shfl_xor_sync(FULL_WARP, key_lo, offset);
        if (other_hi < key_hi || (other_hi == key_hi && other_lo < key_lo)) { key_hi = other_hi; key_lo = other_lo; }
      }
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (key_lo == (unsigned)(lane * V + v)) u[v] = positive_infinity();
      }
      if (lane == 0) to[j] = from_ordered_bits(key_hi);
    }
  }
}

// Shared memory a screen block needs (the host passes at least this as SMEM): the ring, the threshold
// mode's [BQ][BN + 1] upper bounds, STAGES buffers of the per-row scalars, the per-query scalars.
__host__ __device__ constexpr int screen_smem_bytes(bool threshold, int BQ, int BN, int BKB, int STAGES) {
  return STAGES * (BQ + BN) * (BKB + 16) + (threshold ? BQ * (BN + 1) * 4 : 0) + STAGES * 8 * BN + 12 * BQ;
}

TINYKNN_D void copy_async4(unsigned to, const void* from, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(to), "l"(from), "r"(bytes) : "memory");
}

template <class E, bool IP, bool THRESHOLD, int K, int BQ, int BN, int BKB, int WARPS_Q, int WARPS_N, int STAGES,
          bool LDMATRIX, int SMEM>
__global__ void __launch_bounds__(WARPS_Q * WARPS_N * 32)
screen_kernel(const uint4* __restrict__ data, long long n_rows, long long row_step,
              const float* __restrict__ sq_norms, const float* __restrict__ row_norms,
              const uint4* __restrict__ queries, int n_queries, int row_bytes,
              const float* __restrict__ thresholds, const float* __restrict__ err_scale,
              const float* __restrict__ err_offset, int* __restrict__ counts, int* __restrict__ survivors,
              int capacity, float* __restrict__ out_upper, int tiles_per_block) {
  typedef ScreenMma<E> Mma;
  typedef typename Mma::Acc Acc;
  constexpr int THREADS = WARPS_Q * WARPS_N * 32;
  constexpr int WQ = BQ / WARPS_Q, WN = BN / WARPS_N;       // warp tile: WQ queries x WN rows
  constexpr int MT = WQ / 16, NT = WN / 8;                   // mma tiles per warp
  constexpr int PITCH = BKB + 16;                            // shared bytes per staged row
  constexpr int CH = BKB / 16;                               // 16-byte chunks per row per stage
  constexpr int A_UNITS = BQ * CH, B_UNITS = BN * CH;
  constexpr int A_LOADS = (A_UNITS + THREADS - 1) / THREADS, B_LOADS = (B_UNITS + THREADS - 1) / THREADS;
  constexpr int STAGE_A = BQ * PITCH, STAGE_B = BN * PITCH;
  constexpr int PIPE = STAGES * (STAGE_A + STAGE_B);
  constexpr int UPITCH = BN + 1;                             // threshold mode: upper bounds [BQ][BN + 1]
  constexpr int UPPER = THRESHOLD ? BQ * UPITCH * 4 : 0;
  constexpr int NEED = screen_smem_bytes(THRESHOLD, BQ, BN, BKB, STAGES);
  static_assert(PIPE + UPPER + STAGES * 8 * BN + 12 * BQ == NEED, "screen_kernel: layout and screen_smem_bytes disagree");
  static_assert(SMEM >= NEED, "screen_kernel: SMEM is smaller than its shared memory layout");
  static_assert(WQ % 16 == 0 && WN % 16 == 0 && BQ % WARPS_Q == 0 && BN % WARPS_N == 0,
                "screen_kernel: a warp tile is a multiple of 16 queries x 16 rows");
  static_assert(BKB % 32 == 0 && STAGES >= 2, "screen_kernel: BKB a multiple of 32 bytes, STAGES >= 2");
  static_assert(BN % 32 == 0 && (!THRESHOLD || K >= 1), "screen_kernel: BN a multiple of 32; threshold K >= 1");

  extern __shared__ uint4 screen_space[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(screen_space);
  float* upper_s = reinterpret_cast<float*>(smem + PIPE);             // [BQ][UPITCH] (threshold mode)
  float* rows_s = reinterpret_cast<float*>(smem + PIPE + UPPER);      // [STAGES][2][BN]: |x|^2 bound, r_x
  float* thr_s = rows_s + STAGES * 2 * BN;                            // [BQ] thresholds
  float* esc_s = thr_s + BQ;                                          // [BQ] e_q
  float* eoff_s = esc_s + BQ;                                         // [BQ] f_q
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wq0 = (warp / WARPS_N) * WQ, wn0 = (warp % WARPS_N) * WN;
  const int n_qtiles = (n_queries + BQ - 1) / BQ;
  const int qtile = (int)(blockIdx.x % (unsigned)n_qtiles);
  const long long first_tile = (long long)(blockIdx.x / (unsigned)n_qtiles) * tiles_per_block;
  const long long n_rtiles = (n_rows + BN - 1) / BN;
  const int q0 = qtile * BQ;
  const int row_chunks = row_bytes / 16;
  const int k_tiles = (row_chunks + CH - 1) / CH;
  const long long left = n_rtiles - first_tile;
  const int my_tiles = left <= 0 ? 0 : (left < tiles_per_block ? (int)left : tiles_per_block);
  const int total = my_tiles * k_tiles;                      // pipeline steps: (tile, k tile) pairs
  // Logical row at position i (< BN) of row tile t: contiguous tiles (screen), interleaved (threshold).
  auto sample_row = [n_rtiles](long long t, int i) -> long long {
    return THRESHOLD ? (long long)i * n_rtiles + t : t * BN + i;
  };

  for (int i = threadIdx.x; i < BQ; i += THREADS) {        // per-query scalars (seen after the first barrier)
    const bool ok = q0 + i < n_queries;
    thr_s[i] = ok && !THRESHOLD ? __ldg(thresholds + q0 + i) : 0.0f;
    esc_s[i] = ok ? __ldg(err_scale + q0 + i) : 0.0f;
    eoff_s[i] = ok ? __ldg(err_offset + q0 + i) : 0.0f;
  }

  // What each thread copies per stage: 16-byte chunk (tid % CH) of rows tid / CH + i * THREADS / CH of
  // the query and row tiles; the step moves the chunk offset, the tile the row offset.
  static_assert(THREADS % CH == 0, "screen_kernel: threads must cover whole rows of a stage");
  constexpr int ROWS_PER_PASS = THREADS / CH;
  const int my_chunk = threadIdx.x % CH, my_row = threadIdx.x / CH;
  const uint4* my_query = queries + (long long)(q0 + my_row) * row_chunks + my_chunk;
  const long long row_stride = row_step * row_chunks;        // chunks between consecutive logical rows
  const unsigned smem_base = shared_address(smem);
  const unsigned rows_base = shared_address(rows_s);
  const unsigned my_offset = my_row * PITCH + my_chunk * 16;
  int load_tile = 0, load_kt = 0;                            // the next step to copy
  auto load_next = [&]() {
    const int slot = (load_tile * k_tiles + load_kt) % STAGES;
    const unsigned a_base = smem_base + slot * STAGE_A + my_offset;
    const unsigned b_base = smem_base + STAGES * STAGE_A + slot * STAGE_B + my_offset;
    const int c0 = load_kt * CH;
    const bool chunk_ok = c0 + my_chunk < row_chunks;
    const long long load_t = first_tile + load_tile;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      if (i * THREADS + (int)threadIdx.x < A_UNITS) {
        const bool ok = chunk_ok && q0 + my_row + i * ROWS_PER_PASS < n_queries;
        copy_async16(a_base + i * ROWS_PER_PASS * PITCH,
                     ok ? my_query + (long long)i * ROWS_PER_PASS * row_chunks + c0 : queries, ok ? 16 : 0);
      }
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      if (i * THREADS + (int)threadIdx.x < B_UNITS) {
        const long long r = sample_row(load_t, my_row + i * ROWS_PER_PASS);
        const bool ok = chunk_ok && r < n_rows;
        copy_async16(b_base + i * ROWS_PER_PASS * PITCH, ok ? data + r * row_stride + my_chunk + c0 : data,
                     ok ? 16 : 0);
      }
    }
    if (load_kt == 0) {                                      // the tile's per-row scalars, into buffer tile % STAGES
      const unsigned base = rows_base + (load_tile % STAGES) * 2 * BN * 4;
      for (int i = threadIdx.x; i < 2 * BN; i += THREADS) {
        const long long r = sample_row(load_t, i % BN);
        const bool ok = r < n_rows && (i >= BN || !IP);
        const float* from = i < BN ? sq_norms : row_norms;
        copy_async4(base + i * 4, ok ? from + r * row_step : row_norms, ok ? 4 : 0);
      }
    }
    if (++load_kt == k_tiles) {
      load_kt = 0;
      ++load_tile;
    }
  };

  Acc acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < total) load_next();
    copy_async_commit();
  }
  // Fragment addresses (ldmatrix): A, lane l gives query row (l & 15), k half (l >> 4) of a 16x16
  // tile -> a0..a3 in mma order; B, lane l gives row (l & 7) + 8 (l >> 4), k half (l >> 3) & 1 of two
  // 8-row tiles -> b0, b1 of tile 2p and of tile 2p + 1.
  const int a_lane = (wq0 + (lane & 15)) * PITCH + (lane >> 4) * 16;
  const int b_lane = (wn0 + (lane & 7) + ((lane >> 4) << 3)) * PITCH + ((lane >> 3) & 1) * 16;
  const int g = lane >> 2, t = lane & 3;   // mma fragment coordinates (group, thread in group)

  int tile = 0, kt = 0;                    // the step computed
  for (int step = 0; step < total; ++step) {
    copy_async_wait<STAGES - 2>();
    __syncthreads();   // step's copies have landed for every thread; the slot of step - 1 is free
    if (step + STAGES - 1 < total) load_next();
    copy_async_commit();
    const int slot = step % STAGES;
    const unsigned char* a_tile = smem + slot * STAGE_A;
    const unsigned char* b_tile = smem + STAGES * STAGE_A + slot * STAGE_B;
    const unsigned a_addr = smem_base + slot * STAGE_A + a_lane;
    const unsigned b_addr = smem_base + STAGES * STAGE_A + slot * STAGE_B + b_lane;
#pragma unroll
    for (int kk = 0; kk < BKB / 32; ++kk) {
      unsigned a[MT][4], b[NT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if constexpr (LDMATRIX) {
          ldmatrix_x4(a[m], a_addr + m * 16 * PITCH + kk * 32);
        } else {
          const unsigned char* p = a_tile + (wq0 + m * 16 + g) * PITCH + kk * 32 + t * 4;
          a[m][0] = load_shared_u32(p);
          a[m][1] = load_shared_u32(p + 8 * PITCH);
          a[m][2] = load_shared_u32(p + 16);
          a[m][3] = load_shared_u32(p + 8 * PITCH + 16);
        }
      }
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {
        if constexpr (LDMATRIX) {
          unsigned r[4];
          ldmatrix_x4(r, b_addr + p * 16 * PITCH + kk * 32);
          b[2 * p][0] = r[0]; b[2 * p][1] = r[1]; b[2 * p + 1][0] = r[2]; b[2 * p + 1][1] = r[3];
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned char* q = b_tile + (wn0 + (2 * p + h) * 8 + g) * PITCH + kk * 32 + t * 4;
            b[2 * p + h][0] = load_shared_u32(q);
            b[2 * p + h][1] = load_shared_u32(q + 16);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) Mma::mma(acc[m][n], a[m], b[n]);
    }
    if (kt == k_tiles - 1) {
      // Epilogue of the tile. acc[m][n][i]: query wq0 + 16 m + g + 8 (i >> 1), row wn0 + 8 n + 2 t + (i & 1).
      // Its per-row scalars landed with its first step (an earlier commit group, so complete now).
      const long long tile_t = first_tile + tile;
      const float* norm_s = rows_s + (tile % STAGES) * 2 * BN;
      const float* rnorm_s = norm_s + BN;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ql = wq0 + 16 * m + g + 8 * h;
          const int q = q0 + ql;
          const float e = esc_s[ql], f = eoff_s[ql], thr = thr_s[ql];
#pragma unroll
          for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int rl = wn0 + 8 * n + 2 * t + j;
              const long long r = sample_row(tile_t, rl);
              const Acc c = acc[m][n][2 * h + j];
              acc[m][n][2 * h + j] = 0;
              const float bound = fma_up(e, rnorm_s[rl], f);
              if constexpr (THRESHOLD) {
                const float key = IP ? -Mma::low(c) : fma_up(-2.0f, Mma::low(c), norm_s[rl]);
                const float upper = add_up(key, bound);
                upper_s[ql * UPITCH + rl] = r < n_rows && q < n_queries && upper == upper ? upper : positive_infinity();
              } else {
                const float key = IP ? -Mma::high(c) : fma_down(-2.0f, Mma::high(c), norm_s[rl]);
                const float lower = sub_down(key, bound);
                if (r < n_rows && q < n_queries && !(lower > thr)) {
                  const int slot = atomicAdd(counts + q, 1);
                  if (slot < capacity) survivors[(long long)q * capacity + slot] = (int)r;
                }
              }
            }
          }
        }
      }
      if constexpr (THRESHOLD) {
        __syncthreads();
        select_smallest<K, BN, WARPS_Q * WARPS_N>(upper_s, UPITCH, q0, n_queries, BQ,
                                                   out_upper + (first_tile + tile) * K, n_rtiles * K);
        // upper_s is written again only after the next step's barrier
      }
    }
    if (++kt == k_tiles) {
      kt = 0;
      ++tile;
    }
  }
  copy_async_wait<0>();   // nothing may be in flight when the block exits
}

}  // namespace tinyknn
