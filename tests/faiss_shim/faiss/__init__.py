"""Import shim for running FAISS's own tests against tinyknn.faiss: `import faiss` resolves here.

Everything FAISS's tests call comes from tinyknn.faiss, except these harness settings, which tune FAISS's
own BLAS blocking and mean nothing to tinyknn (it has no BLAS path): `cvar.distance_compute_blas_*` are
accepted and stored (`omp_set_num_threads` is tinyknn.faiss's own). `faiss.contrib` (test helpers: datasets, evaluation) is FAISS's own, from the fetched source
named by FAISS_UPSTREAM_SRC.
"""

import os
import types

from tinyknn.faiss import *  # noqa: F401,F403
from tinyknn.faiss import __all__  # noqa: F401

__version__ = "1.7.3"   # the version of the tests being run, which test_version_attribute reads

cvar = types.SimpleNamespace(distance_compute_blas_query_bs=4096, distance_compute_blas_database_bs=1024,
                             distance_compute_blas_threshold=20)


__path__.append(os.environ["FAISS_UPSTREAM_SRC"])   # noqa: F821 - faiss.contrib from the fetched source

if os.environ.get("FAISS_SHIM_MODEL_INDEX") == "1":
    # tests/test_faiss_upstream.py's second backend: the model of the index-operations issue's Index API
    # (tests/adapter_index_model.py) in place of tinyknn.Index, so FAISS's tests check the adapter itself.
    import tinyknn.faiss.index
    from adapter_index_model import IndexWithOperations

    tinyknn.faiss.index.Index = IndexWithOperations
