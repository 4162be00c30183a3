"""The value check of tinyknn._validate accepts and refuses exactly what its definition says (finite,
|x| <= 2**50, and within float16's range for a float16 index), for every input dtype."""

from __future__ import annotations

import numpy as np
import pytest

from tinyknn import _validate

LIMIT = _validate.MAX_ABS_VALUE


def exact_verdict(array: np.ndarray, storage: str) -> bool:
    """True when every value is finite and within the storage's limit (the definition)."""
    limit = _validate.FLOAT16_MAX if storage == "float16" else LIMIT
    values = array.astype(np.float64)
    return bool(np.all(np.isfinite(values)) and np.max(np.abs(values)) <= limit)


def verdict(array: np.ndarray, storage: str) -> bool:
    try:
        _validate.check_values(array, "x", storage)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("storage", ["float32", "float16"])
def test_check_agrees_with_the_definition(rng, dtype, storage):
    cases = [
        rng.standard_normal((7, 33)),
        np.full((3, 5), LIMIT),                          # exactly at the limit: accepted
        np.full((1000, 4), 2.0**49),                     # large values, each within the limit
        np.full((2, 3), 60000.0),                        # float16 storage's edge
        np.full((2, 3), 70000.0),                        # beyond float16
        np.full((2, 3), LIMIT * 1.001),                  # beyond 2**50
        np.full((1, 4), 1e300),                          # far beyond: refused
    ]
    for planted in (np.nan, np.inf, -np.inf):
        values = rng.standard_normal((5, 9))
        values[rng.integers(5), rng.integers(9)] = planted
        cases.append(values)
    for values in cases:
        with np.errstate(over="ignore"):
            array = np.asarray(values).astype(dtype)
        assert verdict(array, storage) == exact_verdict(array, storage), (array.dtype, storage, array.ravel()[:3])


def test_refusal_messages_name_the_problem():
    with pytest.raises(ValueError, match="NaN"):
        _validate.check_values(np.array([[1.0, np.nan]], np.float32), "queries", "float32")
    with pytest.raises(ValueError, match="infinity"):
        _validate.check_values(np.array([[1.0, -np.inf]], np.float32), "queries", "float32")
    with pytest.raises(ValueError, match=r"2\*\*50"):
        _validate.check_values(np.array([[3e15]], np.float64), "queries", "float32")
    with pytest.raises(ValueError, match="float16"):
        _validate.check_values(np.array([[7e4]], np.float32), "vectors to add", "float16")


def test_non_contiguous_input_is_checked_too():
    values = np.zeros((6, 8), np.float32)
    values[::2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        _validate.check_values(values[::2], "queries", "float32")
