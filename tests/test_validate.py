"""The value check of tinyknn.inputs.validate accepts and refuses exactly what its definition says (finite,
|x| <= 2**50, and within float16's range for a float16 index), for every input dtype."""

from __future__ import annotations

import numpy as np
import pytest

from tinyknn.inputs import validate as _validate

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


# -- the storage dtypes' input rules  -------------------------------------------------
def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float64 -> float32 (NumPy, to nearest) -> bfloat16 by integer arithmetic: round the float32 bits
    to their upper 16, to nearest, ties to even (kernels/ingest.cuh's cvt.rn.bf16.f32)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def test_bfloat16_storage_rounds_through_float32(rng):
    import ml_dtypes

    values = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 15, 5000),
                             [1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-40), 3 * 2**-9 + 2**-35]])   # double rounding cases
    out = np.empty(values.shape, dtype=ml_dtypes.bfloat16)
    _validate.to_storage(values, out)
    assert np.array_equal(out.view(np.uint16), bfloat16_bits(values))
    assert out.view(np.uint16)[-3] == 0x3F80                   # 1 + 2**-8 + 2**-30: a float32 tie, to even
    for source in (np.float16, np.float32, ml_dtypes.bfloat16):
        small = np.clip(values[:100], -6e4, 6e4).astype(source)
        assert np.array_equal(_validate.as_storage(small, out.dtype).view(np.uint16),
                              bfloat16_bits(small.astype(np.float64)))


def test_bfloat16_input_is_accepted_and_checked():
    import ml_dtypes

    rows = _validate.host_rows(np.ones((2, 3), ml_dtypes.bfloat16), 3, "bfloat16")
    assert rows.dtype.name == "bfloat16"
    assert _validate.host_queries(np.ones((2, 3), ml_dtypes.bfloat16), 3, True).dtype == np.float32
    with pytest.raises(ValueError, match="contains NaN"):
        _validate.host_rows(np.full((1, 3), np.nan, ml_dtypes.bfloat16), 3, "float32")
    with pytest.raises(ValueError, match="holds 2251799813685248.0 at row 0, column 0; tinyknn accepts \\|value\\| <= 2\\*\\*50"):
        _validate.host_rows(np.full((1, 3), 2.0**51), 3, "bfloat16")
    with pytest.raises(TypeError, match="float16, float32, float64 or bfloat16; got dtype int64"):
        _validate.host_rows(np.ones((1, 3), np.int64), 3, "bfloat16")


@pytest.mark.parametrize("storage", ["int8", "uint8"])
@pytest.mark.parametrize("kind", ["rows", "queries"])
def test_an_eight_bit_index_takes_integers_in_its_range(storage, kind):
    check = (lambda x: _validate.host_rows(x, 2, storage)) if kind == "rows" else \
        (lambda x: _validate.host_queries(x, 2, True, storage))
    info = np.iinfo(storage)
    what = "vectors to add" if kind == "rows" else "queries"
    for good in (np.array([[info.min, info.max]], np.int64), np.array([[info.min, 3]], np.float64),
                 np.array([[5, 7]], np.uint8), np.array([[0, 1]], np.float16), [[1, 2]]):
        out = check(good)
        if kind == "queries":
            assert out.dtype == np.float32 and np.array_equal(out, np.asarray(good, np.float64).astype(np.float32))
    for bad, value in ((np.array([[1.0, 2.5]]), "2.5"), (np.array([[info.max + 1, 0]], np.int32), str(info.max + 1)),
                       (np.array([[0.0, info.min - 1.0]]), str(float(info.min - 1))),
                       (np.array([[0.0, np.nan]]), "nan"), (np.array([[np.inf, 0.0]]), "inf")):
        with pytest.raises(ValueError, match=f"{what} holds .*{value}.* at row 0, column [01]; an {storage} index "
                                             f"takes integers in {info.min} .. {info.max} only"):
            check(bad)
    with pytest.raises(TypeError, match="integers \\(an 8-bit index\\) or float16"):
        check(np.ones((1, 2), bool))
    with pytest.raises(TypeError, match="got dtype complex128"):
        check(np.ones((1, 2), complex))


def test_the_offending_value_is_named_by_its_position():
    values = np.zeros((4, 3))
    values[2, 1] = 0.25
    with pytest.raises(ValueError, match="holds 0.25 at row 2, column 1"):
        _validate.host_rows(values, 3, "int8")


class FakeCuda:
    def __init__(self, typestr):
        self.__cuda_array_interface__ = {"shape": (2, 3), "typestr": typestr, "data": (1 << 20, False),
                                         "version": 3, "strides": None}


def test_eight_bit_cuda_inputs():
    """CUDA vectors of floats or int8/uint8 (the ingest kernel checks values); CUDA queries of the index's
    own dtype only (values need no check then)."""
    assert _validate.device_matrix(FakeCuda("|i1"), 3, "vectors to add", "int8").dtype == np.int8
    assert _validate.device_matrix(FakeCuda("<f4"), 3, "vectors to add", "uint8").dtype == np.float32
    assert _validate.device_matrix(FakeCuda("|u1"), 3, "queries", "uint8", queries=True).dtype == np.uint8
    with pytest.raises(TypeError, match="queries for a uint8 index on the GPU must be uint8 CUDA arrays"):
        _validate.device_matrix(FakeCuda("<f4"), 3, "queries", "uint8", queries=True)
    with pytest.raises(TypeError, match="got dtype int8"):
        _validate.device_matrix(FakeCuda("|i1"), 3, "vectors to add", "float32")


@pytest.mark.parametrize("values, storage, text", [
    # float16: 65504.001 rounds to 65504 but is beyond the largest float16; :g printed both as 65504
    (np.array([[1.0, -65504.001]]), "float16",
     "x holds -65504.001 at row 0, column 1, beyond float16's largest finite value 65504.0"),
    # just past 2**50: :g printed both as 1.1259e+15
    (np.array([[np.nextafter(2.0**50, np.inf)], [0.5]]), "float32",
     "x holds 1125899906842624.2 at row 0, column 0; tinyknn accepts \\|value\\| <= 2\\*\\*50 "
     "\\(1125899906842624.0\\)"),
    (np.array([[0.0, np.nextafter(np.float32(2.0**50), np.float32(np.inf))]], np.float32), "float32",
     "x holds 1125900041060352.0 at row 0, column 1; tinyknn accepts \\|value\\| <= 2\\*\\*50 \\(1125899906842624.0\\)"),
    # a finite float64 beyond float32: not "infinity"
    (np.full((2, 2), -1e39), "float32", "x holds -1e\\+39 at row 0, column 0, beyond float32's range "
     "\\(largest finite 3.4028234663852886e\\+38\\); tinyknn accepts"),
])
def test_the_numbers_in_a_refusal_differ_visibly(values, storage, text):
    with pytest.raises(ValueError, match=text):
        _validate.check_values(values, "x", storage)


class FakeTorchCuda:
    """What a torch CUDA tensor shows tinyknn's validation (no GPU needed: nothing is dereferenced)."""

    def __init__(self, shape, typestr="<f4", strides=None, requires_grad=False, error=None, dtype="torch.float32"):
        self.shape, self.typestr, self.strides, self.requires_grad = shape, typestr, strides, requires_grad
        self.error, self.dtype, self.copies = error, dtype, []

    @property
    def __cuda_array_interface__(self):
        if self.error is not None:
            raise self.error
        if self.requires_grad:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")
        return {"shape": self.shape, "typestr": self.typestr, "strides": self.strides, "data": (4096, False),
                "version": 2}

    def detach(self):
        return FakeTorchCuda(self.shape, self.typestr, self.strides)

    def contiguous(self):
        copy = FakeTorchCuda(self.shape, self.typestr)
        self.copies.append(copy)
        return copy


FakeTorchCuda.__module__ = "torch"          # tinyknn tells frameworks apart by the class's module


@pytest.mark.parametrize("strides", [(4, 12), (8, 8), (-12, 4), (12, 8)])
def test_a_cuda_array_whose_rows_the_kernels_cannot_read_is_copied_by_its_framework(strides):
    """Fortran order (4, 12), column steps (8, 8) and (12, 8), reversed rows (-12, 4): the framework's own
    contiguous copy is described instead (they used to be refused later: "pass a contiguous copy")."""
    strided = FakeTorchCuda((3, 3), strides=strides)
    described = _validate.device_matrix(strided, 3, "queries", queries=True)
    assert len(strided.copies) == 1 and described.obj is strided.copies[0] and described.c_contiguous
    readable = FakeTorchCuda((3, 3), strides=(24, 4))                   # rows apart, each contiguous
    assert _validate.device_matrix(readable, 3, "queries").obj is readable and not readable.copies


@pytest.mark.parametrize("fake, text", [
    (FakeTorchCuda((2, 3), error=KeyError("torch.float8_e4m3fn"), dtype="torch.float8_e4m3fn"),
     "of dtype torch.float8_e4m3fn cannot be read through __cuda_array_interface__ \\(KeyError"),
    (FakeTorchCuda((2, 3), typestr="<V2", dtype="torch.bfloat16"),
     "has dtype torch.bfloat16, which tinyknn does not read from CUDA memory; pass float16, float32 or float64"),
])
def test_cuda_arrays_of_dtypes_without_a_numpy_code_are_type_errors(fake, text):
    """torch's interface raises KeyError for float8 and says '<V2' for bfloat16: a KeyError and a
    TypeError naming dtype |V2 came out before."""
    with pytest.raises(TypeError, match=text):
        _validate.device_matrix(fake, 3, "queries", queries=True)


def test_a_torch_tensor_that_requires_grad_is_read_through_a_detached_view():
    """torch refuses __cuda_array_interface__ on a tensor that requires grad (a RuntimeError came out);
    tinyknn only reads the values, so it reads them through tensor.detach() (no copy)."""
    described = _validate.device_matrix(FakeTorchCuda((2, 3), requires_grad=True), 3, "queries", queries=True)
    assert described.shape == (2, 3) and described.dtype == np.float32 and not described.obj.requires_grad
