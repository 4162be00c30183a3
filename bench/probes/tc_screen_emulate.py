#!/usr/bin/env python3
"""A thread-by-thread emulation of kernels/screen.cuh's screen mode (fp16, the default tile), written
before any GPU run to catch index bugs: every thread's cp.async copies (zero-fill included), the
ldmatrix lane addresses and the register each lane receives, mma.sync by the PTX fragment layouts, the
ring slots, the per-row scalar buffers, the persistent loop and the epilogue's (query, row) mapping.
It models the hardware as PTX documents it, so it checks the kernel's bookkeeping, not the hardware.

    python3 bench/probes/tc_screen_emulate.py [ldm|plain]     # ~10-30 s on one core

Checks: every row with key <= the 5th smallest survives, each row at most once, and an infinite
threshold keeps every row exactly once, with 1 and 2 row tiles per block, for 300 x 40 (37 queries) and
260 x 72 (150 queries: two query tiles).
"""
import sys

import numpy as np

BQ, BN, BKB, WQN, WNN, S = 128, 128, 64, 2, 4, 4
LDM = True
THREADS = 32 * WQN * WNN
WQ, WN = BQ // WQN, BN // WNN
MT, NT = WQ // 16, WN // 8
PITCH = BKB + 16
CH = BKB // 16
STAGE_A, STAGE_B = BQ * PITCH, BN * PITCH
PIPE = S * (STAGE_A + STAGE_B)
RPP = THREADS // CH


def run(data16, queries16, sq, rn, row_step, n_rows, tpb, thr, e, f, capacity):
    n_q = queries16.shape[0]
    row_bytes = data16.shape[1] * 2
    row_chunks = row_bytes // 16
    k_tiles = -(-row_chunks // CH)
    dbytes = data16.view(np.uint8).reshape(-1)
    qbytes = queries16.view(np.uint8).reshape(-1)
    n_qtiles = -(-n_q // BQ)
    n_rtiles = -(-n_rows // BN)
    grid = n_qtiles * -(-n_rtiles // tpb)
    counts = np.zeros(n_q, np.int64)
    surv = -np.ones((n_q, capacity), np.int64)
    for bid in range(grid):
        smem = np.zeros(PIPE, np.uint8)
        rows_s = np.zeros((S, 2, BN), np.float32)
        qtile = bid % n_qtiles
        first_tile = (bid // n_qtiles) * tpb
        q0 = qtile * BQ
        left = n_rtiles - first_tile
        my_tiles = 0 if left <= 0 else min(left, tpb)
        total = my_tiles * k_tiles
        load = [0, 0]

        def load_next():
            lt, lk = load
            slot = (lt * k_tiles + lk) % S
            c0 = lk * CH
            for tid in range(THREADS):
                my_chunk, my_row = tid % CH, tid // CH
                off = my_row * PITCH + my_chunk * 16
                chunk_ok = c0 + my_chunk < row_chunks
                r0 = (first_tile + lt) * BN + my_row
                for i in range(-(-BQ * CH // THREADS)):
                    if i * THREADS + tid < BQ * CH:
                        q = q0 + my_row + i * RPP
                        ok = chunk_ok and q < n_q
                        dst = slot * STAGE_A + off + i * RPP * PITCH
                        if ok:
                            src = (q * row_chunks + my_chunk + c0) * 16
                            smem[dst:dst + 16] = qbytes[src:src + 16]
                        else:
                            smem[dst:dst + 16] = 0
                for i in range(-(-BN * CH // THREADS)):
                    if i * THREADS + tid < BN * CH:
                        r = r0 + i * RPP
                        ok = chunk_ok and r < n_rows
                        dst = S * STAGE_A + slot * STAGE_B + off + i * RPP * PITCH
                        if ok:
                            src = (r * row_step * row_chunks + my_chunk + c0) * 16
                            smem[dst:dst + 16] = dbytes[src:src + 16]
                        else:
                            smem[dst:dst + 16] = 0
                if lk == 0:
                    for i in range(tid, 2 * BN, THREADS):
                        r = r0 - my_row + (i % BN)
                        ok = r < n_rows
                        rows_s[lt % S, i // BN, i % BN] = ((sq if i < BN else rn)[r * row_step]) if ok else 0.0
            lk += 1
            if lk == k_tiles:
                lk, lt = 0, lt + 1
            load[0], load[1] = lt, lk

        for s in range(S - 1):
            if s < total:
                load_next()
        acc = np.zeros((WQN * WNN, 32, MT, NT, 4), np.float64)
        tile = kt = 0
        for step in range(total):
            if step + S - 1 < total:
                load_next()
            slot = step % S
            u32 = lambda addr: int.from_bytes(bytes(smem[addr:addr + 4]), "little")  # noqa: E731
            for warp in range(WQN * WNN):
                wq0, wn0 = (warp // WNN) * WQ, (warp % WNN) * WN
                for kk in range(BKB // 32):
                    a = np.zeros((32, MT, 4), np.uint32)
                    b = np.zeros((32, NT, 2), np.uint32)
                    for m in range(MT):
                        if LDM:
                            addrs = [slot * STAGE_A + (wq0 + (l & 15)) * PITCH + (l >> 4) * 16 + m * 16 * PITCH
                                     + kk * 32 for l in range(32)]
                            for l in range(32):
                                for i in range(4):
                                    a[l, m, i] = u32(addrs[8 * i + l // 4] + (l % 4) * 4)
                        else:
                            for l in range(32):
                                g, t = l >> 2, l & 3
                                p = slot * STAGE_A + (wq0 + m * 16 + g) * PITCH + kk * 32 + t * 4
                                a[l, m] = [u32(p), u32(p + 8 * PITCH), u32(p + 16), u32(p + 8 * PITCH + 16)]
                    for p in range(NT // 2):
                        if LDM:
                            addrs = [S * STAGE_A + slot * STAGE_B + (wn0 + (l & 7) + ((l >> 4) << 3)) * PITCH
                                     + ((l >> 3) & 1) * 16 + p * 16 * PITCH + kk * 32 for l in range(32)]
                            for l in range(32):
                                r = [u32(addrs[8 * i + l // 4] + (l % 4) * 4) for i in range(4)]
                                b[l, 2 * p] = r[0:2]
                                b[l, 2 * p + 1] = r[2:4]
                        else:
                            for l in range(32):
                                g, t = l >> 2, l & 3
                                for h in range(2):
                                    qq = S * STAGE_A + slot * STAGE_B + (wn0 + (2 * p + h) * 8 + g) * PITCH + kk * 32 + t * 4
                                    b[l, 2 * p + h] = [u32(qq), u32(qq + 16)]
                    # mma per PTX fragment layouts
                    def halves(v):
                        return np.frombuffer(np.array(v, np.uint32).tobytes(), np.float16).astype(np.float64)
                    for m in range(MT):
                        A = np.zeros((16, 16))
                        for l in range(32):
                            g, t = l >> 2, l & 3
                            for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                                A[row, col:col + 2] = halves(a[l, m, i])
                        for n in range(NT):
                            B = np.zeros((16, 8))
                            for l in range(32):
                                g, t = l >> 2, l & 3
                                B[2 * t:2 * t + 2, g] = halves(b[l, n, 0])
                                B[2 * t + 8:2 * t + 10, g] = halves(b[l, n, 1])
                            D = A @ B
                            for l in range(32):
                                g, t = l >> 2, l & 3
                                acc[warp, l, m, n] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
            if kt == k_tiles - 1:
                r0 = (first_tile + tile) * BN
                for warp in range(WQN * WNN):
                    wq0, wn0 = (warp // WNN) * WQ, (warp % WNN) * WN
                    for l in range(32):
                        g, t = l >> 2, l & 3
                        for m in range(MT):
                            for h in range(2):
                                ql = wq0 + 16 * m + g + 8 * h
                                q = q0 + ql
                                for n in range(NT):
                                    for j in range(2):
                                        rl = wn0 + 8 * n + 2 * t + j
                                        r = r0 + rl
                                        c = acc[warp, l, m, n, 2 * h + j]
                                        acc[warp, l, m, n, 2 * h + j] = 0
                                        bound = e[q] * rows_s[tile % S, 1, rl] + f[q] if q < n_q else 0
                                        key = rows_s[tile % S, 0, rl] - 2 * c
                                        if r < n_rows and q < n_q and not (key - bound > thr[q]):
                                            slot_ = counts[q]
                                            counts[q] += 1
                                            if slot_ < capacity:
                                                surv[q, slot_] = r
            kt += 1
            if kt == k_tiles:
                kt, tile = 0, tile + 1
    return counts, surv


def check(n, dim, nq, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float16)
    q = rng.standard_normal((nq, dim)).astype(np.float16)
    rb = -(-dim * 2 // 16) * 16
    xp = np.zeros((n, rb // 2), np.float16)
    xp[:, :dim] = x
    qp = np.zeros((nq, rb // 2), np.float16)
    qp[:, :dim] = q
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    sq = (x64 ** 2).sum(1).astype(np.float32)
    rn = np.sqrt((x64 ** 2).sum(1)).astype(np.float32)
    key = sq[None, :].astype(np.float64) - 2 * q64 @ x64.T
    kth = np.sort(key, 1)[:, 4]
    e, f = np.full(nq, 1e-3, np.float32), np.zeros(nq, np.float32)
    good = True
    for tpb in (1, 2):
        counts, surv = run(xp, qp, sq, rn, 1, n, tpb, kth.astype(np.float32) + 1e-4, e, f, 400)
        for i in range(nq):
            want, got = set(np.nonzero(key[i] <= kth[i])[0]), set(surv[i, :counts[i]])
            if not want <= got or len(got) != counts[i]:
                good = False
                print("query", i, "missing", sorted(want - got)[:5])
        counts, surv = run(xp, qp, sq, rn, 1, n, tpb, np.full(nq, np.inf, np.float32), e, f, 400)
        every = all(sorted(surv[i, :counts[i]]) == list(range(n)) for i in range(nq))
        good &= every
        print(f"{n} x {dim}, {nq} queries, tiles/block {tpb}, {'ldmatrix' if LDM else 'plain loads'}: "
              f"survivors {'ok' if good else 'WRONG'}, infinite threshold keeps every row once: {every}")
    return good


if __name__ == "__main__":
    LDM = len(sys.argv) < 2 or sys.argv[1] == "ldm"
    sys.exit(0 if check(300, 40, 37) and check(260, 72, 150) else 1)
