"""Shards on a Dask cluster: DaskIndex holds an exact index's rows in shards on the workers (index.py), each
shard a tinyknn.Index inside a Dask actor (shard.py) handled from the client (shards.py); the answers are
merged exactly by tinyknn.index.merge.

    from distributed import Client, LocalCluster
    from tinyknn.dask import DaskIndex
    index = DaskIndex(Client(LocalCluster()), dim=128, metric="l2")
"""

from .index import DaskIndex
from .shards import ShardUnavailable

__all__ = ["DaskIndex", "ShardUnavailable"]
