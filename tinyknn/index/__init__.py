"""The Index and what it owns: ids, labels, removals, persistence, the label order, shards, the exact
merge of per-shard answers and prepared searches (Index.prepare_search, tinyknn.index.prepared). It hands the vector work to a searcher (tinyknn.cpu or tinyknn.gpu) and holds
no CUDA and no ctypes itself."""

from .index import Index

__all__ = ["Index"]
