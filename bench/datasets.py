"""Benchmark data: seeded random matrices, Fashion-MNIST, and the float64 ground truth that recall uses.

Fashion-MNIST comes from the Debian package `dataset-fashion-mnist` (the same 60,000 x 784 train and
10,000 x 784 test uint8 images as ann-benchmarks' fashion-mnist-784-euclidean). It is looked for in
`--fashion-mnist-dir`, then in the checkout's `.carry/fashion-mnist/` (how the files travel to a machine
without network), then where the package installs it; when it is nowhere and apt-get can be used, the
package is installed.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FASHION_PACKAGE = "dataset-fashion-mnist"
FASHION_PLACES = (REPO / ".carry" / "fashion-mnist", Path("/usr/share/datasets/fashion-mnist"))
FASHION_FILES = {"train": "train-images-idx3-ubyte", "test": "t10k-images-idx3-ubyte"}
FASHION_SHAPES = {"train": (60000, 784), "test": (10000, 784)}
U32 = 2.0 ** -23  # twice the float32 unit roundoff


def _fill_blocks(out: np.ndarray, seed_key: list[int], fill) -> None:
    """fill(rng, block) on every block of 32,768 rows, each block from its own seed, on all cores (the
    generators release the GIL): the values do not depend on the number of threads."""
    rows = 1 << 15
    seeds = np.random.SeedSequence(seed_key).spawn(-(-len(out) // rows))

    def one(block: int) -> None:
        fill(np.random.default_rng(seeds[block]), out[block * rows:(block + 1) * rows])

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        list(pool.map(one, range(len(seeds))))


def random_data(n_data: int, n_queries: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Standard-normal float32 database and queries (queries drawn apart from the database); 1M x 768
    takes seconds."""
    out = np.empty((n_data + n_queries, dim), dtype=np.float32)
    _fill_blocks(out, [seed, n_data, dim], lambda rng, part: rng.standard_normal(dtype=np.float32, out=part))
    return out[:n_data], out[n_data:]


CLUSTERS = 1024


def _generate(n_data, n_queries, dim, dtype, seed_key, fill):
    """(database, queries) filled from separate seeds: the database does not depend on how many queries."""
    db, queries = np.empty((n_data, dim), dtype=dtype), np.empty((n_queries, dim), dtype=dtype)
    _fill_blocks(db, seed_key + [0], fill)
    _fill_blocks(queries, seed_key + [1], fill)
    return db, queries


def _centres(dim: int, seed: int, scale) -> np.ndarray:
    return scale(np.random.default_rng([seed, dim, 99]), (CLUSTERS, dim))


def clustered_embeddings(n_data: int, n_queries: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit-norm float32 'sentence embeddings': 1,024 cluster centres sharing a mean direction (two random
    rows have cosine about 0.2), each row its centre plus isotropic noise of norm 0.75 (cosine about 0.8
    to the centre), normalised; queries are drawn the same way."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    def centres(rng, shape):
        mean = unit(rng.standard_normal(shape[1]))
        return unit(0.5 * mean + unit(rng.standard_normal(shape))).astype(np.float32)

    centre = _centres(dim, seed, centres)
    sigma = np.float32(0.75 / np.sqrt(dim))

    def fill(rng, part):
        rng.standard_normal(dtype=np.float32, out=part)
        part *= sigma
        part += centre[rng.integers(0, CLUSTERS, len(part))]
        part /= np.linalg.norm(part, axis=1, keepdims=True)

    return _generate(n_data, n_queries, dim, np.float32, [seed, n_data, dim, 1], fill)


def sift_like(n_data: int, n_queries: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 rows like SIFT descriptors: 1,024 centres with exponential coordinates (mean 25, a third of
    them 0), each row its centre plus normal noise (sd 8), rounded and clipped to 0..255; many zeros and
    exact distance ties, as in BIGANN. Queries are drawn the same way."""
    def centres(rng, shape):
        values = rng.exponential(25.0, shape)
        values[rng.random(shape) < 1 / 3] = 0.0
        return values.astype(np.float32)

    centre = _centres(dim, seed, centres)

    def fill(rng, part):
        noisy = centre[rng.integers(0, CLUSTERS, len(part))] + rng.standard_normal(part.shape, dtype=np.float32) * 8
        np.clip(np.rint(noisy), 0, 255, out=noisy)
        part[:] = noisy.astype(np.uint8)

    return _generate(n_data, n_queries, dim, np.uint8, [seed, n_data, dim, 2], fill)


def for_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The source data handed to an index of `dtype`: uint8 data shifted by -128 for int8 storage, else as is."""
    if dtype == "int8" and x.dtype == np.uint8:
        return (x.astype(np.int16) - 128).astype(np.int8)
    return x


GENERATED = {"random": random_data, "clustered": clustered_embeddings, "sift-like": sift_like}


# -- Fashion-MNIST ------------------------------------------------------------------------------
def _image_file(folder: Path, part: str) -> Path | None:
    for name in (FASHION_FILES[part] + ".gz", FASHION_FILES[part]):
        if (folder / name).is_file():
            return folder / name
    return None


def _install_package() -> str:
    """apt-get install the package; returns '' on success, else why not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "installing it needs root (apt-get install -y dataset-fashion-mnist)"
    quick_fail = ["-o", "Acquire::Retries=0", "-o", "Acquire::http::Timeout=15", "-o", "Acquire::https::Timeout=15"]
    for command in (["apt-get", *quick_fail, "update"], ["apt-get", *quick_fail, "install", "-y", FASHION_PACKAGE]):
        print(f"[fashion-mnist] {' '.join(command)}", flush=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} timed out"
        if done.returncode != 0 and command[-1] == FASHION_PACKAGE:
            return f"apt-get install failed: {done.stderr.strip()[-300:]}"
    return ""


def find_fashion_mnist(folder: str | Path | None = None, install: bool = True) -> tuple[Path | None, str]:
    """(folder holding both image files, '') or (None, why it was not found)."""
    places = [Path(folder)] if folder else list(FASHION_PLACES)
    for place in places:
        if all(_image_file(place, part) for part in FASHION_FILES):
            return place, ""
    looked = ", ".join(str(p) for p in places)
    if folder or not install:
        return None, f"no {FASHION_FILES['train']}[.gz] and {FASHION_FILES['test']}[.gz] in {looked}"
    why = _install_package()
    if not why and all(_image_file(FASHION_PLACES[-1], part) for part in FASHION_FILES):
        return FASHION_PLACES[-1], ""
    return None, f"not in {looked}, and installing {FASHION_PACKAGE} did not help: {why or 'files still missing'}"


def read_idx_images(path: Path) -> np.ndarray:
    """An IDX3 uint8 image file (optionally gzipped) as an (n, rows * cols) uint8 matrix."""
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    magic, count, rows, cols = np.frombuffer(raw[:16], dtype=">u4")
    if magic != 0x803 or len(raw) != 16 + int(count) * int(rows) * int(cols):
        raise ValueError(f"{path} is not an IDX3 uint8 image file (magic {magic:#x}, {len(raw)} bytes)")
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(int(count), int(rows) * int(cols))


def load_fashion_mnist(folder: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train (60000, 784) uint8, test (10000, 784) uint8, provenance: files and content sha256)."""
    parts, about = {}, {"folder": str(folder)}
    for part in FASHION_FILES:
        path = _image_file(folder, part)
        images = read_idx_images(path)
        if images.shape != FASHION_SHAPES[part]:
            raise ValueError(f"{path}: {images.shape} images, expected {FASHION_SHAPES[part]}")
        parts[part] = images
        about[part] = {"file": path.name, "shape": list(images.shape),
                       "sha256_of_pixels": hashlib.sha256(images.tobytes()).hexdigest()}
    return parts["train"], parts["test"], about


class DataUnavailable(Exception):
    """A data set the sweep asks for cannot be had here; the message says why."""


class PanelData:
    """The database and queries of the panel being measured; one kept at a time (1M x 768 is 3 GB).

    Fashion-MNIST is located (and installed, where allowed) once, on first use.
    """

    def __init__(self, fashion_dir: str | None = None, install: bool = True):
        self.fashion_dir, self.install = fashion_dir, install
        self.key, self.value = None, None
        self.fashion: tuple[np.ndarray, np.ndarray] | None = None
        self.fashion_about: dict | str | None = None   # provenance, or why it is missing

    def get(self, data: str, n_data: int, dim: int, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
        """(database float32, queries float32 with at least n_queries rows), or DataUnavailable."""
        key = (data, n_data, dim)
        if self.key != key or len(self.value[1]) < n_queries:
            self.key, self.value = None, None  # free the previous panel's data first
            self.value, self.key = self._load(data, n_data, dim, n_queries), key
        return self.value

    def _load(self, data, n_data, dim, n_queries):
        if data in GENERATED:
            return GENERATED[data](n_data, n_queries, dim)
        if data != "fashion-mnist":
            raise ValueError(f"data must be one of {', '.join(GENERATED)}, 'fashion-mnist'; got {data!r}")
        if self.fashion_about is None:
            folder, why = find_fashion_mnist(self.fashion_dir, install=self.install)
            self.fashion_about = why
            if folder is not None:
                train, test, self.fashion_about = load_fashion_mnist(folder)
                self.fashion = (train.astype(np.float32), test.astype(np.float32))
        if self.fashion is None:
            raise DataUnavailable(f"Fashion-MNIST not found: {self.fashion_about}")
        return self.fashion


# -- ground truth ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Truth:
    """Exact k-NN distances of the first `rows` queries in float64, with a float32 tolerance per row.

    The data are taken as the index stores them: the database rounded to its dtype, queries in float32.
    """

    kth: np.ndarray        # (rows, k) exact distances, best first
    tolerance: np.ndarray  # (rows,) how far a returned distance may sit past the k-th and count as a tie
    metric: str


def _distances(q64: np.ndarray, x64: np.ndarray, x_norm2: np.ndarray, metric: str) -> np.ndarray:
    """Exact float64 distances (queries, rows of x); the expansion in float64 is far below float32 error."""
    ip = q64 @ x64.T
    if metric == "ip":
        return ip
    if metric == "cosine":
        scale = np.sqrt(np.einsum("ij,ij->i", q64, q64))[:, None] * np.sqrt(x_norm2)[None, :]
        return np.divide(ip, scale, out=np.zeros_like(ip), where=scale > 0)
    if metric != "l2":
        raise ValueError(f"the benchmark's ground truth knows metrics 'l2', 'ip', 'cosine'; got {metric!r}")
    return np.einsum("ij,ij->i", q64, q64)[:, None] + x_norm2[None, :] - 2.0 * ip


def _norm2(x64: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", x64, x64)


def ground_truth(db: np.ndarray, queries: np.ndarray, k: int, metric: str, rows: int = 100,
                 block_rows: int = 32768) -> Truth:
    """Exact k best distances of queries[:rows] against `db` (already in the stored dtype), in blocks."""
    q64 = np.asarray(queries[:rows], dtype=np.float32).astype(np.float64)
    sign = 1.0 if metric == "l2" else -1.0          # work with "smaller is better" keys
    best = np.full((len(q64), 0), np.inf)
    max_norm2 = 0.0
    for start in range(0, len(db), block_rows):
        x64 = db[start:start + block_rows].astype(np.float64)
        x_norm2 = _norm2(x64)
        max_norm2 = max(max_norm2, float(x_norm2.max()))
        keys = np.concatenate([best, sign * _distances(q64, x64, x_norm2, metric)], axis=1)
        take = min(k, keys.shape[1])
        best = np.partition(keys, take - 1, axis=1)[:, :take]
    return truth_from(sign * np.sort(best, axis=1), q64, max_norm2, db.shape[1], metric)


def truth_from(kth: np.ndarray, q64: np.ndarray, max_norm2: float, dim: int, metric: str) -> Truth:
    """A Truth from exact k best distances (e.g. the oracle's), with each row's float32 tolerance."""
    q_norm2 = _norm2(q64[:len(kth)])
    if metric == "ip":   # |error of a float32 dot product| <= dim * u * |q| |x|
        tolerance = dim * U32 * np.sqrt(q_norm2 * max_norm2)
    elif metric == "cosine":  # that of the dot product over the norms, and of the two norms
        tolerance = np.full(len(kth), (dim + 4) * U32 * 2)
    else:                # error of |q|^2 + |x|^2 - 2 q.x, with |x| <= |q| + sqrt(d_k) for every true neighbour
        x_norm = np.sqrt(q_norm2) + np.sqrt(np.maximum(kth[:, -1], 0.0))
        tolerance = dim * U32 * (q_norm2 + x_norm ** 2)
    return Truth(kth=kth, tolerance=tolerance + 1e-30, metric=metric)


def recall(ids: np.ndarray, truth: Truth, db: np.ndarray, queries: np.ndarray, rows_of=None) -> float:
    """Share of returned ids (over the truth's rows) that are distinct, real and no farther than the k-th
    exact neighbour plus the float32 tolerance: a tie with the k-th neighbour counts as correct.
    rows_of(ids) gives the stored rows in float64 (default: db's rows, db already in the stored dtype)."""
    rows_of = rows_of or (lambda valid: db[valid].astype(np.float64))
    rows, k = min(len(truth.kth), len(ids)), truth.kth.shape[1]
    ids = np.asarray(ids)[:rows, :k].astype(np.int64)
    q64 = np.asarray(queries[:rows], dtype=np.float32).astype(np.float64)
    correct = 0
    for row in range(rows):
        row_ids = ids[row]
        valid = np.unique(row_ids[(row_ids >= 0) & (row_ids < len(db))])
        if len(valid) == 0:
            continue
        x64 = rows_of(valid)
        dist = _distances(q64[row:row + 1], x64, _norm2(x64), truth.metric)[0]
        limit, slack = truth.kth[row, -1], truth.tolerance[row]
        ok = dist >= limit - slack if truth.metric != "l2" else dist <= limit + slack
        correct += int(np.count_nonzero(ok))
    return correct / (rows * k)
