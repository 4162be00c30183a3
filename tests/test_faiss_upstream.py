"""FAISS's own flat-index tests (Debian's `faiss` source package) run against tinyknn.faiss.

`.ci/fetch_faiss_tests` fetches them (never committed) to FAISS_UPSTREAM_SRC (default
${TMPDIR:-/tmp}/tinyknn-faiss-tests); without them these tests skip, unless FAISS_UPSTREAM_REQUIRED=1
(.ci/run sets it) makes that a failure. They run in a subprocess with tests/faiss_shim first on the path,
so `import faiss` is tinyknn.faiss, on two backends: the real tinyknn.Index, where a test that needs an
operation the Index lacks (the index-operations issue) is an expected failure naming that operation, and
the model of those operations (tests/adapter_index_model.py), where every selected test must pass.

Deselected (they need FAISS's non-flat indexes or its internals), by name:
- test_index_composite.py TestRemove: test_remove_regular, test_remove_ondisk (IndexIVFFlat,
  OnDiskInvertedLists), test_remove (reads IndexFlat.codes, FAISS's raw storage), test_remove_id_map_binary
  (IndexBinaryFlat);
- test_search_params.py TestSelector: test_IVFFlat, test_IVFFlat_range_sorted, test_IVFPQ, test_IVFSQ,
  test_pretrans, test_SQ, test_HSNW.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
SOURCE = Path(os.environ.get("FAISS_UPSTREAM_SRC") or Path(os.environ.get("TMPDIR", "/tmp")) / "tinyknn-faiss-tests")
SELECTED = [
    *(f"test_index.py::TestIndexFlat::{name}" for name in (
        "test_with_blas", "test_noblas", "test_with_blas_ip", "test_noblas_ip", "test_noblas_reservoir",
        "test_with_blas_reservoir", "test_noblas_reservoir_ip", "test_with_blas_reservoir_ip")),
    "test_index.py::TestDistancesPositive::test_l2_pos",
    *(f"test_index_composite.py::TestRemove::{name}" for name in (
        "test_remove_id_map", "test_factory_idmap2_suffix", "test_factory_idmap2_prefix", "test_remove_id_map_2")),
    *(f"test_search_params.py::TestSelector::{name}" for name in (
        "test_Flat", "test_Flat_IP", "test_Flat_id_range", "test_Flat_IP_id_range", "test_Flat_id_array",
        "test_Flat_IP_id_array", "test_Flat_id_bitmap", "test_Flat_id_not")),
]
MISSING_OPERATION = "this operation is not implemented yet: it needs tinyknn.Index."


def _source_or_skip() -> Path:
    if (SOURCE / "tests" / "test_index.py").is_file() and (SOURCE / "contrib" / "datasets.py").is_file():
        return SOURCE
    reason = f"FAISS's tests are not in {SOURCE}: run .ci/fetch_faiss_tests {SOURCE}"
    if os.environ.get("FAISS_UPSTREAM_REQUIRED") == "1":
        pytest.fail(f"FAISS_UPSTREAM_REQUIRED=1 but {reason}", pytrace=False)
    pytest.skip(reason)


_outcomes: dict[str, dict[str, tuple[str, str]]] = {}


def _run(backend: str, tmp_dir: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} for one subprocess run of every selected test."""
    if backend in _outcomes:
        return _outcomes[backend]
    source = _source_or_skip()
    report = tmp_dir / f"faiss-{backend}.xml"
    env = {**os.environ, "FAISS_UPSTREAM_SRC": str(source),
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR / "faiss_shim"), str(source / "tests"), str(TESTS_DIR),
                                          str(TESTS_DIR.parent)])}
    if backend == "model":
        env["FAISS_SHIM_MODEL_INDEX"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--rootdir={source}", f"--junitxml={report}", *(str(source / "tests" / test) for test in SELECTED)]
    done = subprocess.run(command, cwd=tmp_dir, env=env, capture_output=True, text=True, timeout=600)
    if not report.is_file():
        pytest.fail(f"FAISS's tests did not run (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        *_, module, cls = case.get("classname").split(".")   # e.g. tests.test_index.TestIndexFlat
        name = f"{module}.py::{cls}::{case.get('name')}"
        problem = next(iter(case.findall("failure") + case.findall("error") + case.findall("skipped")), None)
        outcomes[name] = ("passed", "") if problem is None else (problem.tag, (problem.get("message") or "") +
                                                                   "\n" + (problem.text or "")[-2000:])
    _outcomes[backend] = outcomes
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["index", "model"], ids=["tinyknn.Index", "model-of-operations"])
@pytest.mark.parametrize("test", SELECTED)
def test_faiss_own_test(backend, test, tmp_path_factory):
    outcomes = _run(backend, tmp_path_factory.getbasetemp())
    assert test in outcomes, f"{test} was not collected; collected: {sorted(outcomes)}"
    outcome, message = outcomes[test]
    if outcome == "passed":
        return
    if backend == "index" and MISSING_OPERATION in message:
        needed = message.split(MISSING_OPERATION, 1)[1].split(",")[0]
        pytest.xfail(f"needs tinyknn.Index.{needed} (the index-operations issue)")
    pytest.fail(f"FAISS's {test} {outcome} on {backend}:\n{message}", pytrace=False)
