"""How often the float64 verify cannot prove the screen's candidates, per margin (issue 12's margin choice).

    python3 bench/probes/screen_margin.py [--margins 0,1,2,4,8]

Builds the CPU library once per base margin (-DTINYKNN_SCREEN_MARGIN; the margin is base + k / 16) and
counts exact fallbacks (queries searched exhaustively) on: 100,000 x 128 standard normal, 1,000 queries,
k = 10 (the headline shape); FAISS's near-tie case (1,000 x 32, 200 queries, k = 150); scikit-learn's
digits, every row searched, k = 10 (integer data, exact ties). Prints one line per (margin, data set).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tinyknn
from tinyknn.cpu import build, library


def data_sets():
    rng = np.random.default_rng(3)
    yield "normal 100k x 128, 1000 q, k=10", rng.standard_normal((100_000, 128)), rng.standard_normal((1000, 128)), 10
    yield "faiss near-tie 1000 x 32, 200 q, k=150", rng.standard_normal((1000, 32)), rng.standard_normal((200, 32)), 150
    try:
        from sklearn.datasets import load_digits

        digits = load_digits().data
        yield "digits 1797 x 64, every row, k=10", digits, digits, 10
    except ImportError:
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--margins", default="0,1,2,4,8")
    args = parser.parse_args()
    base_flags = build.FLAGS
    sets = [(name, db.astype(np.float32), q.astype(np.float32), k) for name, db, q, k in data_sets()]
    for margin in (int(m) for m in args.margins.split(",")):
        build.FLAGS = base_flags + (f"-DTINYKNN_SCREEN_MARGIN={margin}",)
        library.reset_library()
        for name, db, q, k in sets:
            for metric in ("l2", "ip", "cosine"):
                index = tinyknn.Index(db.shape[1], metric=metric)
                index.add(db)
                start = time.perf_counter()
                index.search(q, k)
                elapsed = time.perf_counter() - start
                print(f"margin {margin} + k/16: {name}, {metric}: {index._searcher.exact_fallbacks()} of {len(q)} "
                      f"exhaustive ({elapsed * 1e3:.0f} ms)", flush=True)
                index.close()


if __name__ == "__main__":
    main()
