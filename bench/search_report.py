"""What bench/search.py shows of its rows: the figure, the plain table, and the README-ready markdown table."""

from __future__ import annotations

import _common


def plot(rows, panels, peer_order):
    """Latency against nq on log axes, one panel per configuration, one line per peer and mode; the legend
    gives a peer's worst strict id agreement with float64 where it is below 1."""
    plt = _common.pyplot()
    panels = [p for p in panels if any(r["config"] == p for r in rows)]
    cols = min(3, len(panels))
    lines = -(-len(panels) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5.2 * cols, 3.9 * lines), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        mine = [r for r in rows if r["config"] == panel]
        if len({r["nq"] for r in mine}) == 1:
            _bars(ax, mine, panel, peer_order)
            continue
        for peer, mode in dict.fromkeys((r["peer"], r["mode"]) for r in mine):
            points = sorted((r["nq"], r["median_ms"], r["agreement"]) for r in mine
                            if (r["peer"], r["mode"]) == (peer, mode))
            known = [a for _, _, a in points if a is not None]
            worst = min(known) if known else None
            label = (peer + (" (device-resident)" if mode == "device" else "")
                     + (f", ids {worst:.4f}" if worst is not None and worst < 1 else ""))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    color=f"C{peer_order.index(peer) % 10}", linestyle="--" if mode == "device" else "-")
        ax.set(xscale="log", yscale="log", xlabel="queries per call (nq)", ylabel="median latency (ms)", title=panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def _bars(ax, mine, panel, peer_order):
    """A panel measured at one nq: a bar per peer and mode, labelled with its time and agreement."""
    labels = [r["peer"] + (" (resident)" if r["mode"] == "device" else "") for r in mine]
    ax.barh(labels, [r["median_ms"] for r in mine],
            color=[f"C{peer_order.index(r['peer']) % 10}" if r["peer"] in peer_order else "C9" for r in mine])
    for y, r in enumerate(mine):
        ax.text(r["median_ms"], y, f" {_ms(r['median_ms'])} ms, ids {_fraction(r['agreement'])}", va="center",
                fontsize=7)
    times = [r["median_ms"] for r in mine]
    ax.set(xscale="log", xlim=(min(times) / 3, max(times) * 12), xlabel="median latency (ms)",
           title=f"{panel}, nq={mine[0]['nq']:,}")
    ax.invert_yaxis()
    ax.grid(True, axis="x", which="both", alpha=0.3)


def _points(rows):
    """{(config, nq, mode): {peer: row}} in the order measured."""
    points = {}
    for r in rows:
        points.setdefault((r["config"], r["nq"], r["mode"]), {})[r["peer"]] = r
    return points


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _order(rows, peer_order):
    seen = set(r["peer"] for r in rows)
    return [p for p in peer_order if p in seen] + sorted(seen - set(peer_order))


def _fraction(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def table(rows, peer_order=()) -> str:
    """One line per (panel, nq, mode); a column per peer: median ms, strict id agreement, recall."""
    peers = _order(rows, peer_order)
    lines = [f"{'configuration':<40} {'nq':>6} {'mode':<6} " + " ".join(f"{p:>28}" for p in peers),
             f"{'':<40} {'':>6} {'':<6} " + " ".join(f"{'ms (ids equal, recall)':>28}" for _ in peers)]
    for (config, nq, mode), cells in _points(rows).items():
        text = {p: f"{_ms(r['median_ms'])} ({_fraction(r['agreement'])}, {_fraction(r['recall'])})"
                for p, r in cells.items()}
        lines.append(f"{config:<40} {nq:>6} {mode:<6} " + " ".join(f"{text.get(p, '-'):>28}" for p in peers))
    return "\n".join(lines)


def markdown(rows, skipped, peer_order=()) -> str:
    """README-ready: a row per workload, a column per peer, each cell 'median ms (strict id agreement)'."""
    peers = _order(rows, peer_order)
    out = ["| workload | nq | " + " | ".join(peers) + " |", "| --- | ---: | " + " | ".join("---" for _ in peers) + " |"]
    for (config, nq, mode), cells in _points(rows).items():
        label = config + (" (device-resident)" if mode == "device" else "")
        text = [f"{_ms(cells[p]['median_ms'])} ms ({_fraction(cells[p]['agreement'])})" if p in cells else ""
                for p in peers]
        out.append(f"| {label} | {nq:,} | " + " | ".join(text) + " |")
    out.append("")
    out.append("Cells: median latency, host NumPy in and out (in brackets: the share of result ids equal, position "
               "by position, to the float64 oracle's, ties by the smaller id). Empty: skipped (reasons in the JSON).")
    refused = sorted({f"{s['peer']}: {s['reason']}" for s in skipped if s.get("nq") is None})
    if refused:
        out.append("")
        out += [f"- skipped {item}" for item in refused]
    return "\n".join(out)
