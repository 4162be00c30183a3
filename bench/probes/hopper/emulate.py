#!/usr/bin/env python3
"""CPU checks of hopper_screen.cuh's bookkeeping, for want of a GPU (no device run was possible when it
was written). Two models, both transliterating the kernel's index arithmetic:

1. data path: TMA boxes written with the 128-byte swizzle into a byte array per CTA (zero fill past the
   tensor, multicast into every CTA of a cluster), wgmma operands read back through the shared-memory
   descriptors the kernel builds (start + 1024 (row / 8) + 128 (row % 8) + K byte, the same swizzle),
   D distributed over the warpgroup's registers in the documented m64nN layout, and the epilogue's
   (query, row) mapping: the dump must equal Q X^T exactly, every (query, row) written once. This checks
   the kernel's offsets (query half of each WG, m blocks, K steps, multicast halves, tile walk), not the
   hardware: the swizzle and descriptor model are the PTX ISA's, as CUTLASS and DeepGEMM use them.
2. protocol: the mbarrier ring (full/empty per stage, the scalar ring, expect_tx/complete_tx, phase
   parities, remote arrivals of a cluster, the producer's tail) under random interleavings of the
   producer, the consumer warps of every CTA and the asynchronous copies: no deadlock, no slot written
   while a consumer of any CTA still needs its previous contents, every consumer reads the generation it
   waited for.

    python3 bench/probes/hopper/emulate.py
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_probe as rp  # noqa: E402


MUTATIONS: set = set()   # planted protocol bugs the model must catch (self-test): see mutation_test()


def swz(addr):
    """The 128-byte swizzle: 16-byte chunk bits [4:6] XOR row-in-atom bits [7:9] (1024-byte atoms)."""
    return addr ^ (((addr >> 7) & 7) << 4)


# ---- 1. data path ---------------------------------------------------------------------------------
def tma_box(targets, dst, tensor, c0_bytes, c1, box_rows):
    """Box of box_rows x 128 bytes at (byte column c0_bytes, row c1) of `tensor` (rows x row_bytes, uint8),
    zero past its end, swizzled into every smem of `targets` at dst."""
    rows, row_bytes = tensor.shape
    rr = np.arange(box_rows)[:, None]
    cb = np.arange(128)[None, :]
    gr, gc = c1 + rr, c0_bytes + cb
    inside = (gr < rows) & (gc < row_bytes)
    block = np.where(inside, tensor[np.minimum(gr, rows - 1), np.minimum(gc, row_bytes - 1)], 0).astype(np.uint8)
    where = swz(dst + rr * 128 + cb)
    for sm in targets:
        sm[where] = block


def read_operand(sm, start, rows, item):
    """The wgmma operand a K-major 128B-swizzle descriptor at `start` names: rows x 32 bytes."""
    r = np.arange(rows)[:, None]
    kb = np.arange(32)[None, :]
    raw = sm[swz(start + (r // 8) * 1024 + (r % 8) * 128 + kb)]
    return raw.copy().view(np.float16 if item == 2 else np.uint8).astype(np.float64)


def emulate_data(v: rp.Variant, n: int, dim: int, n_q: int, groups: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    item = rp.ITEMSIZE[v.elem]
    stride = -(-dim * item // 16) * 16 // item
    if item == 2:
        x = np.zeros((n, stride), np.float16)
        x[:, :dim] = rng.standard_normal((n, dim)).astype(np.float16)
        q = np.zeros((n_q, stride), np.float16)
        q[:, :dim] = rng.standard_normal((n_q, dim)).astype(np.float16)
    else:
        x = np.zeros((n, stride), np.uint8)
        x[:, :dim] = rng.integers(0, 256, (n, dim))
        q = np.zeros((n_q, stride), np.uint8)
        q[:, :dim] = rng.integers(0, 256, (n_q, dim))
    xb, qb = x.view(np.uint8).reshape(n, -1), q.view(np.uint8).reshape(n_q, -1)
    k_blocks = -(-stride * item // 128)
    exact = q.astype(np.float64) @ x.astype(np.float64).T

    TILE_Q, BN, CL, MW = v.tile_q, v.bn, v.cl, v.mw
    WG_Q, NACC = 64 * MW, BN // 2
    Q_BYTES, X_BYTES = TILE_Q * 128, BN * 128
    X_PART = BN // CL
    BK = 64 if item == 2 else 128
    n_qt = -(-n_q // TILE_Q)
    n_qg = -(-n_qt // CL)
    n_rt = -(-n // BN)
    total = n_qg * n_rt
    dump = np.full((n_q, n), np.nan)
    writes = np.zeros((n_q, n), np.int64)
    smem = [np.full(Q_BYTES + X_BYTES, 0xAB, np.uint8) for _ in range(CL)]   # one stage, stale bytes
    tid = np.arange(128)
    warp, lane = (tid >> 5) & 3, tid & 31
    g, t4 = lane >> 2, lane & 3
    reg = np.arange(NACC)
    frag_row = (16 * warp + g)[:, None] + 8 * ((reg >> 1) & 1)[None, :]          # [thread, reg]
    frag_col = (2 * t4)[:, None] + (8 * (reg >> 2) + (reg & 1))[None, :]
    for group in range(groups):
        i = 0
        accs = {}
        for t in range(group, total, groups):
            rt = t // n_qg
            qts = [(t % n_qg) * CL + rank for rank in range(CL)]
            # the WGs that take this tile (pingpong: local tile i goes to WG i % 2)
            wgs = [0, 1] if v.coop else [i % 2]
            for rank in range(CL):
                for c in wgs:
                    accs[(rank, c)] = np.zeros((MW, 128, NACC))
            for kb in range(k_blocks):
                for rank in range(CL):                                            # the producers
                    qt = qts[rank]
                    if qt * TILE_Q < n_q:
                        tma_box([smem[rank]], 0, qb, kb * BK * item, qt * TILE_Q, TILE_Q)
                    if CL == 1:
                        tma_box([smem[rank]], Q_BYTES, xb, kb * BK * item, rt * BN, BN)
                    else:
                        tma_box(smem, Q_BYTES + rank * X_PART * 128, xb, kb * BK * item, rt * BN + rank * X_PART,
                                X_PART)
                for rank in range(CL):                                            # the consumers
                    for c in wgs:
                        qoff = c * WG_Q if v.coop else 0
                        a_base, b_base = qoff * 128, Q_BYTES
                        for k in range(4):
                            for m in range(MW):
                                a = read_operand(smem[rank], a_base + m * 64 * 128 + k * 32, 64, item)
                                b = read_operand(smem[rank], b_base + k * 32, BN, item)
                                d = a @ b.T                                       # 64 x BN
                                part = d[frag_row, frag_col]
                                acc = accs[(rank, c)]
                                acc[m] = part if (kb | k) == 0 else acc[m] + part
            for rank in range(CL):                                                # the epilogues
                qt = qts[rank]
                for c in wgs:
                    qoff = c * WG_Q if v.coop else 0
                    acc = accs[(rank, c)]
                    q_first = qt * TILE_Q + qoff + 16 * warp + g
                    r_first = rt * BN + 2 * t4
                    for j in range(BN // 8):
                        for m in range(MW):
                            for h in range(2):
                                for bb in range(2):
                                    qq = q_first + 64 * m + 8 * h
                                    rr_ = r_first + 8 * j + bb
                                    ok = (qq < n_q) & (rr_ < n)
                                    dump[qq[ok], rr_[ok]] = acc[m, ok, 4 * j + 2 * h + bb]
                                    np.add.at(writes, (qq[ok], rr_[ok]), 1)
            i += 1
    return {"variant": v.name, "shape": [n, dim, n_q], "groups": groups, "k_blocks": k_blocks,
            "max_abs_diff": float(np.nanmax(np.abs(dump - exact))) if not np.isnan(dump).all() else None,
            "unwritten": int(np.isnan(dump).sum()), "written_twice": int((writes > 1).sum()),
            "ok": bool(np.array_equal(dump, exact) and (writes == 1).all())}


# ---- 2. protocol -----------------------------------------------------------------------------------
class Barrier:
    """mbarrier: expected arrivals per phase, pending arrivals, transaction count, phase parity."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, expect_tx=0):
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase ^= 1
            self.pending = self.count

    def done(self, parity):
        """try_wait.parity: the phase of this parity has completed (current phase parity differs)."""
        return self.phase != parity


def protocol(v: rp.Variant, n_tiles_total: int, k_blocks: int, groups: int, seed: int, q_tiles: int = 3,
             max_events: int = 5_000_000) -> dict:
    """Random interleavings of the kernel's agents; returns counts, raises AssertionError on a violation."""
    rng = random.Random(seed)
    S, SS, CL = v.stages, rp.SCALAR_SLOTS, v.cl
    CW = 8 if v.coop else 4
    n_qg = -(-q_tiles // CL)
    n_rt = max(1, n_tiles_total // n_qg)
    total = n_qg * n_rt
    STAGE, XB = 1000, 600                          # bytes of a stage, of its X part (model units)
    events = 0
    for group in range(groups):
        ctas = []
        for rank in range(CL):
            ctas.append({"full": [Barrier(1) for _ in range(S)], "empty": [Barrier(CW * CL) for _ in range(S)],
                         "sfull": [Barrier(1) for _ in range(SS)], "sempty": [Barrier(CW) for _ in range(SS)],
                         "slot": [None] * S, "readers": [set() for _ in range(S)], "sslot": [None] * SS,
                         "order": [Barrier(4), Barrier(4)], "sreaders": [set() for _ in range(SS)],
                         "alive": 1 + 8, "exited": False})
        tiles = list(range(group, total, groups))
        copies = []                                # in-flight async copies: (cta, kind, index, tag, nbytes)
        agents = []

        def producer(rank):
            cta = ctas[rank]
            pos = 0
            for i, t in enumerate(tiles):
                qt = (t % n_qg) * CL + rank
                b = i % SS
                while not cta["sempty"][b].done(((i // SS) & 1) ^ 1):
                    yield
                cta["sfull"][b].arrive(expect_tx=2)
                copies.append((rank, "scalars", b, i, 2))
                for kb in range(k_blocks):
                    s = pos % S
                    while not cta["empty"][s].done(((pos // S) & 1) ^ 1):
                        yield
                    has_q = qt < q_tiles
                    cta["full"][s].arrive(expect_tx=STAGE if has_q else XB)
                    if has_q:
                        copies.append((rank, "q", s, pos, STAGE - XB))
                    if CL == 1:
                        copies.append((rank, "x", s, pos, XB))
                    else:
                        for peer in range(CL):         # multicast: a part into every CTA
                            copies.append((peer, "x", s, pos, XB // CL))
                    pos += 1
                    yield
            if CL > 1 and "no_tail" not in MUTATIONS:
                for _ in range(S):
                    s = pos % S
                    while not cta["empty"][s].done(((pos // S) & 1) ^ 1):
                        yield
                    pos += 1
            finish(rank)

        def consumer(rank, c, w):
            cta = ctas[rank]
            for i, t in enumerate(tiles):
                if not v.coop and i % 2 != c:
                    continue
                if not v.coop and i > 0 and "no_order" not in MUTATIONS:
                    while not cta["order"][c].done(((i - 1) >> 1) & 1):
                        yield
                pos = i * k_blocks
                prev = None
                for kb in range(k_blocks):
                    s = pos % S
                    parity = (pos // S) & 1
                    if "consumer_parity_off" in MUTATIONS:
                        parity ^= 1
                    while not cta["full"][s].done(parity):
                        yield
                    assert cta["slot"][s] == ("complete", pos), f"consumer reads slot {s}: {cta['slot'][s]}, wants {pos}"
                    cta["readers"][s].add((c, w))
                    yield                                # the wgmma reads the slot asynchronously
                    if prev is not None:
                        release(rank, prev, (c, w))
                    prev = s
                    pos += 1
                if not v.coop:
                    cta["order"][1 - c].arrive()
                release(rank, prev, (c, w))
                b = i % SS
                while not cta["sfull"][b].done((i // SS) & 1):
                    yield
                assert cta["sslot"][b] == i, f"scalars of tile {cta['sslot'][b]} in slot {b}, want {i}"
                cta["sreaders"][b].add((c, w))
                yield                                    # the epilogue
                cta["sreaders"][b].discard((c, w))
                cta["sempty"][b].arrive()
            finish(rank)

        def finish(rank):
            ctas[rank]["alive"] -= 1
            if ctas[rank]["alive"] == 0:
                ctas[rank]["exited"] = True

        def release(rank, s, who):
            ctas[rank]["readers"][s].discard(who)
            ctas[rank]["empty"][s].arrive()
            for peer in range(1, CL):
                if "no_remote_arrive" in MUTATIONS:
                    break
                target = ctas[(rank + peer) % CL]
                assert not target["exited"], f"remote arrive on CTA {(rank + peer) % CL} after it exited"
                target["empty"][s].arrive()

        for rank in range(CL):
            agents.append(producer(rank))
            for c in range(2):
                for w in range(4):
                    agents.append(consumer(rank, c, w))
        landed = {}                                        # (cta, pos) -> bytes landed, for the slot tag
        while agents or copies:
            choices = len(agents) + (len(copies) if copies else 0)
            pick = rng.randrange(choices)
            events += 1
            assert events < max_events, "no progress (deadlock: every agent waits)"
            if pick >= len(agents):
                rank, kind, index, tag, nbytes = copies.pop(rng.randrange(len(copies)))
                cta = ctas[rank]
                assert not cta["exited"], f"a copy lands in CTA {rank} after it exited"
                if kind == "scalars":
                    assert not cta["sreaders"][index], f"scalar slot {index} overwritten while read"
                    cta["sslot"][index] = tag
                    cta["sfull"][index].complete_tx(nbytes)
                else:
                    # a write into a slot that a consumer of this CTA still reads: the hazard the ring prevents
                    assert not cta["readers"][index], \
                        f"slot {index} of CTA {rank} overwritten while read by {cta['readers'][index]}"
                    key = (rank, tag)
                    landed[key] = landed.get(key, 0) + nbytes
                    qt = (tiles[tag // k_blocks] % n_qg) * CL + rank
                    expected = STAGE if qt < q_tiles else XB
                    assert landed[key] <= expected, "more bytes than the stage holds"
                    cta["slot"][index] = ("complete", tag) if landed[key] == expected else ("partial", tag)
                    cta["full"][index].complete_tx(nbytes)
                continue
            agent = agents[pick]
            try:
                next(agent)
            except StopIteration:
                agents.pop(pick)
            # deadlock: every agent blocked and nothing in flight is detected as no state change; the
            # random walk then loops until the event cap, which the assert above turns into a failure
    return {"variant": v.name, "events": events, "tiles": len(range(0, total)), "k_blocks": k_blocks, "ok": True}


def mutation_test() -> list:
    """Each planted bug must be caught by the protocol model (else the model proves nothing)."""
    out = []
    cases = [("no_order", replace(rp.COOP, coop=False, stages=5), 12), ("no_remote_arrive", replace(rp.COOP, cl=2), 3),
             ("no_tail", replace(rp.COOP, cl=2), 3), ("consumer_parity_off", rp.COOP, 3)]
    for name, v, k_blocks in cases:
        MUTATIONS.clear()
        MUTATIONS.add(name)
        caught = False
        for seed in range(5):
            try:
                protocol(v, 9, k_blocks, 1, seed, max_events=200_000)
            except AssertionError as exc:
                caught = str(exc)
                break
        MUTATIONS.clear()
        out.append({"variant": f"mutation {name}", "ok": bool(caught), "caught": caught})
        print(f"mutation {name:22s} {'caught: ' + caught if caught else 'NOT CAUGHT'}", flush=True)
    return out


def main() -> int:
    results = []
    variants = [rp.COOP, replace(rp.COOP, mw=2, bn=128), replace(rp.COOP, coop=False, stages=5),
                replace(rp.COOP, coop=False, mw=2, bn=128, stages=6), replace(rp.COOP, cl=2),
                replace(rp.COOP, mw=2, bn=128, cl=2), replace(rp.COOP, elem="u8x"),
                replace(rp.COOP, elem="u8x", cl=2)]
    for v in variants:
        for n, dim, n_q, groups in ((700, 100, 150, 3), (520, 72, 300, 1)):
            r = emulate_data(v, n, dim, n_q, groups)
            results.append(r)
            print(f"data     {v.name:40s} {n}x{dim}x{n_q} groups {groups}: {'ok' if r['ok'] else 'FAIL'} "
                  f"(max diff {r['max_abs_diff']}, unwritten {r['unwritten']}, twice {r['written_twice']})", flush=True)
    for v in variants + [replace(rp.COOP, stages=2), replace(rp.COOP, cl=2, stages=2)]:
        for k_blocks, tiles, groups in ((1, 12, 2), (2, 9, 1), (12, 5, 2), (3, 20, 3)):
            for seed in range(3):
                try:
                    r = protocol(v, tiles, k_blocks, groups, seed)
                except AssertionError as exc:
                    r = {"variant": v.name, "ok": False, "error": str(exc)}
                results.append(r)
                if not r["ok"]:
                    print(f"protocol {v.name} k_blocks {k_blocks} tiles {tiles} seed {seed}: FAIL {r['error']}")
        mine = [x for x in results if x["variant"] == v.name and ("events" in x or "error" in x)]
        print(f"protocol {v.name:40s}: {'ok' if all(x['ok'] for x in mine) else 'FAIL'} ({len(mine)} runs)", flush=True)
    results += mutation_test()
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)}/{len(results)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
