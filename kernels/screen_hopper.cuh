// tinyknn: the tensor-core screen on Hopper (sm_90a only): wgmma.mma_async fed by TMA (cp.async.bulk.tensor)
// through an mbarrier ring. The same job and answers as screen.cuh's screen mode (read its header for the
// layout, the error model and the survivor semantics); bench/NOTES_SCREEN.md has the measurements.
//
// S = Q X^T over queries Q (n_queries x row_bytes, rounded to the screen's element type) and rows X
// (n_rows x row_bytes, the same type), row-major with rows padded to 16 bytes. TMA zero-fills past a row's
// end and past the last row / query (the tensor maps' extents), so no padding to the tile is asked.
//
// ---- Work ---------------------------------------------------------------------------------------
// A tile is TILE_Q = 64 MW CW queries (CW consumer warpgroups: 2, or 3 below) x BN rows, numbered
// t = row_tile * n_query_tiles + query_tile (the query tile fastest: the CTAs running at one time read the same
// few row tiles, which then come from L2).
// Persistent grid (one CTA per SM): CTA b takes tiles b, b + grid, ...  CTA = 3 warpgroups (384 threads):
//   WG0, the producer (setmaxnreg.dec 40), one thread: per tile a bulk copy of the tile's |x|^2 lower
//        bounds (l2) into an 8-slot scalar ring (a slot is free again once all 256 consumer threads have
//        arrived on its "empty" mbarrier), then per k-block of 128 bytes of K one TMA box of the
//        tile's queries and one of its rows into the STAGES-deep ring (128-byte swizzle), completing on
//        the stage's "full" mbarrier (arrive.expect_tx + complete_tx); it waits on the stage's "empty"
//        mbarrier before reusing it. With PB its warps 1-3 fill the scalar slots instead, with plain stores
//        of the bounds biased to integers, and arrive on the slot's "full" mbarrier (96 arrivals).
//   WG1, WG2, the consumers (setmaxnreg.inc 232), cooperative: WG c takes queries [64 MW c, 64 MW (c + 1))
//        of every tile as MW wgmma m64nBN blocks, 4 instructions per k-block each (32 bytes of K apiece),
//        both operands from shared-memory descriptors; one wgmma group stays in flight, and a stage is
//        free once all 8 consumer warps have arrived on its "empty" mbarrier.
// CW = 3 (8-bit's default where MW = 1 and a row is one k-block; the screen only): three consumer warpgroups (512
// threads, tiles of 192 queries) for more warps to hide each one's waits. 512 threads leave 128 registers a
// thread, fewer than an m64n256 s32 wgmma needs (ptxas asks 154), so each consumer takes its BN rows in two
// halves of BN / 2 (64 accumulators), products then epilogue, and releases the stage after the second.
// XO > 0 (a knob for probes: rows of XO <= STAGES / 2 k-blocks, the screen only): each consumer's work in two
// halves of 64 accumulators (8-bit tiles: its rows' halves; 16-bit: its two m64 blocks of queries), one half's
// products in flight while the other half's epilogue runs, and the next tile's first half's while this tile's
// second half's epilogue runs; a tile's stages are held until both halves' products are done.
//
// ---- The bound and the epilogue (compare-only) --------------------------------------------------------
// screen.cuh's model with n = 4 instructions per k-block (zero-filled ones included) in the host's gamma.
// Per tile the bound of its worst row, RU(e_q rmax + f_q) with rmax = tile_rmax[row tile] >= every r_x of
// the tile (NaN when any is: then every row of the tile survives), is folded into the threshold once:
// tq = RU(thresholds[q] + bound); row r survives query q unless key > tq, key = RD(|x|^2_lo - 2 dot)
// (l2) or -dot (ip) with the dot rounded up. Rigorous: key > tq >= T + bound_r implies that the exact key
// exceeds T. 8-bit dots are exact s32 sums; their conversion rounds up (cvt.rp), or, EXACT (the host's
// check that every |dot| < 2^24), rounds to nearest (cvt.rn: the same value, a full-rate instruction).
// Survivors as screen.cuh: counts[q] += 1 (atomic), survivors[q * capacity + slot] = r for slot <
// capacity; past it the count still grows, so the host sees the overflow.
//
// ---- Threshold mode (KT > 0) ------------------------------------------------------------------------
// screen.cuh's threshold mode on the same pipeline: the rows are a sample of n_tiles x BN rows, tile t holding
// the rows t, t + n_tiles, t + 2 n_tiles, ... of a strided sample (tmap_x a 3-D map: elements, tile, row of the
// tile, so a cluster of rows stored together spreads over many tiles), sq_norms the sample's |x|^2 UPPER
// bounds in that tile order and tile_rmax its tiles' largest r_x (sample_terms_kernel). Per (query, tile) the
// KT smallest upper bounds key~ + RU(e_q rmax + f_q) (key~ rounded up: the dot rounded down) go to
// out_upper[(q n_tiles + t) KT + j], ascending (+inf where NaN); threshold_kernel then takes each query's k-th.
// The KT smallest keys are found first and the tile's bound added to them alone (add.rp is monotone).
//
// A wait on an mbarrier that lasts 2^35 clocks (~19 s) is a broken pipeline: the kernel traps (the launch
// fails with an error; it never returns a wrong answer).
#pragma once
#include "screen.cuh"
#include "wgmma.cuh"

namespace tinyknn {

struct alignas(64) TensorMap { unsigned long long opaque[16]; };   // a CUtensorMap, passed by value

// ---- mbarrier --------------------------------------------------------------------------------------
TINYKNN_D void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
TINYKNN_D void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
TINYKNN_D void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// LONG: try_wait with a suspend-time hint: a thread whose phase is not complete sleeps until it is (or the hint's
// 10 ms pass) in place of the system's short limit, so a waiting warp issues a few instructions, not a loop's
// every ~80 cycles (the screen's idle producer warps spun through a fifth of its instructions: ncu, 8-bit l2)
template <bool LONG = false> TINYKNN_D bool mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  if constexpr (LONG)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity), "r"(10000000u) : "memory");
  else
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
template <bool LONG = false> TINYKNN_D void mbar_wait(unsigned bar, unsigned parity) {
  if (mbar_try_wait<LONG>(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait<LONG>(bar, parity)) {
    if (clock64() - start > (1ll << 35)) __trap();
  }
}

// ---- bulk copies (TMA) ------------------------------------------------------------------------------
TINYKNN_D void tma_load_2d(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
TINYKNN_D void tma_load_3d(unsigned dst, const TensorMap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
TINYKNN_D void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
TINYKNN_D void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// ---- wgmma ------------------------------------------------------------------------------------------
TINYKNN_D void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
TINYKNN_D void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
TINYKNN_D void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
template <int R> TINYKNN_D void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R)); }
template <int R> TINYKNN_D void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R)); }

// Descriptor of a K-major tile in the 128-byte swizzle TMA writes: 128-byte rows in 8-row atoms of 1024
// bytes (stride byte offset 1024, leading byte offset unused: 1), swizzle mode 1. The tile is 1024-byte
// aligned; a K step inside the 128-byte row adds its byte offset to the start address.
TINYKNN_D unsigned long long sw128_desc(unsigned address) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// ---- element types: the instruction, and the dot rounded up as a float ---------------------------------
template <class E, bool EXACT> struct HopperMma;
template <bool EXACT> struct HopperMma<ScreenF16, EXACT> {
  typedef float Acc;
  static constexpr int BK = 64;                        // elements of K per 128-byte k-block
  template <int N> TINYKNN_D static void mma(float (&d)[N / 2], unsigned long long a, unsigned long long b, int s) {
    if constexpr (N == 256) wgmma_f16_n256(d, a, b, s); else wgmma_f16_n128(d, a, b, s);
  }
  TINYKNN_D static float high(float c) { return c; }
  TINYKNN_D static float low(float c) { return c; }
  TINYKNN_D static void keep(float& c) { asm volatile("" : "+f"(c)::"memory"); }
};
template <bool EXACT> struct HopperMma<ScreenBF16, EXACT> : HopperMma<ScreenF16, EXACT> {
  template <int N> TINYKNN_D static void mma(float (&d)[N / 2], unsigned long long a, unsigned long long b, int s) {
    if constexpr (N == 256) wgmma_bf16_n256(d, a, b, s); else wgmma_bf16_n128(d, a, b, s);
  }
};
TINYKNN_D float s32_to_float_rn(int c) { float f; asm("cvt.rn.f32.s32 %0, %1;" : "=f"(f) : "r"(c)); return f; }
template <bool EXACT> struct HopperMma8 {
  typedef int Acc;
  static constexpr int BK = 128;
  TINYKNN_D static float high(int c) { return EXACT ? s32_to_float_rn(c) : s32_to_float_ru(c); }
  TINYKNN_D static float low(int c) { return EXACT ? s32_to_float_rn(c) : s32_to_float_rd(c); }
  TINYKNN_D static void keep(int& c) { asm volatile("" : "+r"(c)::"memory"); }
};
template <bool EXACT> struct HopperMma<ScreenU8, EXACT> : HopperMma8<EXACT> {
  template <int N> TINYKNN_D static void mma(int (&d)[N / 2], unsigned long long a, unsigned long long b, int s) {
    if constexpr (N == 256) wgmma_u8_n256(d, a, b, s); else wgmma_u8_n128(d, a, b, s);
  }
};
template <bool EXACT> struct HopperMma<ScreenS8, EXACT> : HopperMma8<EXACT> {
  template <int N> TINYKNN_D static void mma(int (&d)[N / 2], unsigned long long a, unsigned long long b, int s) {
    if constexpr (N == 256) wgmma_s8_n256(d, a, b, s); else wgmma_s8_n128(d, a, b, s);
  }
};

// The compare-only epilogue of one tile, this thread's part: acc[m][4 j + 2 h + bb] is query q_first + 64 m + 8 h
// against row r_first + 8 j + bb; each row that survives its query's tq (the threshold with the tile's bound
// folded in) is appended to the query's survivors. norm_s: the tile's |x|^2 lower bounds (l2).
// Chunks of 8 rows are taken G at a time (hopper_epi_group, or the kernel's EG): their |x|^2 loaded together, one branch for the group,
// and a survivor (rare) recomputes its key in the branch with the same arithmetic, only in the chunks that
// have one, so the fast path keeps only one predicate per chunk (appending from every chunk of the group
// measured 14.1 / 30.0 ms at k = 10 / 100 on 10M x 128 uint8 x 2,048, against 12.7 / 23.3 this way). One chunk a branch (the first version) left each warp waiting on its shared load
// and its branch: 4.5 instructions an element at an issue rate of 0.27 a cycle a scheduler (ncu, l2 uint8,
// 10M x 128 x 2,048 on the H200).
//
// IK (integer keys; 8-bit rows whose every |x|^2 and |q|^2 is below 2^23, render_screen.integer_keys): the key
// is computed in int32 from the exact s32 dot, key' = bits(sq + 2^23) - 2 dot (l2: the add rounds the row's
// |x|^2 lower bound sq to an integer S' <= |x|^2, and its bits are 0x4B000000 + S') or -dot (ip), against
// floor(tq) (+ 0x4B000000 for l2): one IMAD and one ISETP an element in place of I2FP, FFMA and FSETP (the ALU
// pipe, which I2FP and FSETP share, is the screen's busiest). Rigorous: S' - 2 dot <= the exact key, an
// integer, so a row whose exact key is within tq is within floor(tq) and survives. ip's survivors are the float
// keys' exactly; l2's too on rows whose |x|^2 < 2^22 (sq then rounds back to |x|^2) against the threshold
// step's tq; beyond that, or against range search's thresholds, a row within one unit of tq may differ.
// PB (a knob with IK for l2): the producer warpgroup's idle warps store the tile's |x|^2 lower bounds already
// biased (the float sq + 2^23, rounded as the epilogue's add rounds it), so the epilogue reads S' bits and drops
// its 2 FADD a chunk, redone for every tile by every consumer thread.
template <int MW> __host__ __device__ constexpr int hopper_epi_group() { return MW == 1 ? 4 : 2; }
TINYKNN_D int int_threshold(float tq, bool ip) {   // floor(tq) clamped to +-2^26 (NaN: every row), l2's bias added
  const float clamped = tq != tq ? 67108864.0f : fminf(fmaxf(tq, -67108864.0f), 67108864.0f);
  return __float2int_rd(clamped) + (ip ? 0 : 0x4B000000);
}
// AHEAD (the kernel's LT): each group's bounds are loaded before the group ahead of it takes its branch, so that
// their shared-memory latency is not waited for at the group's first key (ncu: the first IMAD of a group and the
// loads' wait were a tenth of a group's stall samples; the branch keeps the compiler from hoisting them itself).
// HK (a knob for probes, with PB: half keys): the producer stores each row's -(S' >> 1) in place of S', and an
// element survives where dot + that >= -(ti >> 1). Rigorous: S' - 2 dot <= ti gives 2 dot >= S' - ti, so
// dot - (S' >> 1) >= (S' - ti) / 2 - (S' >> 1) >= -ti / 2, an integer's bound, hence >= -(ti >> 1) (S' and ti
// are positive: their bias is 2^30-odd); it keeps the same rows but those whose key is ti + 1 (an odd S'), which
// the verify step settles. A chunk's test of a query's two rows is then one add and one VIADDMNMX (a Hopper DPX
// instruction: max(a + b, c)) and one compare, where the keys take an IMAD and a compare each.
template <class Mma, bool IP, int BN, int MW, int G, bool IK, bool PB, class Acc, bool AHEAD = false, bool HK = false>
TINYKNN_D void hopper_epilogue(const Acc (&acc)[MW][BN / 2], const float (&tq)[MW][2], const float* norm_s,
                               int q_first, int r_first, int t4, int n_queries, int n_rows, int* __restrict__ counts,
                               int* __restrict__ survivors, int capacity) {
  static_assert((BN / 8) % G == 0, "hopper_epilogue: the chunks of a tile split into whole groups");
  static_assert(!HK || PB, "hopper_epilogue: half keys of the producer's biased bounds only");
  int ti[MW][2];                       // IK: the thresholds as integers (HK: -(ti >> 1))
#pragma unroll
  for (int m = 0; m < MW; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ti[m][h] = IK ? int_threshold(tq[m][h], IP) : 0;
      if constexpr (HK) ti[m][h] = -(ti[m][h] >> 1);
    }
  // element e = (m, h, bb) of chunk j: query q_first + 64 m + 8 h, row r_first + 8 j + bb
  auto dot_at = [&](int j, int e) { return acc[e >> 2][4 * j + 2 * ((e >> 1) & 1) + (e & 1)]; };
  auto key = [&](int j, int e, const float2& nv) {
    const float hi = Mma::high(dot_at(j, e));
    return IP ? -hi : fma_down(-2.0f, hi, (e & 1) ? nv.y : nv.x);
  };
  auto int_key = [&](int j, int e, const int2& sq) {
    const int dot = (int)dot_at(j, e);
    return IP ? -dot : ((e & 1) ? sq.y : sq.x) - 2 * dot;
  };
  // whether element e of chunk j survives (the float key, IK's integer one, or HK's half key)
  auto kept = [&](int j, int e, const float2& nv, const int2& sq) {
    if constexpr (HK) return !((int)dot_at(j, e) + ((e & 1) ? sq.y : sq.x) < ti[e >> 2][(e >> 1) & 1]);
    else if constexpr (IK) return !(int_key(j, e, sq) > ti[e >> 2][(e >> 1) & 1]);
    else return !(key(j, e, nv) > tq[e >> 2][(e >> 1) & 1]);
  };
  // the |x|^2 bounds of the group of chunks from j0
  auto bounds = [&](int j0, float2 (&nv)[G], int2 (&sq)[G]) {
#pragma unroll
    for (int u = 0; u < G; ++u) {
      nv[u] = IP ? make_float2(0.0f, 0.0f) : *reinterpret_cast<const float2*>(norm_s + 8 * (j0 + u) + 2 * t4);
      if constexpr (PB)       // the producer stored them biased already (the kernel's PB)
        sq[u] = *reinterpret_cast<const int2*>(norm_s + 8 * (j0 + u) + 2 * t4);
      else
        sq[u] = IK && !IP ? make_int2(__float_as_int(nv[u].x + 8388608.0f), __float_as_int(nv[u].y + 8388608.0f))
                          : make_int2(0, 0);
    }
  };
  float2 nv_ahead[G];
  int2 sq_ahead[G];
  if constexpr (AHEAD) bounds(0, nv_ahead, sq_ahead);
#pragma unroll
  for (int j0 = 0; j0 < BN / 8; j0 += G) {
    float2 nv[G];
    int2 sq[G];
    if constexpr (AHEAD) {
#pragma unroll
      for (int u = 0; u < G; ++u) nv[u] = nv_ahead[u], sq[u] = sq_ahead[u];
      if (j0 + G < BN / 8) bounds(j0 + G, nv_ahead, sq_ahead);
    } else {
      bounds(j0, nv, sq);
    }
    bool any[G];
#pragma unroll
    for (int u = 0; u < G; ++u) {
      any[u] = false;
      if constexpr (HK) {   // a query's two rows at once: max(dot1 + h1, dot0 + h0) against its bound
#pragma unroll
        for (int e = 0; e < MW * 4; e += 2) {
          const int most = __viaddmax_s32((int)dot_at(j0 + u, e + 1), sq[u].y, (int)dot_at(j0 + u, e) + sq[u].x);
          any[u] |= !(most < ti[e >> 2][(e >> 1) & 1]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < MW * 4; ++e) any[u] |= kept(j0 + u, e, nv[u], sq[u]);
      }
    }
    bool group = false;
#pragma unroll
    for (int u = 0; u < G; ++u) group |= any[u];
    if (group) {   // rare: append the survivors of the chunks of this group that have any
#pragma unroll
      for (int u = 0; u < G; ++u) {
        if (!any[u]) continue;
#pragma unroll
        for (int e = 0; e < MW * 4; ++e) {
          const int j = j0 + u, m = e >> 2, h = (e >> 1) & 1;
          const int q = q_first + 64 * m + 8 * h, r = r_first + 8 * j + (e & 1);
          if (kept(j, e, nv[u], sq[u]) && q < n_queries && r < n_rows) {
            const int slot = atomicAdd(counts + q, 1);
            if (slot < capacity) survivors[(long long)q * capacity + slot] = r;
          }
        }
      }
    }
  }
}

TINYKNN_D float max_nan(float a, float b) { float d; asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }

// Threshold mode's epilogue: per query of this thread (q_first + 64 m + 8 h) the KT smallest keys rounded up
// over its BN / 4 rows (a NaN key is never kept: fminf drops it, max.NaN keeps it from the second place),
// merged over the quad that shares the query (every row of the tile), plus the tile's bound; lane t4 = 0 writes.
template <class Mma, bool IP, int BN, int MW, int KT, class Acc>
TINYKNN_D void hopper_threshold_epilogue(const Acc (&acc)[MW][BN / 2], const float (&bound)[MW][2], const float* norm_s,
                                         int q_first, int tile, int n_tiles, int t4, int n_queries,
                                         float* __restrict__ out_upper) {
  static_assert(KT == 1 || KT == 2, "hopper_threshold_epilogue: one or two bounds per (query, tile)");
  float best[MW][2][2];
#pragma unroll
  for (int m = 0; m < MW; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) best[m][h][0] = best[m][h][1] = positive_infinity();
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const float2 nv = IP ? make_float2(0.0f, 0.0f) : *reinterpret_cast<const float2*>(norm_s + 8 * j + 2 * t4);
#pragma unroll
    for (int m = 0; m < MW; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
          const float lo = Mma::low(acc[m][4 * j + 2 * h + bb]);
          const float key = IP ? -lo : fma_up(-2.0f, lo, bb ? nv.y : nv.x);
          if (KT == 2) best[m][h][1] = fminf(best[m][h][1], max_nan(best[m][h][0], key));
          best[m][h][0] = fminf(best[m][h][0], key);
        }
  }
#pragma unroll
  for (int m = 0; m < MW; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float b0 = best[m][h][0], b1 = best[m][h][1];
#pragma unroll
      for (int offset = 1; offset <= 2; offset *= 2) {
        const float o0 = __shfl_xor_sync(FULL_WARP, b0, offset), o1 = __shfl_xor_sync(FULL_WARP, b1, offset);
        b1 = fminf(fmaxf(b0, o0), fminf(b1, o1));
        b0 = fminf(b0, o0);
      }
      const int q = q_first + 64 * m + 8 * h;
      if (t4 == 0 && q < n_queries) {
        float* to = out_upper + ((long long)q * n_tiles + tile) * KT;
        const float u0 = add_up(b0, bound[m][h]);
        to[0] = u0 == u0 ? u0 : positive_infinity();
        if (KT == 2) {
          const float u1 = add_up(b1, bound[m][h]);
          to[1] = u1 == u1 ? u1 : positive_infinity();
        }
      }
    }
}

constexpr int HOPPER_SCALAR_SLOTS = 8;   // per-tile |x|^2 buffers of BN floats each
// Shared memory of a configuration (the host passes at least this): 1024 bytes of alignment slack, the
// ring, the scalar ring, the mbarriers.
__host__ __device__ constexpr int hopper_smem_bytes(int BN, int MW, int STAGES, int CW = 2) {
  return 1024 + STAGES * (64 * CW * MW + BN) * 128 + HOPPER_SCALAR_SLOTS * BN * 4 +
         8 * (2 * STAGES + 2 * HOPPER_SCALAR_SLOTS);
}

// tmap_q: the rounded queries (n_queries x row_bytes), tmap_x: the rows (n_rows x row_bytes), boxes of 128
// bytes x (64 CW MW) queries and 128 bytes x BN rows, 128-byte swizzle. sq_norms (l2): |x|^2 lower bounds,
// readable up to a whole number of BN rows; tile_rmax: one float per BN rows.
// KT > 0: the threshold mode (above); n_rows is then the sample's n_tiles x BN rows.
// LT (lean tiles; the screen's by default, not the threshold mode's): the per-tile work around the products and
// the epilogue made smaller. Every wait sleeps with a suspend-time hint (mbar_wait<true>); the consumer's warpgroup
// index is broadcast from lane 0, so that ptxas may keep the ring's addresses and the wgmma descriptors in uniform
// registers, and each k step's descriptors are the stage's plus a constant; a consumer loads its queries' terms
// again only where the query tile changed (a persistent block's tiles step by the grid, which often is a multiple
// of the query tiles); the epilogue loads each group's bounds a group ahead (hopper_epilogue's AHEAD; groups of at
// most 4 chunks, the default's: a probe's 8 would hold 16 more registers and spill with three consumers).
// HK (a knob for probes, with PB): half keys, the producer's -(S' >> 1) and one DPX max a query's two rows (above).
template <class E, bool IP, bool EXACT, int BN, int MW, int STAGES, int SMEM, int EG = 0, int KT = 0,
          bool IK = false, bool PB = false, int CW = 2, int XO = 0, bool LT = false, bool HK = false>
__global__ void __launch_bounds__(128 * (CW + 1), 1)
screen_hopper_kernel(const __grid_constant__ TensorMap tmap_q, const __grid_constant__ TensorMap tmap_x,
                     int n_rows, const float* __restrict__ sq_norms, const float* __restrict__ tile_rmax,
                     int n_queries, int row_bytes, const float* __restrict__ thresholds,
                     const float* __restrict__ err_scale, const float* __restrict__ err_offset,
                     int* __restrict__ counts, int* __restrict__ survivors, int capacity,
                     float* __restrict__ out_upper) {
  typedef HopperMma<E, EXACT> Mma;
  typedef typename Mma::Acc Acc;
  constexpr int WG_Q = 64 * MW, TILE_Q = CW * WG_Q;
  constexpr int Q_BYTES = TILE_Q * 128, X_BYTES = BN * 128, STAGE_BYTES = Q_BYTES + X_BYTES;
  constexpr int BK = Mma::BK;
  constexpr int SC_BYTES = BN * 4;
  constexpr bool XM = XO > 0 && MW == 2;              // XO's halves are the two m64 blocks (16-bit tiles)
  constexpr int HALVES = CW == 3 || (XO > 0 && !XM) ? 2 : 1;   // CW = 3, 8-bit XO: a consumer's rows in two halves
  constexpr int NACC = BN / 2 / HALVES;
  constexpr int EPI_G = EG ? EG : hopper_epi_group<MW>();   // chunks of 8 rows per branch of the epilogue
  constexpr int NEED = hopper_smem_bytes(BN, MW, STAGES, CW);
  static_assert(BN == 128 || BN == 256, "screen_hopper_kernel: BN is a wgmma N of 128 or 256");
  static_assert(MW * NACC <= 128, "screen_hopper_kernel: at most 128 accumulators per thread");
  static_assert(TILE_Q <= 256 && STAGES >= 2, "screen_hopper_kernel: a TMA box holds at most 256 rows");
  static_assert(NEED <= 232448, "screen_hopper_kernel: more shared memory than an sm_90 block gets");
  static_assert(SMEM >= NEED, "screen_hopper_kernel: SMEM is smaller than its shared memory layout");
  static_assert(!IK || (EXACT && KT == 0 && Acc(1) / Acc(2) == Acc(0)),
                "screen_hopper_kernel: integer keys for the screen of exact 8-bit dot products only");
  static_assert(!PB || (IK && !IP), "screen_hopper_kernel: biased |x|^2 bounds for l2's integer keys only");
  static_assert(!HK || PB, "screen_hopper_kernel: half keys of the producer's biased bounds only");
  static_assert(CW == 2 || (CW == 3 && MW == 1 && BN == 256 && KT == 0),
                "screen_hopper_kernel: three consumer warpgroups for the screen of 64 x 256 warpgroup tiles only");
  static_assert(XO == 0 || (2 * XO <= STAGES && CW == 2 && KT == 0 &&
                            ((MW == 1 && BN == 256 && Acc(1) / Acc(2) == Acc(0)) || (MW == 2 && BN == 128))),
                "screen_hopper_kernel: the halves' overlap for the screen of 8-bit 64 x 256 or 128 x 128 warpgroup "
                "tiles, and two tiles' k-blocks in the ring, only");
  constexpr int BIAS_THREADS = 96;                     // PB: the producer warpgroup's warps 1-3

  extern __shared__ __align__(1024) unsigned char hopper_space[];
  require_dynamic_smem(NEED);
  const unsigned raw = shared_address(hopper_space);
  const unsigned base = (raw + 1023u) & ~1023u;        // 128-byte swizzle atoms want 1024-byte alignment
  const unsigned ring = base, scalars = base + STAGES * STAGE_BYTES;
  const unsigned bars = scalars + HOPPER_SCALAR_SLOTS * SC_BYTES;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };
  auto sfull = [&](int b) { return bars + 8u * (2 * STAGES + b); };
  auto sempty = [&](int b) { return bars + 8u * (2 * STAGES + HOPPER_SCALAR_SLOTS + b); };

  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4 * CW);                   // one arrival per consumer warp
    }
    for (int b = 0; b < HOPPER_SCALAR_SLOTS; ++b) {
      mbar_init(sfull(b), PB ? BIAS_THREADS : 1);
      mbar_init(sempty(b), 128 * CW);                // every consumer thread: each read the slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int k_blocks = (row_bytes + 127) / 128;
  const int n_qt = (n_queries + TILE_Q - 1) / TILE_Q;
  const int n_rt = (n_rows + BN - 1) / BN;
  const long long total = (long long)n_qt * n_rt;

  if (wg == 0) {
    // ---------------- producer ----------------
    regs_dec<40>();
    if constexpr (PB) {
      if (threadIdx.x >= 32) {   // warps 1-3: each tile's |x|^2 lower bounds into its scalar slot, biased
        float* const slot0 = reinterpret_cast<float*>(hopper_space + (scalars - raw));
        int i = 0;
        for (long long t = blockIdx.x; t < total; t += gridDim.x, ++i) {
          const int rt = (int)(t / n_qt);
          const int b = i % HOPPER_SCALAR_SLOTS;
          mbar_wait<LT>(sempty(b), ((i / HOPPER_SCALAR_SLOTS) & 1) ^ 1);
          for (int r = threadIdx.x - 32; r < BN; r += BIAS_THREADS) {
            const float biased = __fadd_rn(__ldg(sq_norms + (long long)rt * BN + r), 8388608.0f);
            slot0[b * BN + r] = HK ? __int_as_float(-(__float_as_int(biased) >> 1)) : biased;   // HK: -(S' >> 1)
          }
          mbar_arrive(sfull(b));                       // release: the stores before it are seen after the wait
        }
      }
    }
    if (threadIdx.x == 0) {
      prefetch_map(&tmap_q);
      prefetch_map(&tmap_x);
      int pos = 0, i = 0;
      for (long long t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        const int qt = (int)(t % n_qt), rt = (int)(t / n_qt);
        const int b = i % HOPPER_SCALAR_SLOTS;
        mbar_wait<LT>(sempty(b), ((i / HOPPER_SCALAR_SLOTS) & 1) ^ 1);
        if constexpr (IP) {
          mbar_arrive(sfull(b));                       // no per-row scalars: the slot is ready at once
        } else if constexpr (!PB) {
          mbar_expect_tx(sfull(b), SC_BYTES);
          bulk_load(scalars + b * SC_BYTES, sq_norms + (long long)rt * BN, SC_BYTES, sfull(b));
        }
        for (int kb = 0; kb < k_blocks; ++kb, ++pos) {
          const int s = pos % STAGES;
          mbar_wait<LT>(empty(s), ((pos / STAGES) & 1) ^ 1);
          mbar_expect_tx(full(s), STAGE_BYTES);
          tma_load_2d(ring + s * STAGE_BYTES, &tmap_q, kb * BK, qt * TILE_Q, full(s));
          if constexpr (KT > 0)
            tma_load_3d(ring + s * STAGE_BYTES + Q_BYTES, &tmap_x, kb * BK, rt, 0, full(s));
          else
            tma_load_2d(ring + s * STAGE_BYTES + Q_BYTES, &tmap_x, kb * BK, rt * BN, full(s));
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    if constexpr (CW == 2) regs_inc<232>();            // CW = 3: the 128 a thread its launch leaves
    const int c = LT ? __shfl_sync(FULL_WARP, wg - 1, 0) : wg - 1;   // LT: warp-uniform to ptxas
    if (CW == 3 && k_blocks != 1) __trap();   // its halves reread one stage (the host never asks this)
    const int g = lane >> 2, t4 = lane & 3;
    auto release = [&](int s) { if (lane == 0) mbar_arrive(empty(s)); };   // one arrival per warp
    // a tile's per-query terms, loaded before its k loop so that their latency hides behind it
    auto load_terms = [&](int q_first, float (&thr)[MW][2], float (&esc)[MW][2], float (&eoff)[MW][2]) {
#pragma unroll
      for (int m = 0; m < MW; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = q_first + 64 * m + 8 * h;
          const bool ok = q < n_queries;
          thr[m][h] = ok && KT == 0 ? __ldg(thresholds + q) : -positive_infinity();
          esc[m][h] = ok ? __ldg(err_scale + q) : 0.0f;
          eoff[m][h] = ok ? __ldg(err_offset + q) : 0.0f;
        }
    };
    // a tile's per-query thresholds with the tile's bound folded in (the threshold mode: the bound alone)
    auto fold_bounds = [&](const float (&thr)[MW][2], const float (&esc)[MW][2], const float (&eoff)[MW][2],
                           float rmax, float (&tq)[MW][2]) {
#pragma unroll
      for (int m = 0; m < MW; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float bound = fma_up(esc[m][h], rmax, eoff[m][h]);
          tq[m][h] = KT > 0 ? bound : add_up(thr[m][h], bound);
        }
    };
    // the |x|^2 bounds of the tile a block takes i-th, in scalar slot b = i % HOPPER_SCALAR_SLOTS, once there
    auto slot_norms = [&](int i, int b) {
      mbar_wait<LT>(sfull(b), (i / HOPPER_SCALAR_SLOTS) & 1);
      return reinterpret_cast<const float*>(hopper_space + (scalars - raw) + b * SC_BYTES);
    };
    // a tile's products (of its rows' half `half`: CW = 3) into `into`, a k-block at a time from ring position
    // `pos` on (advanced past them); each stage is released once its group is done, but the last group is left
    // in flight (the caller waits)
    auto products = [&](Acc (&into)[MW][NACC], int& pos, int half) {
      for (int kb = 0; kb < k_blocks; ++kb, ++pos) {
        const int s = pos % STAGES;
        mbar_wait<LT>(full(s), (pos / STAGES) & 1);
        const unsigned a_base = ring + s * STAGE_BYTES + c * WG_Q * 128;
        const unsigned b_base = ring + s * STAGE_BYTES + Q_BYTES + half * (BN / HALVES) * 128;
        // LT: a k step's descriptors are the stage's plus its offset >> 4 (the address field holds addresses
        // under 2^18 >> 4, and every offset stays within the stage)
        const unsigned long long a_desc = sw128_desc(a_base), b_desc = sw128_desc(b_base);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int m = 0; m < MW; ++m)
            Mma::template mma<BN / HALVES>(
                into[m], LT ? a_desc + (m * 64 * 128 + k * 32) / 16 : sw128_desc(a_base + m * 64 * 128 + k * 32),
                LT ? b_desc + k * 32 / 16 : sw128_desc(b_base + k * 32), (kb | k) != 0);
        }
        wgmma_commit();
        if (kb > 0) {
          wgmma_wait<1>();
          release((pos - 1) % STAGES);
        }
      }
    };

    if constexpr (XO > 0) {
      // XO: the second half's products run while the first half's epilogue does, and the next tile's first half's
      // while the second half's epilogue does (two sets of 64 accumulators, one group always in flight). A half
      // is the rows' half (8-bit tiles, MW = 1) or one of the two m64 blocks of queries (16-bit tiles, MW = 2);
      // a tile's XO stages (its k-blocks) stay held until its second half is done, so 2 XO <= STAGES.
      constexpr int XN = XM ? BN : BN / 2;            // rows a half's products cover: its wgmma N (128)
      constexpr int XG = EG ? EG : hopper_epi_group<1>();
      Acc first[1][XN / 2], second[1][XN / 2];
      // a half's products over the tile's k-blocks from ring position pos0, as one group (every stage waited for
      // first: no wait between the products of one group)
      auto issue = [&](Acc (&into)[1][XN / 2], int pos0, int half) {
#pragma unroll
        for (int kb = 0; kb < XO; ++kb) mbar_wait<LT>(full((pos0 + kb) % STAGES), ((pos0 + kb) / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < XO; ++kb) {
          const unsigned stage = ring + ((pos0 + kb) % STAGES) * STAGE_BYTES;
          const unsigned a_base = stage + c * WG_Q * 128 + (XM ? half * 64 * 128 : 0);
          const unsigned b_base = stage + Q_BYTES + (XM ? 0 : half * XN * 128);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            Mma::template mma<XN>(into[0], sw128_desc(a_base + k * 32), sw128_desc(b_base + k * 32), (kb | k) != 0);
        }
        wgmma_commit();
      };
      auto settle = [&](Acc (&done)[1][XN / 2]) {
#pragma unroll
        for (int j = 0; j < XN / 2; ++j) Mma::keep(done[0][j]);   // no read of it moves above the wait
      };
      if ((long long)blockIdx.x >= total) return;       // (the host launches at most a block a tile)
      if (k_blocks != XO) __trap();                      // the kernel of other rows (the host never asks this)
      int i = 0;
      issue(first, 0, 0);
      for (long long t = blockIdx.x; t < total; t += gridDim.x, ++i) {
        const int qt = (int)(t % n_qt), rt = (int)(t / n_qt), pos = i * XO;
        const int q_first = qt * TILE_Q + c * WG_Q + 16 * warp + g;   // + 64 m + 8 h
        float thr[MW][2], esc[MW][2], eoff[MW][2];
        load_terms(q_first, thr, esc, eoff);
        const float rmax = __ldg(tile_rmax + rt);
        issue(second, pos, 1);
        wgmma_wait<1>();                                 // the first half is done, the second in flight
        settle(first);
        const int b = i % HOPPER_SCALAR_SLOTS;
        const float* norm_s = slot_norms(i, b);
        float tq[MW][2];
        fold_bounds(thr, esc, eoff, rmax, tq);
        // half `half`'s epilogue: its queries' thresholds, its rows' |x|^2 and first row
        auto epilogue = [&](const Acc (&done)[1][XN / 2], int half) {
          const float th[1][2] = {{tq[XM ? half : 0][0], tq[XM ? half : 0][1]}};
          const int r_off = XM ? 0 : half * XN;
          hopper_epilogue<Mma, IP, XN, 1, XG, IK, PB, Acc, LT && XG <= 4, HK>(
              done, th, norm_s + r_off, q_first + (XM ? 64 * half : 0), rt * BN + r_off + 2 * t4, t4, n_queries,
              n_rows, counts, survivors, capacity);
        };
        epilogue(first, 0);
        // the next tile's first half into the free set; after the last tile, this tile's stages again (products
        // nobody reads, waited for below: no branch around a wgmma, which ptxas would serialize)
        issue(first, t + gridDim.x < total ? pos + XO : pos, 0);
        wgmma_wait<1>();
        // released while, after the last tile, the reissue still reads them: safe only because the producer fills
        // no stage after this block's last tile (and wgmma_wait<0> below keeps the block until it ends)
#pragma unroll
        for (int kb = 0; kb < XO; ++kb) release((pos + kb) % STAGES);   // both halves' products are done
        settle(second);
        epilogue(second, 1);
        if constexpr (!PB) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_arrive(sempty(b));
      }
      wgmma_wait<0>();
      return;
    }
    Acc acc[MW][NACC];                                   // (XO: its own two sets above)
#pragma unroll
    for (int m = 0; m < MW; ++m)
#pragma unroll
      for (int j = 0; j < NACC; ++j) acc[m][j] = 0;
    int i = 0, terms_qt = -1;                           // LT: the query tile whose terms thr, esc, eoff hold
    float thr[MW][2], esc[MW][2], eoff[MW][2];
    for (long long t = blockIdx.x; t < total; t += gridDim.x, ++i) {
      const int qt = (int)(t % n_qt), rt = (int)(t / n_qt);
      const int q_first = qt * TILE_Q + c * WG_Q + 16 * warp + g;   // + 64 m + 8 h
      if (!LT || qt != terms_qt) load_terms(q_first, thr, esc, eoff);
      terms_qt = qt;
      const float rmax = __ldg(tile_rmax + rt);

      const int b = i % HOPPER_SCALAR_SLOTS;
      const float* norm_s = nullptr;
      float tq[MW][2];
#pragma unroll
      for (int half = 0; half < HALVES; ++half) {
        // ---- k loop ---- (CW = 3: one k-block, its stage read again for the second half, then released)
        int pos = i * k_blocks;
        products(acc, pos, half);
        wgmma_wait<0>();
        if (half == HALVES - 1) release((pos - 1) % STAGES);
#pragma unroll
        for (int m = 0; m < MW; ++m)
#pragma unroll
          for (int j = 0; j < NACC; ++j) Mma::keep(acc[m][j]);   // no read of acc moves above the wait

        // ---- epilogue ----
        if (half == 0) {
          norm_s = slot_norms(i, b);
          fold_bounds(thr, esc, eoff, rmax, tq);
        }
        constexpr int BH = BN / HALVES;
        if constexpr (KT > 0)
          hopper_threshold_epilogue<Mma, IP, BN, MW, KT>(acc, tq, norm_s, q_first, rt, n_rt, t4, n_queries, out_upper);
        else
          hopper_epilogue<Mma, IP, BH, MW, EPI_G, IK, PB, Acc, LT && EPI_G <= 4, HK>(
              acc, tq, norm_s + half * BH, q_first, rt * BN + half * BH + 2 * t4, t4, n_queries, n_rows, counts,
              survivors, capacity);
      }
      // the scalar slot is free for the producer's next bulk copy (async proxy; PB: its warps' plain stores, no
      // fence needed) once every consumer thread, each after its own reads of it and a proxy fence, has arrived
      // (one arrival per warp after __syncwarp left compute-sanitizer's racecheck seeing no order between lanes'
      // reads and the next copy)
      if constexpr (!PB) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_arrive(sempty(b));
    }
  }
}

// The larger of a running largest r_x and v, NaN once either is (a NaN r_x makes every row of its tile survive);
// and that over a warp. Shared by the screen's tile bounds and the threshold mode's sample.
TINYKNN_D float max_keeping_nan(float most, float v) { return v > most || v != v ? v : most; }
TINYKNN_D float warp_max_keeping_nan(float most) {
  for (int offset = 16; offset > 0; offset /= 2) most = max_keeping_nan(most, __shfl_xor_sync(FULL_WARP, most, offset));
  return most;
}

// tile_rmax[t] = the largest r_x of rows [t * BN, min((t + 1) * BN, n_rows)), NaN if any is NaN (then every
// row of the tile survives), for the tiles t in [first_tile, last_tile). One warp per tile.
template <int BN>
__global__ void __launch_bounds__(256)
tile_rmax_kernel(const float* __restrict__ r_x, long long n_rows, long long first_tile, long long last_tile,
                 float* __restrict__ tile_rmax) {
  const int lane = threadIdx.x & 31;
  const long long t = first_tile + (long long)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  if (t >= last_tile) return;
  float most = 0.0f;
  for (long long r = t * BN + lane; r < (t + 1) * BN && r < n_rows; r += 32) most = max_keeping_nan(most, r_x[r]);
  most = warp_max_keeping_nan(most);
  if (lane == 0) tile_rmax[t] = most;
}

// The threshold mode's sample (KT > 0 above): tile t of n_tiles holds the rows (t + j n_tiles) step, j < BN,
// of the index; sample_sq[t BN + j] is that row's |x|^2 upper bound, sample_rmax[t] the tile's largest r_x
// (NaN sticks). One warp per tile.
template <int BN>
__global__ void __launch_bounds__(256)
sample_terms_kernel(const float* __restrict__ sq_hi, const float* __restrict__ r_x, long long step, int n_tiles,
                    float* __restrict__ sample_sq, float* __restrict__ sample_rmax) {
  const int lane = threadIdx.x & 31;
  const long long t = (long long)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  if (t >= n_tiles) return;
  float most = 0.0f;
  for (int j = lane; j < BN; j += 32) {
    const long long row = (t + (long long)j * n_tiles) * step;
    sample_sq[t * BN + j] = sq_hi[row];
    most = max_keeping_nan(most, r_x[row]);
  }
  most = warp_max_keeping_nan(most);
  if (lane == 0) sample_rmax[t] = most;
}

}  // namespace tinyknn
