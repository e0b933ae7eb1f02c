"""Datasets and the loader that shards every epoch across ranks.

Datasets (all return a :class:`Dataset` of float features in ``[n, features]`` and integer labels):

* ``digits``: 1,797 8x8 handwritten digits, shipped with dtrain (``datasets/digits.npz``, CC BY 4.0, see
  ``datasets/LICENSE-digits.txt``), so the default run works offline. Split 80/20 into train/test with a fixed seed.
* ``mnist`` / ``fashion-mnist``: read from the four standard IDX files in ``--data-dir`` (``.gz`` or raw), e.g.
  ``train-images-idx3-ubyte.gz``. dtrain never downloads anything.
* ``synthetic``: well separated Gaussian class clusters with any number of features, classes and samples
  (benchmarks: any shape, training that works), and
  ``spirals``: a tiny 2-D problem a linear model cannot solve (tests).

Features are standardised with the *training* split's per-feature mean and standard deviation (never the test
split's: that would leak test information into training).

**Sharding** (like PyTorch's ``DistributedSampler``, arranged so data parallelism equals large-batch training)::

    epoch e:  perm = rng(seed, e).permutation(n_train)       # identical on every rank
              global batch s = perm[s*B : (s+1)*B]            # B = --batch-size, the global batch
              rank r takes    global batch s [r*b : (r+1)*b]  # b = B / world, the local batch

    e.g. B = 8, world = 2:   perm = [5 2 9 0 7 3 1 8 | 6 4 ...]
                             rank 0 gets [5 2 9 0], rank 1 gets [7 3 1 8] for step 0

The union of the ranks' local batches at step ``s`` is exactly the batch a single process would use at step ``s``,
so averaging the ranks' gradients reproduces single-process training with batch ``B``. **Remainder:** the last
``n_train mod B`` samples of each epoch's permutation are skipped (a different few each epoch, since the
permutation changes), so every step has a full global batch and every rank gets the same number of equal-sized
batches; no rank ever waits at a collective for a batch another rank does not have. ``B`` must be divisible by the
number of ranks.
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from dtrain.errors import UserError

DATASETS = ("digits", "mnist", "fashion-mnist", "synthetic", "spirals")
TEST_FRACTION = 0.2
SPLIT_SEED = 12345  # the train/test split never changes with --seed, so test accuracy stays comparable


class DataError(UserError, ValueError):
    """A dataset that cannot be read or used; the message says what is wrong and what to do."""


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def n_features(self) -> int:
        return self.x_train.shape[1]

    def describe(self) -> dict:
        return {
            "name": self.name,
            "train_samples": len(self.y_train),
            "test_samples": len(self.y_test),
            "features": self.n_features,
            "classes": self.n_classes,
        }


# --------------------------------------------------------------------- loading
def load_dataset(
    name: str,
    data_dir=None,
    *,
    samples: int = 10000,
    features: int = 784,
    classes: int = 10,
    seed: int = 0,
    dtype=np.float32,
) -> Dataset:
    """Load a dataset by name, split and standardise it; see the module docstring for the choices."""
    if name == "digits":
        x, y = load_digits()
        ds = _split(name, x, y, 10)
    elif name in ("mnist", "fashion-mnist"):
        ds = load_idx_dataset(name, data_dir)
    elif name == "synthetic":
        x, y = make_blobs(samples, features, classes, seed=seed)
        ds = _split(name, x, y, classes)
    elif name == "spirals":
        x, y = make_spirals(samples, classes, seed=seed)
        ds = _split(name, x, y, classes)
    else:
        raise DataError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    return standardize(ds, dtype)


def widths(name: str, features: int = 784, classes: int = 10) -> tuple[int, int]:
    """(features, classes) of the dataset ``name`` as :func:`load_dataset` would load it, without reading it (a
    layout over them is checked before any data is read)."""
    return {"digits": (64, 10), "mnist": (784, 10), "fashion-mnist": (784, 10), "synthetic": (features, classes),
            "spirals": (2, classes)}[name]  # fmt: skip


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 digits shipped with the package: images as (1797, 64) pixel counts 0..16, labels (1797,)."""
    with resources.files("dtrain.datasets").joinpath("digits.npz").open("rb") as f:
        archive = np.load(f)
        images, labels = archive["images"], archive["labels"]
    return images.reshape(len(images), -1).astype(np.float64), labels.astype(np.int64)


IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzip-compressed or raw.

    Layout: two zero bytes, a type code (0x08 = uint8, ...), the number of dimensions ``d``, then ``d`` big-endian
    uint32 sizes, then the data in C order. Every inconsistency is a :class:`DataError` naming the file.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a .gz whose compressed body is damaged
        raise DataError(f"{path}: cannot read it ({exc}); the file is damaged, download it again") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number); expected an MNIST-format file")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = tuple(int(v) for v in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: header says shape {shape} ({expected} data bytes) but the file holds "
            f"{len(raw) - header}; the file is truncated or corrupt, download it again"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape)


IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def load_idx_dataset(name: str, data_dir) -> Dataset:
    """MNIST or Fashion-MNIST from the four standard IDX files in ``data_dir`` (which one is up to the files)."""
    if data_dir is None:
        raise DataError(
            f"--dataset {name} reads IDX files from a folder: pass --data-dir DIR containing "
            f"{IDX_FILES['train'][0]}(.gz) and the three other files (dtrain does not download)"
        )
    data_dir = Path(data_dir)
    parts = {}
    for split, (images_name, labels_name) in IDX_FILES.items():
        images = read_idx(_find(data_dir, images_name))
        labels = read_idx(_find(data_dir, labels_name))
        if images.ndim < 2 or labels.ndim != 1:
            raise DataError(
                f"{data_dir}: {split} images must be (n, rows, cols) and labels (n,), "
                f"got {images.shape} and {labels.shape}"
            )
        if len(images) != len(labels):
            raise DataError(
                f"{data_dir}: {len(images)} {split} images but {len(labels)} labels; "
                f"the image and label files do not belong together"
            )
        if labels.min(initial=0) < 0:  # a negative label would silently index the last class
            raise DataError(f"{data_dir}: the {split} labels include {labels.min()}; class labels are 0, 1, 2, ...")
        parts[split] = (images.reshape(len(images), -1).astype(np.float64) / 255.0, labels.astype(np.int64))
    classes = int(max(parts["train"][1].max(initial=0), parts["test"][1].max(initial=0))) + 1
    return Dataset(name, *parts["train"], *parts["test"], n_classes=classes)


def _find(data_dir: Path, stem: str) -> Path:
    for candidate in (data_dir / stem, data_dir / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    raise DataError(f"{data_dir}: missing {stem} (or {stem}.gz); expected the four MNIST-format IDX files there")


def make_blobs(samples: int, features: int, classes: int, seed: int = 0, spread: float = 6.0):
    """Gaussian clusters: class ``c`` is centred at a random point, unit noise around it.

    Two centres lie about ``spread * sqrt(2)`` noise widths apart (8.5 by default), so the classes barely overlap
    (a nearest-centre rule gets ~99.9% right) and an MLP's test loss falls epoch after epoch, as training that works
    should show. (At 2, the old default, half the labels were guesses: with 784 features the MLP fitted the noise
    and its test loss rose from the first epoch.) The data are for timing and for checking that training works on
    any shape; the digits are the data to learn from.
    """
    if samples < 2 or features < 1 or classes < 2:
        raise DataError(
            f"synthetic data needs samples >= 2, features >= 1, classes >= 2 (got {samples}, {features}, {classes})"
        )
    rng = np.random.default_rng(seed)
    # per-feature spread / sqrt(features) puts two centres about spread * sqrt(2) noise-widths apart
    centres = rng.normal(0.0, spread / np.sqrt(features), size=(classes, features))
    labels = rng.integers(0, classes, size=samples)
    x = centres[labels] + rng.normal(size=(samples, features))
    return x, labels.astype(np.int64)


def make_spirals(samples: int, classes: int = 3, seed: int = 0, noise: float = 0.2):
    """Interleaved 2-D spirals, one arm per class."""
    if samples < 2 or classes < 2:
        raise DataError(f"spirals needs samples >= 2 and classes >= 2 (got {samples}, {classes})")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=samples)
    t = rng.uniform(0.0, 1.0, size=samples)
    angle = 4.0 * t + 2.0 * np.pi * labels / classes + rng.normal(0.0, noise, size=samples)
    x = np.stack([t * np.sin(angle), t * np.cos(angle)], axis=1)
    return x, labels.astype(np.int64)


def _split(name, x, y, classes) -> Dataset:
    if len(x) != len(y):
        raise DataError(f"{name}: {len(x)} samples but {len(y)} labels")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = max(1, round(TEST_FRACTION * len(y)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], classes)


def standardize(ds: Dataset, dtype=np.float32) -> Dataset:
    """Zero mean, unit variance per feature, with statistics from the training split only."""
    mean = ds.x_train.mean(axis=0)
    std = ds.x_train.std(axis=0)
    std[std < 1e-8] = 1.0  # constant features (the border pixels of digits) stay zero instead of dividing by 0
    ds.x_train = ((ds.x_train - mean) / std).astype(dtype)
    ds.x_test = ((ds.x_test - mean) / std).astype(dtype)
    return ds


# -------------------------------------------------------------------- sharding
def steps_per_epoch(n_samples: int, global_batch: int) -> int:
    return n_samples // global_batch


def shard_indices(n_samples: int, global_batch: int, rank: int, world: int, epoch: int, seed: int) -> np.ndarray:
    """This rank's sample indices for one epoch, shaped ``(steps, local_batch)``; row ``s`` is its batch at step s."""
    check_batch(global_batch, world, n_samples)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    local = global_batch // world
    steps = steps_per_epoch(n_samples, global_batch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_samples)
    return perm[: steps * global_batch].reshape(steps, world, local)[:, rank, :]


def check_batch(global_batch: int, world: int, n_samples: int) -> None:
    """Raise a :class:`DataError` that says how to fix a batch size that cannot be used."""
    if global_batch < 1:
        raise DataError(f"--batch-size must be >= 1, got {global_batch}")
    if global_batch % world:
        raise DataError(
            f"--batch-size {global_batch} (the global batch) must be divisible by the number of "
            f"ranks {world}; try {max(world, global_batch // world * world)}"
        )
    if global_batch > n_samples:
        raise DataError(f"--batch-size {global_batch} is larger than the training set ({n_samples} samples)")


class ShardedLoader:
    """Iterates over this rank's ``(x, y)`` batches for one epoch at a time (see the module docstring).

    Batches are gathered from the host arrays and moved to ``xp`` (the GPU, for CuPy) one at a time.
    """

    def __init__(self, x, y, global_batch: int, rank: int = 0, world: int = 1, seed: int = 0, xp=np):
        if len(x) != len(y):
            raise DataError(f"{len(x)} samples but {len(y)} labels")
        check_batch(global_batch, world, len(y))
        self.x, self.y = x, y
        self.global_batch, self.rank, self.world, self.seed, self.xp = global_batch, rank, world, seed, xp
        self.local_batch = global_batch // world

    def __len__(self) -> int:
        return steps_per_epoch(len(self.y), self.global_batch)

    def epoch(self, epoch: int):
        for batch in shard_indices(len(self.y), self.global_batch, self.rank, self.world, epoch, self.seed):
            yield self.xp.asarray(self.x[batch]), self.xp.asarray(self.y[batch])


def write_idx(path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file, gzip-compressed when the name ends in .gz (tests, small exports)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(os.fspath(path), "wb") as f:
        f.write(header + array.tobytes())
