"""k = 100 on 1M x 768 float32, 100 queries (issue 13's row): the screen's survivors against its capacity
with the denser threshold sample for large k (gpu/screen.py sample_step), end to end against k = 10, and
the ids checked against a float64 torch oracle (ties by the smaller id).

    PYTHONPATH=$PWD python3 bench/probes/screen_large_k_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tinyknn  # noqa: E402


def main() -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="screen_large_k_probe.json")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    db = torch.randn(1_000_000, 768, device="cuda", generator=generator)
    q = torch.randn(100, 768, device="cuda", generator=generator)
    q_host = q.cpu().numpy()
    rows = []
    with tinyknn.Index(768, "l2", "float32", device="cuda") as index:
        index.add(db)
        screen = index._searcher._screen
        d64 = torch.cdist(q.double(), db.double()) ** 2
        for k in (10, 100):
            before = (screen.fallbacks, screen.queries)
            distances, ids = index.search(q_host, k)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                index.search(q_host, k)
                times.append(time.perf_counter() - t0)
            order = torch.argsort(d64, dim=1, stable=True)[:, :k].cpu().numpy()   # stable: ties by position = id
            rows.append(dict(k=k, ms=statistics.median(times) * 1e3, fallbacks=screen.fallbacks - before[0],
                             screened=screen.queries - before[1], ids_equal_torch_cdist_order=bool((order == ids).all())))
            print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
