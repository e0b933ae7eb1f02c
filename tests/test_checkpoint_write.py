"""A checkpoint is written straight into its file (dtrain.checkpoint._write_npz, no copy of the file in memory) and
still atomically: what numpy.save would write for each array, read back to the bit by np.load, no temporary file
after success, and the previous checkpoint intact when the write fails half-way."""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest

from dtrain import checkpoint


def state(rng, n=1000):
    """Parameters and an optimizer state of every kind a checkpoint holds: flat buffers of two dtypes, a 0-d and an
    empty array, a 2-d one not in C order, and scalars."""
    return rng.standard_normal(n).astype(np.float32), {
        "m": rng.standard_normal(n).astype(np.float32),
        "v": rng.random(n),
        "scale": np.array(0.5),
        "none": np.zeros(0, np.float32),
        "grid": np.asfortranarray(rng.standard_normal((3, 4))),
        "step": 7,
        "lr": 0.01,
    }


def test_a_checkpoint_loads_back_bit_identical_and_each_member_is_what_numpy_save_writes(tmp_path):
    params, optimizer = state(np.random.default_rng(0))
    meta = {"paradigm": "ddp", "global_step": 12, "epochs": [{"loss": 0.25}]}
    path = checkpoint.save(tmp_path, params, optimizer, meta)
    back = checkpoint.load(tmp_path)
    assert back["meta"] == {"format": checkpoint.FORMAT, **meta}
    assert back["params"].dtype == params.dtype and back["params"].tobytes() == params.tobytes()
    for name, value in optimizer.items():
        if isinstance(value, np.ndarray):
            mine = back["optimizer"][name]
            assert (mine.dtype, mine.shape) == (value.dtype, value.shape) and np.array_equal(mine, value), name
        else:
            assert back["optimizer"][name] == value
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every CRC right
        for name, value in [("params", params), *((f"optimizer.{k}", v) for k, v in optimizer.items())]:
            if isinstance(value, np.ndarray):
                npy = io.BytesIO()
                np.save(npy, np.ascontiguousarray(value) if value.ndim else value)  # (written in C order)
                assert archive.read(f"{name}.npy") == npy.getvalue(), name
    first = path.read_bytes()
    assert checkpoint.save(tmp_path, params, optimizer, meta).read_bytes() == first  # (the same bytes every time)
    assert os.listdir(tmp_path) == [checkpoint.FILENAME]  # no temporary file left


def test_a_write_in_many_pieces_and_partial_writes_still_make_the_same_file(tmp_path, monkeypatch):
    """More arrays than one writev takes (1024 pieces), and a kernel that writes 1000 bytes at a time."""
    rng = np.random.default_rng(1)
    many = {f"b{i}": rng.standard_normal(3) for i in range(400)}  # 3 pieces each
    whole = checkpoint.save(tmp_path / "whole", np.arange(5000.0), many, {"global_step": 1}).read_bytes()
    writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, pieces: writev(fd, [memoryview(pieces[0])[:1000]]))
    assert checkpoint.save(tmp_path / "slow", np.arange(5000.0), many, {"global_step": 1}).read_bytes() == whole
    assert checkpoint.load(tmp_path / "slow")["optimizer"]["b399"].tobytes() == many["b399"].tobytes()


@pytest.mark.parametrize("n", [10, 100_000])
def test_a_write_that_fails_half_way_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, n):
    rng = np.random.default_rng(2)
    params, optimizer = state(rng, n)
    checkpoint.save(tmp_path, params, optimizer, {"global_step": 10})
    before = checkpoint.path_in(tmp_path).read_bytes()
    seen = []

    def dies():
        seen.append((tmp_path / (checkpoint.FILENAME + ".tmp")).stat().st_size)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        checkpoint.save(tmp_path, rng.standard_normal(n).astype(np.float32), optimizer, {"global_step": 20}, dies)
    assert seen == [len(before) // 2]  # half of the new file (as long as the old one) was on the disk
    assert checkpoint.path_in(tmp_path).read_bytes() == before
    assert os.listdir(tmp_path) == [checkpoint.FILENAME]
    back = checkpoint.load(tmp_path)
    assert back["meta"]["global_step"] == 10 and back["params"].tobytes() == params.tobytes()
