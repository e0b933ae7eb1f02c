"""Shared fixtures (kept small: a fixture belongs here only when several test files need it)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import write_idx

# The MPI check scripts (run as ``python tests/mpi_scripts/check_*.py``, their folder then first on the path) share
# report.py; tests that import a script as a module need that folder on the path too.
sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))

FAKE_MNIST = {"train": 20, "test": 10}


@pytest.fixture
def fake_mnist_dir(tmp_path):
    """A folder with the four MNIST-format IDX files: 20 train and 10 test 28x28 images, labels 0..9.

    The training files are gzip-compressed and the test files raw, so one load reads both kinds. Each image is
    noise plus a bright 4x4 block whose position depends on the label, so a model can learn something.
    """
    folder = tmp_path / "mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, (images_name, labels_name, suffix) in {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", ".gz"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", ""),
    }.items():
        n = FAKE_MNIST[split]
        labels = np.arange(n, dtype=np.uint8) % 10
        images = rng.integers(0, 60, size=(n, 28, 28), dtype=np.uint8)
        for i, label in enumerate(labels):
            row, col = divmod(int(label), 5)
            images[i, 4 + 10 * row : 8 + 10 * row, 2 + 5 * col : 6 + 5 * col] = 255
        write_idx(folder / (images_name + suffix), images)
        write_idx(folder / (labels_name + suffix), labels)
    return folder


@pytest.fixture(scope="module")
def data64():
    """The training tests' batches in float64 (test_data_parallel.batches): one per global step."""
    from test_data_parallel import batches

    return batches(np.float64)
