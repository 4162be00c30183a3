"""Exact ground truth from files at any scale, and recall that knows ties.

- `groundtruth(base, queries, k, metric, device, ...)`: the float64 oracle's k-NN (or range) answer,
  streamed from memory-mapped files through tinyknn Indexes, resumable, written in the benchmarks' formats
  with each format's distance convention (`tinyknn.groundtruth.conventions`) and a JSON record.
- `recall(result_ids, gt, k, rule)`: recall under the rules of the benchmarks (ids only, big-ann's tie
  groups, ann-benchmarks' epsilon) and tinyknn's exact one (ties count, repeats do not).
- `compare(candidate, exact, base, queries)`: how a result or a published ground truth differs from the
  exact one: ties, float32 misorderings, real errors.
- The `tinyknn groundtruth` command: `tinyknn.groundtruth.command`.
"""

from .check import Comparison, compare
from .compute import groundtruth
from .recall import RULES, recall

__all__ = ["groundtruth", "recall", "compare", "Comparison", "RULES"]
