"""The one place tinyknn.groundtruth reaches into tinyknn's private modules (a rename is a fix here only).

- exact_distances: the contract's float64 distance of (query, row) pairs, the same bits as the kernels.
- merge_knn / merge_ranges: the exact merge of per-shard answers (float32 ties between shards ordered by
  their float64 distances, then by the smaller id).
- as_storage: a row block rounded to the index's storage dtype exactly as an add rounds it.
"""

from tinyknn._dask_merge import exact_distances  # moves to tinyknn/index/merge.py
from tinyknn._dask_merge import knn as merge_knn
from tinyknn._dask_merge import ranges as merge_ranges
from tinyknn._validate import as_storage  # moves to tinyknn/inputs/validate.py

__all__ = ["exact_distances", "merge_knn", "merge_ranges", "as_storage"]
