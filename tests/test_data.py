"""Datasets, the IDX reader, standardisation, and the sharding invariants data parallelism depends on."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from dtrain.data import (
    DataError,
    Dataset,
    ShardedLoader,
    check_batch,
    load_dataset,
    load_digits,
    make_blobs,
    read_idx,
    shard_indices,
    standardize,
    steps_per_epoch,
    write_idx,
)

# ------------------------------------------------------------------------------------------------ datasets


def test_digits_is_the_uci_set_split_80_20():
    x, y = load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert x.min() == 0 and x.max() == 16 and np.all(x == np.round(x))  # pixel counts 0..16
    # the class sizes of the UCI optical digits (the set scikit-learn ships as load_digits)
    np.testing.assert_array_equal(np.bincount(y), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])

    ds = load_dataset("digits")
    n_test = round(0.2 * 1797)  # 359 (round, not ceil: 1438 train / 359 test)
    assert ds.describe() == {
        "name": "digits",
        "train_samples": 1797 - n_test,
        "test_samples": n_test,
        "features": 64,
        "classes": 10,
    }
    assert ds.x_train.shape == (1438, 64) and ds.x_test.shape == (359, 64)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert set(np.unique(ds.y_train)) == set(range(10)) and set(np.unique(ds.y_test)) == set(range(10))

    again = load_dataset("digits", dtype=np.float64)
    assert again.x_train.dtype == np.float64
    np.testing.assert_array_equal(again.y_train, ds.y_train)  # the split does not depend on --seed
    np.testing.assert_array_equal(load_dataset("digits", seed=7).y_test, ds.y_test)


def test_digits_split_is_a_partition_of_the_raw_set():
    """Every raw (image, label) is in exactly one split. Standardising maps each column by the same increasing
    affine function in both splits, so a row is identified by the rank of each of its values within its column."""

    def rows_as_column_ranks(x, y):
        ranks = np.stack([np.unique(x[:, j], return_inverse=True)[1].ravel() for j in range(x.shape[1])], axis=1)
        rows = np.column_stack([ranks, y])
        return rows[np.lexsort(rows.T[::-1])]

    x, y = load_digits()
    ds = load_dataset("digits", dtype=np.float64)
    both_x, both_y = np.concatenate([ds.x_train, ds.x_test]), np.concatenate([ds.y_train, ds.y_test])
    np.testing.assert_array_equal(rows_as_column_ranks(both_x, both_y), rows_as_column_ranks(x, y))


def test_standardisation_uses_training_statistics_only():
    ds = Dataset("toy", np.array([[0.0, 5.0], [2.0, 5.0]]), np.array([0, 1]), np.array([[3.0, 7.0]]), np.array([1]), 2)
    out = standardize(ds, np.float64)
    np.testing.assert_array_equal(out.x_train, [[-1.0, 0.0], [1.0, 0.0]])  # mean 1, std 1; constant column -> 0
    np.testing.assert_array_equal(out.x_test, [[2.0, 2.0]])  # (3 - 1) / 1 and (7 - 5) / 1: train statistics


def test_digits_standardised_train_split():
    ds = load_dataset("digits", dtype=np.float64)
    mean, std = ds.x_train.mean(axis=0), ds.x_train.std(axis=0)
    varying = std > 0
    assert 50 <= varying.sum() < 64  # a few border pixels are constant in the training split
    np.testing.assert_allclose(mean, 0, atol=1e-12)
    np.testing.assert_allclose(std[varying], 1, rtol=1e-12)
    np.testing.assert_array_equal(ds.x_train[:, ~varying], 0)
    # the test split is *not* exactly standardised (it used the training statistics)
    assert np.abs(ds.x_test.mean(axis=0)).max() > 1e-3


@pytest.mark.parametrize(("samples", "features", "classes"), [(300, 20, 3), (50, 1, 2), (1000, 784, 10)])
def test_synthetic_has_the_requested_shape(samples, features, classes):
    ds = load_dataset("synthetic", samples=samples, features=features, classes=classes, seed=1)
    n_test = round(0.2 * samples)
    assert ds.x_train.shape == (samples - n_test, features) and ds.x_test.shape == (n_test, features)
    assert ds.n_classes == classes and ds.n_features == features
    labels = np.concatenate([ds.y_train, ds.y_test])
    assert labels.min() >= 0 and labels.max() < classes
    again = load_dataset("synthetic", samples=samples, features=features, classes=classes, seed=1)
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    other = load_dataset("synthetic", samples=samples, features=features, classes=classes, seed=2)
    assert not np.array_equal(other.x_train, ds.x_train)


def test_synthetic_classes_are_learnable():
    """A nearest-centre rule, fitted on the training split, labels the test split almost perfectly: the clusters
    are separated well enough that a model has something to learn and its test loss can fall."""
    ds = load_dataset("synthetic", samples=3000, features=784, classes=10, seed=0, dtype=np.float64)
    centres = np.stack([ds.x_train[ds.y_train == c].mean(axis=0) for c in range(10)])
    distances = ((ds.x_test[:, None, :] - centres[None]) ** 2).sum(axis=2)
    assert (distances.argmin(axis=1) == ds.y_test).mean() >= 0.98


@pytest.mark.parametrize(("samples", "features", "classes"), [(1, 5, 2), (10, 0, 2), (10, 5, 1)])
def test_synthetic_rejects_impossible_sizes(samples, features, classes):
    with pytest.raises(DataError, match="synthetic data needs"):
        make_blobs(samples, features, classes)


def test_spirals():
    ds = load_dataset("spirals", samples=300, classes=4, seed=0, dtype=np.float64)
    assert ds.x_train.shape == (240, 2) and ds.x_test.shape == (60, 2) and ds.n_classes == 4
    assert set(np.unique(ds.y_train)) == {0, 1, 2, 3}


@pytest.mark.parametrize(("samples", "classes"), [(1, 3), (100, 1)])
def test_spirals_rejects_impossible_sizes(samples, classes):
    with pytest.raises(DataError, match="spirals needs"):
        load_dataset("spirals", samples=samples, classes=classes)


def test_unknown_dataset():
    with pytest.raises(DataError, match=r"unknown dataset 'cifar'.*digits"):
        load_dataset("cifar")


# ------------------------------------------------------------------------------------------------- sharding
SHARDING_CASES = [
    # (n, global batch B, world): remainders, B == n, world == B, world 1
    (100, 8, 2),
    (100, 12, 3),
    (37, 6, 3),
    (64, 64, 4),
    (10, 4, 4),
    (1438, 64, 8),
    (11, 5, 1),
]


@pytest.mark.parametrize(("n", "B", "world"), SHARDING_CASES)
def test_sharding_invariants(n, B, world):
    steps, local = n // B, B // world
    assert steps_per_epoch(n, B) == steps
    for epoch in (1, 2):
        single = shard_indices(n, B, rank=0, world=1, epoch=epoch, seed=3)  # the global batches
        assert single.shape == (steps, B)
        assert len(set(single.ravel())) == steps * B and single.min() >= 0 and single.max() < n
        shards = [shard_indices(n, B, rank=r, world=world, epoch=epoch, seed=3) for r in range(world)]
        for shard in shards:
            assert shard.shape == (steps, local), "every rank has the same number of equal batches"
        everything = np.concatenate([s.ravel() for s in shards])
        assert len(everything) == len(set(everything)) == steps * B, "shards overlap within an epoch"
        assert set(everything) == set(single.ravel()), "the shards cover exactly the global batches"
        for s in range(steps):
            union = np.concatenate([shard[s] for shard in shards])
            np.testing.assert_array_equal(union, single[s], err_msg=f"step {s}: ranks' batches != the global batch")


def test_sharding_depends_on_epoch_and_seed_only():
    a = shard_indices(100, 10, rank=1, world=2, epoch=1, seed=0)
    np.testing.assert_array_equal(a, shard_indices(100, 10, rank=1, world=2, epoch=1, seed=0))
    assert not np.array_equal(a, shard_indices(100, 10, rank=1, world=2, epoch=2, seed=0))
    assert not np.array_equal(a, shard_indices(100, 10, rank=1, world=2, epoch=1, seed=1))
    # (seed, epoch) pairs do not collide the way seed + epoch would
    assert not np.array_equal(a, shard_indices(100, 10, rank=1, world=2, epoch=0, seed=1))
    # the skipped remainder changes with the epoch, so no sample is left out every time
    skipped = [set(range(37)) - set(shard_indices(37, 8, 0, 1, epoch, 0).ravel()) for epoch in range(1, 81)]
    assert all(len(s) == 37 % 8 for s in skipped)
    assert set().union(*skipped) == set(range(37))


def test_loader_yields_this_ranks_rows():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20) % 3
    loader = ShardedLoader(x, y, global_batch=6, rank=1, world=3, seed=4)
    assert len(loader) == 3 and loader.local_batch == 2
    indices = shard_indices(20, 6, 1, 3, epoch=5, seed=4)
    batches = list(loader.epoch(5))
    assert len(batches) == 3
    for (bx, by), idx in zip(batches, indices):
        np.testing.assert_array_equal(bx, x[idx])
        np.testing.assert_array_equal(by, y[idx])
    with pytest.raises(DataError, match="20 samples but 19 labels"):
        ShardedLoader(x, y[:19], global_batch=6)


@pytest.mark.parametrize(
    ("B", "world", "n", "match"),
    [
        (10, 4, 100, r"--batch-size 10 .* must be divisible by the number of ranks 4; try 8"),
        (3, 4, 100, r"divisible by the number of ranks 4; try 4"),
        (0, 1, 100, r"--batch-size must be >= 1, got 0"),
        (-8, 2, 100, r">= 1"),
        (101, 1, 100, r"--batch-size 101 is larger than the training set \(100 samples\)"),
    ],
)
def test_unusable_batch_sizes_are_explained(B, world, n, match):
    with pytest.raises(DataError, match=match):
        check_batch(B, world, n)
    with pytest.raises(DataError, match=match):
        shard_indices(n, B, rank=0, world=world, epoch=1, seed=0)


def test_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        shard_indices(10, 2, rank=2, world=2, epoch=1, seed=0)


# ------------------------------------------------------------------------------------------------------ IDX
def idx_bytes(type_code: int, shape, payload: bytes) -> bytes:
    """An IDX file packed by hand from the format's description: 0, 0, type, ndim, big-endian uint32 sizes, data."""
    return struct.pack(">BBBB", 0, 0, type_code, len(shape)) + struct.pack(f">{len(shape)}I", *shape) + payload


def test_read_idx_of_hand_packed_files(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "u8").write_bytes(idx_bytes(0x08, (2, 3, 4), images.tobytes()))
    np.testing.assert_array_equal(read_idx(tmp_path / "u8"), images)

    (tmp_path / "u8.gz").write_bytes(gzip.compress(idx_bytes(0x08, (5,), bytes([9, 8, 7, 6, 5]))))
    np.testing.assert_array_equal(read_idx(tmp_path / "u8.gz"), [9, 8, 7, 6, 5])

    (tmp_path / "i2").write_bytes(idx_bytes(0x0B, (3,), struct.pack(">3h", -2, 300, 7)))
    np.testing.assert_array_equal(read_idx(tmp_path / "i2"), [-2, 300, 7])

    (tmp_path / "f4").write_bytes(idx_bytes(0x0D, (2, 1), struct.pack(">2f", 1.5, -0.25)))
    np.testing.assert_array_equal(read_idx(tmp_path / "f4"), [[1.5], [-0.25]])

    (tmp_path / "i1").write_bytes(idx_bytes(0x09, (2,), struct.pack(">2b", -128, 127)))
    np.testing.assert_array_equal(read_idx(tmp_path / "i1"), [-128, 127])


@pytest.mark.parametrize("name", ["plain-idx", "compressed-idx.gz"])
def test_write_idx_round_trip_and_format(tmp_path, name):
    array = np.random.default_rng(0).integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    path = tmp_path / name
    write_idx(path, array)
    back = read_idx(path)
    assert back.dtype == np.uint8 and back.shape == (4, 28, 28)
    np.testing.assert_array_equal(back, array)
    raw = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
    assert raw == idx_bytes(0x08, (4, 28, 28), array.tobytes()), "write_idx must write the standard layout"


def _gzip_with_damaged_body(payload: bytes) -> bytes:
    packed = bytearray(gzip.compress(payload, compresslevel=9))
    for i in range(12, len(packed) - 8):  # flip every bit of the deflate stream, keep the gzip header and trailer
        packed[i] ^= 0xFF
    return bytes(packed)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("bad-magic", b"\x1f\x8b\x08\x03" + bytes(100), "not an IDX file"),
        ("bad-type", idx_bytes(0x07, (2,), b"\x00\x00"), "not an IDX file"),
        ("short", b"\x00\x00", "not an IDX file"),
        ("truncated-header", idx_bytes(0x08, (4, 28, 28), b"")[:9], "truncated IDX header"),
        ("truncated-data", idx_bytes(0x08, (4, 28, 28), bytes(4 * 28 * 28 - 1)), r"header says shape \(4, 28, 28\)"),
        ("extra-data", idx_bytes(0x08, (3,), bytes(4)), r"\(3 data bytes\) but the file holds 4"),
        ("wrong-itemsize", idx_bytes(0x0C, (3,), bytes(3)), r"\(12 data bytes\) but the file holds 3"),
        ("garbage.gz", b"this is not gzip at all", "cannot read it"),
        ("cut.gz", gzip.compress(idx_bytes(0x08, (50,), bytes(range(50))))[:-12], "cannot read it"),
        ("damaged.gz", _gzip_with_damaged_body(idx_bytes(0x08, (300,), bytes(range(256)) + bytes(44))), "cannot"),
    ],
)
def test_read_idx_errors_name_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_idx(tmp_path / "nope")


def test_load_fake_mnist_folder(fake_mnist_dir):
    for name in ("mnist", "fashion-mnist"):
        ds = load_dataset(name, fake_mnist_dir, dtype=np.float64)
        assert ds.name == name
        assert ds.x_train.shape == (20, 784) and ds.x_test.shape == (10, 784)
        assert ds.n_classes == 10
        np.testing.assert_array_equal(ds.y_train, np.arange(20) % 10)
        np.testing.assert_array_equal(ds.y_test, np.arange(10))
        np.testing.assert_allclose(ds.x_train.mean(axis=0), 0, atol=1e-12)
    # the pixels are scaled the same as the files say: undo the standardisation with stats from the raw images
    raw = read_idx(fake_mnist_dir / "t10k-images-idx3-ubyte").reshape(10, -1) / 255.0
    train_raw = read_idx(fake_mnist_dir / "train-images-idx3-ubyte.gz").reshape(20, -1) / 255.0
    std = train_raw.std(axis=0)
    std[std < 1e-8] = 1.0
    np.testing.assert_allclose(ds.x_test, (raw - train_raw.mean(axis=0)) / std, atol=1e-12)


def test_mnist_needs_a_data_dir():
    with pytest.raises(DataError, match="pass --data-dir DIR"):
        load_dataset("mnist")


def test_mnist_missing_file(fake_mnist_dir):
    (fake_mnist_dir / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"missing t10k-labels-idx1-ubyte \(or t10k-labels-idx1-ubyte\.gz\)"):
        load_dataset("mnist", fake_mnist_dir)


def test_mnist_label_count_mismatch(fake_mnist_dir):
    write_idx(fake_mnist_dir / "train-labels-idx1-ubyte.gz", np.zeros(19, dtype=np.uint8))
    with pytest.raises(DataError, match="20 train images but 19 labels"):
        load_dataset("mnist", fake_mnist_dir)


def test_mnist_negative_labels_are_refused(fake_mnist_dir):
    labels = np.arange(10, dtype=np.int8) - 1  # -1 would silently pick the last class
    (fake_mnist_dir / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(0x09, (10,), labels.tobytes()))
    with pytest.raises(DataError, match="the test labels include -1"):
        load_dataset("mnist", fake_mnist_dir)


def test_mnist_labels_must_be_a_vector(fake_mnist_dir):
    write_idx(fake_mnist_dir / "t10k-labels-idx1-ubyte", np.zeros((10, 1), dtype=np.uint8))
    with pytest.raises(DataError, match=r"labels \(n,\)"):
        load_dataset("mnist", fake_mnist_dir)
