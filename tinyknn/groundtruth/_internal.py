"""What tinyknn.groundtruth takes from the layers below it (the index's exact merge, the input rounding).

- exact_distances: the contract's float64 distance of (query, row) pairs, the same bits as the kernels.
- merge_knn / merge_ranges: the exact merge of per-shard answers (float32 ties between shards ordered by
  their float64 distances, then by the smaller id).
- as_storage: a row block rounded to the index's storage dtype exactly as an add rounds it.
"""

from ..index.merge import exact_distances
from ..index.merge import knn as merge_knn
from ..index.merge import ranges as merge_ranges
from ..inputs.validate import as_storage

__all__ = ["exact_distances", "merge_knn", "merge_ranges", "as_storage"]
