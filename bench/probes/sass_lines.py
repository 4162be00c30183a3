#!/usr/bin/env python3
"""Where a kernel's issued instructions and stall samples go, from Nsight Compute's source page of it as CSV
(`hopper_knobs.sh sass` writes one, xz-compressed): the opcodes' shares of the instructions executed, the runs of
lines executed equally often (basic blocks) that execute the most, and the stall reasons of the consumer warps'
code against the producer's (split at the producer's setmaxnreg, the first USETMAXREG.DEALLOC line).

    python3 bench/probes/sass_lines.py bench/results/logs/ncu_sass_lines_uint8_<date>_nvidia-h200_<tree>.csv.xz
"""
from __future__ import annotations

import argparse
import collections
import csv
import lzma
import re

EXECUTED, SAMPLES, SOURCE = "Instructions Executed", "Warp Stall Sampling (All Samples)", "Source"


def read(path: str) -> tuple[list[str], list[dict]]:
    """(the SASS lines, each line's counts by column)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = rows[1]                      # rows[0]: the kernel's name
    lines = [dict(zip(header, row)) for row in rows[2:]]
    return [line[SOURCE].strip() for line in lines], lines


def count(line: dict, column: str) -> int:
    return int(line.get(column) or 0)


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: `@!P0 IMAD.MOV.U32 ...` -> IMAD."""
    stripped = re.sub(r"^@!?U?P\w+\s+", "", source)
    return stripped.split()[0].split(".")[0] if stripped else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.xz)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    sources, lines = read(args.csv)
    executed = [count(line, EXECUTED) for line in lines]
    total = sum(executed)
    print(f"{len(lines)} SASS lines, {total:,} warp instructions executed, "
          f"{sum(count(line, SAMPLES) for line in lines):,} stall samples")
    by_opcode, samples_by_opcode = collections.Counter(), collections.Counter()
    for source, line, n in zip(sources, lines, executed):
        by_opcode[opcode(source)] += n
        samples_by_opcode[opcode(source)] += count(line, SAMPLES)
    all_samples = sum(samples_by_opcode.values()) or 1
    print("opcode      executed  samples")
    for name, n in by_opcode.most_common(args.top):
        print(f"{name:10s} {n / total:8.1%} {samples_by_opcode[name] / all_samples:8.1%}")
    blocks, start = [], 0
    for i in range(1, len(lines) + 1):
        if i == len(lines) or executed[i] != executed[start]:
            blocks.append((start, i))
            start = i
    blocks.sort(key=lambda b: -(b[1] - b[0]) * executed[b[0]])
    print("lines          executions a line  share  opcodes")
    for first, end in blocks[:args.top]:
        ops = collections.Counter(opcode(sources[j]) for j in range(first, end)).most_common(6)
        print(f"{first:5d}-{end - 1:<5d} {executed[first]:>17,} {(end - first) * executed[first] / total:6.1%}  "
              + " ".join(f"{name}:{n}" for name, n in ops))
    split = next((i for i, s in enumerate(sources) if s.startswith("USETMAXREG.DEALLOC")), len(lines))
    reasons = [c for c in lines[0] if c.startswith("stall_") and "Not Issued" not in c]
    for role, span in (("consumers (and setup)", range(split)), ("producer", range(split, len(lines)))):
        samples = sum(count(lines[i], SAMPLES) for i in span) or 1
        shares = {r[6:]: sum(count(lines[i], r) for i in span) / samples for r in reasons}
        print(f"{role}: {sum(executed[i] for i in span) / total:.1%} of instructions; stalls "
              + ", ".join(f"{r} {v:.0%}" for r, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.02))


if __name__ == "__main__":
    main()
