"""What the adapters (tinyknn.faiss, tinyknn.sklearn) need from tinyknn.Index, checked at the call: a clear
NotImplementedError names the Index operation this tinyknn lacks (the index-operations issue adds remove,
get, contains, range_search and search(filter=)), so the adapters light up as they land."""

from __future__ import annotations

import inspect


def require(index, method: str, keyword: str | None = None):
    """index.<method>, bound; NotImplementedError if Index has no such method (or no such keyword)."""
    bound = getattr(index, method, None)
    if bound is None:
        raise NotImplementedError(
            f"tinyknn: this operation is not implemented yet: it needs tinyknn.Index.{method}(), "
            "which this version of tinyknn.Index does not have")
    if keyword is not None and keyword not in inspect.signature(bound).parameters:
        raise NotImplementedError(
            f"tinyknn: this operation is not implemented yet: it needs tinyknn.Index.{method}({keyword}=...), "
            f"which this version of tinyknn.Index does not take")
    return bound
