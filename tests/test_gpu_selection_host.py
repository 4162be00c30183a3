"""The host side of the GPU's device-side selection and removals (no GPU needed): segment sizes and offsets,
the selection kernels' specs, and which cached plans a removal builds again."""

from __future__ import annotations

import numpy as np
import pytest

from tinyknn.gpu import ranges
from tinyknn.gpu.row_ops import _whole_index_batch
from tinyknn.gpu.searcher import Rows
from tinyknn.jit import cuda_source, render, search_kernels


def test_segment_sizes_are_the_next_powers_of_two():
    counts = np.array([0, 1, 2, 3, 4, 5, 100, 128, 129, 12_333, 2**20, 2**20 + 1])
    np.testing.assert_array_equal(ranges.segment_sizes(counts),
                                  [0, 1, 2, 4, 4, 8, 128, 128, 256, 16_384, 2**20, 2**21])
    assert ranges.segment_sizes(np.zeros(0, np.int64)).shape == (0,)


def test_offsets_are_csr():
    np.testing.assert_array_equal(ranges.offsets(np.array([3, 0, 5])), [0, 3, 3, 8])
    assert ranges.offsets(np.array([], np.int64)).tolist() == [0]


def test_selection_specs_name_plain_kernels():
    names = {spec.variant: cuda_source.name_expression(spec) for spec in render.selection_specs("sm_90")}
    assert names == {"select": "tinyknn::select_kernel", "scatter": "tinyknn::scatter_kernel",
                     "segment_sort": "tinyknn::segment_sort_kernel"}
    every = search_kernels.specs_for_search("l2", "float32", 128, 10, "sm_90")
    assert all(s in every for s in render.selection_specs("sm_90"))
    with pytest.raises(ValueError, match="variant must be one of 'select', 'scatter', 'segment_sort'; got 'sort'"):
        render.selection_spec("sort", "sm_90")


def test_a_removal_rebuilds_only_whole_index_host_batches():
    assert _whole_index_batch((1, 10, "host", False, Rows("", 1000)))
    assert _whole_index_batch((64, 2048, "host", True, Rows("", 5)))
    assert not _whole_index_batch((1, 10, "host", False, Rows("sub_", 10)))      # a filter's gathered rows
    assert not _whole_index_batch((1, 10, "host", False, Rows("run", 10, 5)))    # a run of rows read in place
    assert not _whole_index_batch((1, 10, "host", False, Rows("list", 10)))      # listed rows read in place
    assert not _whole_index_batch((1, 10, "host", False, Rows("", 1000), "plan"))  # a plan, not a batch
    assert not _whole_index_batch((1, 10, "device", False, Rows("", 1000)))


def test_range_spec_takes_a_forced_block_of_queries():
    assert render.range_spec("l2", "float32", 128, "sm_90").param("qb") == 8
    assert render.range_spec("l2", "float32", 128, "sm_90", 32).param("smem") == 32 * 128 * 4
    with pytest.raises(ValueError, match="qb must be an int in \\[1, 64\\].*got 0"):
        render.range_spec("l2", "float32", 128, "sm_90", 0)
