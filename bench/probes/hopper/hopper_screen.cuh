// tinyknn probe: the tensor-core screen on Hopper (sm_90a): wgmma.mma_async fed by TMA
// (cp.async.bulk.tensor) through an mbarrier producer/consumer ring. Standalone (no tinyknn header):
// bench/probes/hopper/FINDINGS.md says what it is for and what was measured.
//
// S = Q X^T over queries Q (n_q x dim, rounded to fp16 or 8-bit) and rows X (n_rows x dim, same type),
// both row-major with rows padded to a multiple of 16 bytes (tinyknn's layout); TMA zero-fills past the
// row's end and past the last row / query, so no padding to the tile is asked of the caller.
//
// ---- Work ---------------------------------------------------------------------------------------
// A tile is TILE_Q queries x BN rows; tiles are numbered t = row_tile * n_query_tiles + query_tile (the
// query tile fastest, so the CTAs running at one time read the same few row tiles: the rows stream from
// HBM about once, the other query tiles hit L2). Persistent grid: CTA b takes tiles b, b + grid, ...
// CTA = 3 warpgroups (384 threads):
//   WG0: the producer. setmaxnreg.dec to 40; one thread issues, per tile, a 1-d bulk copy of the tile's
//        per-row scalars (|x|^2 lower bound, r_x) into a small scalar ring, then per k-block of 128 bytes
//        of K a TMA box of TILE_Q queries and one of BN rows into the STAGES-deep ring (128-byte swizzle),
//        each completing on the stage's "full" mbarrier (arrive.expect_tx + complete_tx).
//   WG1, WG2: consumers. setmaxnreg.inc to 232; wgmma m64nBNk16 (fp16) / k32 (8-bit) from shared-memory
//        descriptors, f32 / s32 accumulators in registers (MW x BN/2 per thread).
//        COOP:     both consume every tile: WG c takes queries [c * 64 MW, (c + 1) * 64 MW) of the tile;
//                  a stage is free when all 8 consumer warps have arrived on its "empty" mbarrier.
//        pingpong: WG c takes the CTA's local tiles i with i % 2 == c (TILE_Q = 64 MW); one WG's epilogue
//                  runs while the other's wgmma keep the tensor cores busy; 4 arrivals free a stage.
//        In the k loop one wgmma group stays in flight: after committing k-block kb the WG waits for
//        group kb - 1 (wgmma.wait_group 1) and frees its stage.
//
// ---- Epilogue (compare-only, as kernels/screen.cuh's screen mode) ------------------------------
// Accumulator d[m][i] (m64nN layout): query row 64 m + 16 warp + lane / 4 + 8 ((i >> 1) & 1),
// database row 8 (i >> 2) + 2 (lane % 4) + (i & 1) of the WG's sub-tile.
// l2 key = |x|^2 - 2 q~.x~ (|x|^2 a float32 lower bound), ip key = -q~.x~; the dot rounded up (f16: the
// f32 accumulator as is; 8-bit: cvt.rp of the exact s32 sum) so that the key is a lower value.
//   EPI 0 (screen.cuh's structure): lower = RD(key - RU(e_q r_x + f_q)), per row r_x;
//         the row survives unless lower > thresholds[q].
//   EPI 1: the bound of the whole tile, RU(e_q rmax_tile + f_q) with rmax_tile >= every r_x of the
//         tile (the host's per-database array tile_rmax), folded into the threshold once per tile:
//         tq = RU(thresholds[q] + bound); the row survives unless key > tq. Rigorous because
//         key > tq >= thr + bound implies true key >= key - bound_row >= key - bound > thr.
//         2 instructions per element (FFMA + FSETP) instead of 4.
// NaN survives. Survivors: slot = atomicAdd(counts + q, 1); survivors[q * capacity + slot] = row for
// slot < capacity (past it the count still grows: the host sees the overflow).
// DUMP: also writes every accumulator to dump[q * n_rows + row] (f32, or the s32 bits) for the probe.
#pragma once
#include "wgmma_ops.cuh"

namespace hs {

typedef unsigned long long u64;
typedef unsigned int u32;

struct alignas(64) TensorMap { u64 opaque[16]; };   // CUtensorMap, by value as a __grid_constant__ parameter

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// ---- mbarrier ----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive on the mbarrier at the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_remote(u32 bar, u32 rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
      : "memory");
}
__device__ __forceinline__ u32 cluster_rank() { u32 r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ u32 cluster_id() { u32 r; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ u32 cluster_count() { u32 r; asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Wait for the phase of `parity` to complete. A wait that lasts ~4 s of clock is a broken pipeline:
// record where in *watchdog (if given) and trap, so a bug costs a failed launch, not a hung device.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity, int* watchdog, int where) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (clock64() - start > (1ll << 33)) {
      if (watchdog) atomicExch(watchdog, where);
      asm volatile("trap;");
    }
  }
}

// ---- bulk copies (TMA) ------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// The same box into every CTA of `mask` (same CTA-relative destination and mbarrier offsets).
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TensorMap* map, int c0, int c1, u32 bar,
                                                      unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle TMA writes: rows of 128 bytes,
// 8-row atoms of 1024 bytes (stride byte offset 1024; leading byte offset unused: 1), swizzle mode 1.
// The tile must be 1024-byte aligned; a K step inside the 128-byte row adds its byte offset to the start.
__device__ __forceinline__ u64 sw128_desc(u32 address) {
  return (u64)((address & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

template <int R> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R)); }
template <int R> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R)); }

// ---- directed rounding -------------------------------------------------------------------------
__device__ __forceinline__ float fma_down(float a, float b, float c) { float d; asm("fma.rm.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d; }
__device__ __forceinline__ float fma_up(float a, float b, float c) { float d; asm("fma.rp.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c)); return d; }
__device__ __forceinline__ float sub_down(float a, float b) { float d; asm("sub.rm.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float add_up(float a, float b) { float d; asm("add.rp.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float s32_up(int c) { float f; asm("cvt.rp.f32.s32 %0, %1;" : "=f"(f) : "r"(c)); return f; }

// ---- element types ---------------------------------------------------------------------------------
// ELEM: 0 fp16 (m64nNk16, f32 accumulate), 1 uint8, 2 int8 (m64nNk32, s32 accumulate). Each wgmma
// consumes 32 bytes of K; a k-block is one 128-byte swizzle row (64 fp16 or 128 8-bit elements).
template <int ELEM> struct Elem;
template <> struct Elem<0> {
  typedef float Acc;
  template <int N> __device__ __forceinline__ static void mma(float (&d)[N / 2], u64 a, u64 b, int scale_d) {
    if constexpr (N == 256) wgmma_f16_n256(d, a, b, scale_d);
    else if constexpr (N == 128) wgmma_f16_n128(d, a, b, scale_d);
    else wgmma_f16_n64(d, a, b, scale_d);
  }
  __device__ __forceinline__ static float high(float c) { return c; }
  __device__ __forceinline__ static float bits(float c) { return c; }
  __device__ __forceinline__ static void keep(float& c) { asm volatile("" : "+f"(c)::"memory"); }
};
template <> struct Elem<1> {
  typedef int Acc;
  template <int N> __device__ __forceinline__ static void mma(int (&d)[N / 2], u64 a, u64 b, int scale_d) {
    if constexpr (N == 256) wgmma_u8_n256(d, a, b, scale_d);
    else if constexpr (N == 128) wgmma_u8_n128(d, a, b, scale_d);
    else wgmma_u8_n64(d, a, b, scale_d);
  }
  __device__ __forceinline__ static float high(int c) { return s32_up(c); }
  __device__ __forceinline__ static float bits(int c) { return __int_as_float(c); }
  __device__ __forceinline__ static void keep(int& c) { asm volatile("" : "+r"(c)::"memory"); }
};
template <> struct Elem<2> : Elem<1> {
  template <int N> __device__ __forceinline__ static void mma(int (&d)[N / 2], u64 a, u64 b, int scale_d) {
    if constexpr (N == 256) wgmma_s8_n256(d, a, b, scale_d);
    else if constexpr (N == 128) wgmma_s8_n128(d, a, b, scale_d);
    else wgmma_s8_n64(d, a, b, scale_d);
  }
};
// 3 (uint8), 4 (int8) when every dot product is below 2^24 in magnitude (uint8: 65025 dim < 2^24, int8:
// 16384 dim < 2^24; the host checks): the s32 -> f32 conversion is exact, so round-to-nearest (I2FP, a
// full-rate ALU instruction) equals the upward rounding (I2F.RP, the slow conversion unit).
__device__ __forceinline__ float s32_exact(int c) { float f; asm("cvt.rn.f32.s32 %0, %1;" : "=f"(f) : "r"(c)); return f; }
template <> struct Elem<3> : Elem<1> {
  __device__ __forceinline__ static float high(int c) { return s32_exact(c); }
};
template <> struct Elem<4> : Elem<2> {
  __device__ __forceinline__ static float high(int c) { return s32_exact(c); }
};

// Shared memory a configuration needs (the host passes exactly this as the dynamic size).
__host__ __device__ constexpr int tile_queries(int MW, bool COOP) { return 64 * MW * (COOP ? 2 : 1); }
constexpr int SCALAR_SLOTS = 8;   // per-tile scalar buffers (|x|^2 bound and r_x of BN rows each)
__host__ __device__ constexpr int smem_bytes(int BN, int MW, bool COOP, int STAGES) {
  return 1024 + STAGES * (tile_queries(MW, COOP) + BN) * 128 + SCALAR_SLOTS * 2 * BN * 4 +
         8 * (2 * STAGES + 2 * SCALAR_SLOTS + 2);
}

// Watchdog codes (where a wait gave up): 1 producer/empty, 2 producer/scalar slot, 3 consumer/full,
// 4 consumer/scalars, 5 producer/tail, 6 consumer/pingpong order.
//
// CL (COOP only): CTAs per cluster sharing each row tile. The CL CTAs of a cluster take the same row
// tile and CL consecutive query tiles; each CTA loads BN / CL of the tile's rows and multicasts them to
// all CL CTAs (TMA .multicast::cluster), so L2 serves each row tile n_query_tiles / CL times instead of
// n_query_tiles times. A stage is then free only when the consumers of every CTA of the cluster have
// released it: each consumer warp arrives on its own CTA's "empty" barrier and on the peers' (mapa +
// remote arrive), CL * 8 arrivals. The producer ends by waiting for the last release of every stage, so
// that no peer still writes to or arrives on this CTA when it exits.
template <int ELEM, bool IP, int BN, int MW, bool COOP, int STAGES, int EPI, bool DUMP, int CL>
__device__ __forceinline__ void screen_body(const TensorMap* tmap_q, const TensorMap* tmap_x, int n_q, int n_rows,
                                            int k_blocks, const float* __restrict__ sq_norms,
                                            const float* __restrict__ row_norms, const float* __restrict__ tile_rmax,
                                            const float* __restrict__ thresholds, const float* __restrict__ err_scale,
                                            const float* __restrict__ err_offset, int* __restrict__ counts,
                                            int* __restrict__ survivors, int capacity, float* __restrict__ dump,
                                            int* __restrict__ watchdog) {
  typedef Elem<ELEM> E;
  typedef typename E::Acc Acc;
  constexpr int WG_Q = 64 * MW;                        // queries of one consumer warpgroup
  constexpr int TILE_Q = tile_queries(MW, COOP);       // queries of one tile (the TMA box of Q)
  constexpr int Q_BYTES = TILE_Q * 128, X_BYTES = BN * 128, STAGE_BYTES = Q_BYTES + X_BYTES;
  constexpr int X_PART = BN / CL;                      // rows of the row tile this CTA loads (and multicasts)
  constexpr int BK = ELEM == 0 ? 64 : 128;             // elements of K per k-block (128 bytes)
  constexpr int SC_BYTES = 2 * BN * 4;
  constexpr int CONSUMER_WARPS = COOP ? 8 : 4;
  constexpr int NACC = BN / 2;
  static_assert(BN == 64 || BN == 128 || BN == 256, "BN: a wgmma N of 64, 128 or 256");
  static_assert(MW * NACC <= 128, "at most 128 accumulators per thread");
  static_assert(TILE_Q <= 256 && STAGES >= 2, "a TMA box holds at most 256 rows");
  static_assert(smem_bytes(BN, MW, COOP, STAGES) <= 232448, "more shared memory than an sm_90 block gets");
  static_assert(CL == 1 || (COOP && (CL == 2 || CL == 4) && X_PART % 8 == 0), "clusters: COOP, 2 or 4 CTAs");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_u32(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;             // 128-byte swizzle atoms want 1024-byte alignment
  const u32 ring = base, scalars = base + STAGES * STAGE_BYTES;
  const u32 bars = scalars + SCALAR_SLOTS * SC_BYTES;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };
  auto sfull = [&](int b) { return bars + 8u * (2 * STAGES + b); };
  auto sempty = [&](int b) { return bars + 8u * (2 * STAGES + SCALAR_SLOTS + b); };
  auto order = [&](int c) { return bars + 8u * (2 * STAGES + 2 * SCALAR_SLOTS + c); };

  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int rank = CL > 1 ? (int)cluster_rank() : 0;
  const int group = CL > 1 ? (int)cluster_id() : (int)blockIdx.x;        // who shares a row tile
  const int groups = CL > 1 ? (int)cluster_count() : (int)gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), CONSUMER_WARPS * CL);
    }
    for (int b = 0; b < SCALAR_SLOTS; ++b) {
      mbar_init(sfull(b), 1);
      mbar_init(sempty(b), CONSUMER_WARPS);
    }
    mbar_init(order(0), 4);
    mbar_init(order(1), 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CL > 1) cluster_sync();   // the peers' barriers exist before anyone multicasts or arrives
  else __syncthreads();

  const int n_qt = (n_q + TILE_Q - 1) / TILE_Q;
  const int n_qg = (n_qt + CL - 1) / CL;               // groups of CL query tiles (one per cluster pass)
  const int n_rt = (n_rows + BN - 1) / BN;
  const int total = n_qg * n_rt;                       // work items: (query-tile group, row tile)

  if (wg == 0) {
    // ---------------- producer ----------------
    regs_dec<40>();
    if (threadIdx.x == 0) {
      prefetch_map(tmap_q);
      prefetch_map(tmap_x);
      int pos = 0, i = 0;
      for (int t = group; t < total; t += groups, ++i) {
        const int qt = (t % n_qg) * CL + rank, rt = t / n_qg;
        const int b = i % SCALAR_SLOTS;
        mbar_wait(sempty(b), ((i / SCALAR_SLOTS) & 1) ^ 1, watchdog, 2);
        mbar_expect_tx(sfull(b), SC_BYTES);
        bulk_load(scalars + b * SC_BYTES, sq_norms + (long long)rt * BN, BN * 4, sfull(b));
        bulk_load(scalars + b * SC_BYTES + BN * 4, row_norms + (long long)rt * BN, BN * 4, sfull(b));
        for (int kb = 0; kb < k_blocks; ++kb, ++pos) {
          const int s = pos % STAGES;
          mbar_wait(empty(s), ((pos / STAGES) & 1) ^ 1, watchdog, 1);
          mbar_expect_tx(full(s), qt * TILE_Q < n_q ? STAGE_BYTES : X_BYTES);
          // a query tile wholly past n_q (the last cluster's spare rank) is not loaded: its rows are
          // never compared (q < n_q), so the stale bytes in its place are harmless
          if (qt * TILE_Q < n_q) tma_load_2d(ring + s * STAGE_BYTES, tmap_q, kb * BK, qt * TILE_Q, full(s));
          if constexpr (CL == 1) {
            tma_load_2d(ring + s * STAGE_BYTES + Q_BYTES, tmap_x, kb * BK, rt * BN, full(s));
          } else {
            tma_load_2d_multicast(ring + s * STAGE_BYTES + Q_BYTES + rank * X_PART * 128, tmap_x, kb * BK,
                                  rt * BN + rank * X_PART, full(s), (unsigned short)((1u << CL) - 1));
          }
        }
      }
      if constexpr (CL > 1) {   // every stage's last use released by every CTA of the cluster
        for (int n = 0; n < STAGES; ++n, ++pos) mbar_wait(empty(pos % STAGES), ((pos / STAGES) & 1) ^ 1, watchdog, 5);
      }
    }
  } else {
    // ---------------- consumers ----------------
    regs_inc<232>();
    const int c = wg - 1;
    const int g = lane >> 2, t4 = lane & 3;
    const int qoff = COOP ? c * WG_Q : 0;              // this WG's queries inside the tile's Q box
    Acc acc[MW][NACC];
#pragma unroll
    for (int m = 0; m < MW; ++m)
#pragma unroll
      for (int j = 0; j < NACC; ++j) acc[m][j] = 0;
    auto release = [&](int s) {                        // one arrival per warp, on every CTA of the cluster
      if (lane == 0) {
        mbar_arrive(empty(s));
#pragma unroll
        for (int peer = 1; peer < CL; ++peer) mbar_arrive_remote(empty(s), (u32)((rank + peer) % CL));
      }
    };

    int i = 0;
    for (int t = group; t < total; t += groups, ++i) {
      if (!COOP && (i & 1) != c) continue;
      const int qt = (t % n_qg) * CL + rank, rt = t / n_qg;
      const int q_first = qt * TILE_Q + qoff + 16 * warp + g;   // + 64 m + 8 h
      // per-query terms (loaded before the k loop so that their latency hides behind it)
      float thr[MW][2], esc[MW][2], eoff[MW][2];
#pragma unroll
      for (int m = 0; m < MW; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = q_first + 64 * m + 8 * h;
          const bool ok = q < n_q;
          thr[m][h] = ok ? __ldg(thresholds + q) : -__int_as_float(0x7f800000);
          esc[m][h] = ok ? __ldg(err_scale + q) : 0.0f;
          eoff[m][h] = ok ? __ldg(err_offset + q) : 0.0f;
        }
      const float rmax = EPI == 1 ? __ldg(tile_rmax + rt) : 0.0f;

      // ---- k loop ----
      // pingpong: a WG starts waiting on its tile's stages only after the other WG has passed the waits
      // of the tile before (order[c]): a full barrier's parity names only the next completion, so no
      // waiter may run more than one generation of a slot ahead (with k_blocks >= STAGES it would).
      if (!COOP && i > 0) mbar_wait(order(c), ((i - 1) >> 1) & 1, watchdog, 6);
      int pos = i * k_blocks;
      for (int kb = 0; kb < k_blocks; ++kb, ++pos) {
        const int s = pos % STAGES;
        mbar_wait(full(s), (pos / STAGES) & 1, watchdog, 3);
        const u32 a_base = ring + s * STAGE_BYTES + qoff * 128, b_base = ring + s * STAGE_BYTES + Q_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int m = 0; m < MW; ++m)
            E::template mma<BN>(acc[m], sw128_desc(a_base + m * 64 * 128 + k * 32), sw128_desc(b_base + k * 32),
                                (kb | k) != 0);
        }
        wgmma_commit();
        if (kb > 0) {
          wgmma_wait<1>();
          release((pos - 1) % STAGES);
        }
      }
      if (!COOP && lane == 0) mbar_arrive(order(1 - c));   // every full wait of this tile is behind us
      wgmma_wait<0>();
      release((pos - 1) % STAGES);
#pragma unroll
      for (int m = 0; m < MW; ++m)
#pragma unroll
        for (int j = 0; j < NACC; ++j) E::keep(acc[m][j]);   // no read of acc moves above the wait

      // ---- epilogue ----
      const int b = i % SCALAR_SLOTS;
      mbar_wait(sfull(b), (i / SCALAR_SLOTS) & 1, watchdog, 4);
      const float* norm_s = reinterpret_cast<const float*>(smem_raw + (scalars - raw) + b * SC_BYTES);
      const float* rx_s = norm_s + BN;
      float tq[MW][2];
#pragma unroll
      for (int m = 0; m < MW; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) tq[m][h] = EPI == 1 ? add_up(thr[m][h], fma_up(esc[m][h], rmax, eoff[m][h])) : thr[m][h];
      const int r_first = rt * BN + 2 * t4;            // + 8 j + bb
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const float2 nv = IP ? make_float2(0.0f, 0.0f) : *reinterpret_cast<const float2*>(norm_s + 8 * j + 2 * t4);
        const float2 rv = EPI == 0 ? *reinterpret_cast<const float2*>(rx_s + 8 * j + 2 * t4) : make_float2(0.0f, 0.0f);
        float low[MW][2][2];
        bool any = false;
#pragma unroll
        for (int m = 0; m < MW; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
              const float hi = E::high(acc[m][4 * j + 2 * h + bb]);
              const float key = IP ? -hi : fma_down(-2.0f, hi, bb ? nv.y : nv.x);
              if constexpr (EPI == 0) {
                low[m][h][bb] = sub_down(key, fma_up(esc[m][h], bb ? rv.y : rv.x, eoff[m][h]));
              } else {
                low[m][h][bb] = key;
              }
              any |= !(low[m][h][bb] > tq[m][h]);
            }
        if (any) {   // rare: append the survivors of this 8-row chunk
#pragma unroll
          for (int m = 0; m < MW; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int bb = 0; bb < 2; ++bb) {
                const int q = q_first + 64 * m + 8 * h, r = r_first + 8 * j + bb;
                if (!(low[m][h][bb] > tq[m][h]) && q < n_q && r < n_rows) {
                  const int slot = atomicAdd(counts + q, 1);
                  if (slot < capacity) survivors[(long long)q * capacity + slot] = r;
                }
              }
        }
        if constexpr (DUMP) {
#pragma unroll
          for (int m = 0; m < MW; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int bb = 0; bb < 2; ++bb) {
                const int q = q_first + 64 * m + 8 * h, r = r_first + 8 * j + bb;
                if (q < n_q && r < n_rows) dump[(long long)q * n_rows + r] = E::bits(acc[m][4 * j + 2 * h + bb]);
              }
        }
      }
      // the scalar slot is free (generic reads done) for the producer's next bulk copy (async proxy)
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) mbar_arrive(sempty(b));
    }
  }
}

}  // namespace hs

// The kernels: one extern "C" entry per configuration, rendered by run_probe.py as
//   HS_KERNEL(name, ATTRIBUTES, CL, ELEM, IP, BN, MW, COOP, STAGES, EPI, DUMP)
// ATTRIBUTES: empty, or __cluster_dims__(CL, 1, 1) for CL > 1.
#define HS_KERNEL(NAME, ATTRIBUTES, CLUSTER, ...)                                                                 \
  extern "C" __global__ void __launch_bounds__(384, 1) ATTRIBUTES                                                 \
  NAME(const __grid_constant__ hs::TensorMap tmap_q, const __grid_constant__ hs::TensorMap tmap_x, int n_q,       \
       int n_rows, int k_blocks, const float* __restrict__ sq_norms, const float* __restrict__ row_norms,         \
       const float* __restrict__ tile_rmax, const float* __restrict__ thresholds,                                \
       const float* __restrict__ err_scale, const float* __restrict__ err_offset, int* __restrict__ counts,       \
       int* __restrict__ survivors, int capacity, float* __restrict__ dump, int* __restrict__ watchdog) {          \
    hs::screen_body<__VA_ARGS__, CLUSTER>(&tmap_q, &tmap_x, n_q, n_rows, k_blocks, sq_norms, row_norms,           \
                                          tile_rmax, thresholds, err_scale, err_offset, counts, survivors,        \
                                          capacity, dump, watchdog);                                              \
  }
