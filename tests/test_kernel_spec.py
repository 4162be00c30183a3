"""KernelSpec: fields checked and normalised once per distinct set of given values, never skipped."""

from __future__ import annotations

import numpy as np
import pytest

from tinyknn.spec import KernelSpec


def test_specs_given_in_different_forms_are_one_spec():
    a = KernelSpec("l2", "float16", 768, 10, "verify", "sm_90", (("cap", 4096), ("b", 2)))
    b = KernelSpec("L2", "float16", np.int64(768), np.int32(10), "verify", "90", {"b": 2, "cap": np.int64(4096)})
    assert a == b and hash(a) == hash(b)
    assert (b.dim.__class__, b.k.__class__, b.arch, b.params) == (int, int, "sm_90", (("b", 2), ("cap", 4096)))


@pytest.mark.parametrize("good, bad, match", [
    ({"k": 1}, {"k": True}, "k must be between"),
    ({"k": 0}, {"k": False}, "k must be between"),
    ({"dim": 8}, {"dim": 8.0}, "dim must be a positive integer"),
    ({"arch": "sm_90"}, {"arch": "volta"}, "arch must look like"),
    ({"variant": "scan"}, {"variant": "scans"}, "variant must be one of"),
])
def test_a_bad_field_is_refused_even_after_an_equal_good_one(good, bad, match):
    fields = {"metric": "l2", "dtype": "float32", "dim": 8, "k": 4, "variant": "scan", "arch": "sm_80"}
    KernelSpec(**{**fields, **good})
    KernelSpec(**{**fields, **good})                  # the second is answered from the checked fields
    with pytest.raises((TypeError, ValueError), match=match):
        KernelSpec(**{**fields, **bad})


def test_unhashable_params_are_checked_every_time():
    spec = KernelSpec("ip", "float32", 16, 4, "tiled", "sm_80", {"bq": 64})
    assert spec.param("bq") == 64
    with pytest.raises(ValueError):
        KernelSpec("ip", "float32", 16, 4, "tiled", "sm_80", {"bq": "many"})


def test_trailing_arguments_name_only_what_a_spec_sets():
    from tinyknn.spec import trailing_arguments

    assert trailing_arguments(("false", "false"), (0, 0), ("false", "false")) == []
    assert trailing_arguments(("true", "false"), (0, 0), ("false", "false")) == ["true"]
    assert trailing_arguments(("false", "false"), (4, 0), ("false", "false")) == ["false", 4]
    assert trailing_arguments(("false", "false"), (0, 0), ("true", "false")) == ["false", 0, "true"]
