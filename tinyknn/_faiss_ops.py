"""What tinyknn.faiss needs from tinyknn.Index, checked at the call: a clear NotImplementedError names
the Index operation this tinyknn lacks (the index-operations issue adds remove, get, contains,
range_search and search(filter=)), so the adapter lights up as they land."""

from __future__ import annotations

import inspect

from .errors import TinyKnnError


class FaissError(TinyKnnError):
    """What FAISS raises as RuntimeError: a missing key, an operation this kind of index does not have."""


def require(index, method: str, keyword: str | None = None):
    """index.<method>, bound; NotImplementedError if Index has no such method (or no such keyword)."""
    bound = getattr(index, method, None)
    if bound is None:
        raise NotImplementedError(
            f"tinyknn.faiss: this operation is not implemented yet: it needs tinyknn.Index.{method}(), "
            "which this version of tinyknn.Index does not have")
    if keyword is not None and keyword not in inspect.signature(bound).parameters:
        raise NotImplementedError(
            f"tinyknn.faiss: this operation is not implemented yet: it needs tinyknn.Index.{method}({keyword}=...), "
            f"which this version of tinyknn.Index does not take")
    return bound
