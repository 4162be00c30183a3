"""bench/index_ops.py's output: the results payload, the figure and the markdown table of its target rows."""

from __future__ import annotations

import time

import numpy as np

import _common


def payload(bench) -> dict:
    """Everything measured so far, with the settings, the set-up and what was skipped."""
    args = bench.args
    from tinyknn.config import get_config

    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "data": f"{args.rows:,} x {args.dim} float32 standard normal (seed {args.seed}), l2, ids 0..n-1 given, "
                "labels uniform in 0..99; queries drawn apart from the database",
        "cpu_threads": get_config().cpu_threads,
        "setup": bench.setup,
        "rows": bench.rows,
        "exactness": bench.checks,
        "all_exact": all(c["ids_agree"] == 1.0 and c["distances_bitwise"] for c in bench.checks),
        "timings_us": bench.timings,
        "skipped": bench.skipped,
        "wall_s": time.perf_counter() - bench.started,
    }


def _used(row: dict) -> float:
    """How much of its target a row uses: below 1 is met (measured / limit for <=, limit / measured for >=)."""
    measured, limit = row["measured"], row["limit"]
    if row["direction"] == "<=":
        return measured / limit
    return limit / measured if measured > 0 else float("inf")


def plot(bench):
    """One bar per target row: the share of the target it uses (log scale; left of the line is met)."""
    if not bench.rows:
        return None
    plt = _common.pyplot()
    rows = bench.rows[::-1]
    figure, axes = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    used = np.array([_used(r) for r in rows])
    colours = ["tab:green" if r["met"] else "tab:red" for r in rows]
    bars = axes.barh(range(len(rows)), used, color=colours)
    for bar, row in zip(bars, rows):
        if not row["target_applies"]:
            bar.set_alpha(0.35)
            bar.set_hatch("//")
        axes.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2,
                  f"{row['measured']:.3g} {row['unit']} (target {row['target']})", va="center", fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlim(min(used.min(), 0.5) / 2, max(used.max(), 2.0) * 20)
    axes.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    axes.set_xlabel("share of the target used (< 1: met); hatched: the issue states this target for the other device")
    args = bench.args
    axes.set_title(f"tinyknn index operations, {args.device}: {args.rows:,} x {args.dim} float32 l2 "
                   f"(all answers checked exact: {payload(bench)['all_exact']})", fontsize=10)
    return figure


def markdown(bench) -> str:
    """The target rows as a markdown table (README's form)."""
    lines = [f"| {bench.args.device}: target row | measured | target | met |", "| --- | --- | --- | --- |"]
    for row in bench.rows:
        met = ("yes" if row["met"] else "**no**") if row["target_applies"] else f"({'yes' if row['met'] else 'no'}; " \
            f"a {row['target_devices']} target)"
        lines.append(f"| {row['name']} | {row['measured']:.3g} {row['unit']} | {row['target']} | {met} |")
    checks = bench.checks
    lines.append(f"\nExactness: {sum(c['ids_agree'] == 1.0 and c['distances_bitwise'] for c in checks)} of "
                 f"{len(checks)} checks agree with the float64 oracle (ids and distance bits).")
    if bench.skipped:
        lines.append("Skipped: " + "; ".join(f"{s['section']} ({s['why']})" for s in bench.skipped))
    return "\n".join(lines)
