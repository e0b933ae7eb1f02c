"""Surviving a dead rank: ``dtrain launch --max-restarts`` restarts a failed job from its last checkpoint, and the
run ends with the weights of a run that never failed (the oracle: the same command, uninterrupted, its SHA-256).

The ranks are killed for real (the fault injector, DTRAIN_FAULT, sends SIGKILL), MPI ends the job, the launcher reads
what happened and starts it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_launcher import Started, kill_all, left_of

from dtrain import checkpoint, faults
from dtrain.errors import ConfigError
from dtrain.launch import restarts

COMMON = ["--epochs", "2", "--batch-size", "48", "--checkpoint-every", "10", "--quiet", "--no-progress"]
PARADIGMS = {
    "ddp": ["--paradigm", "ddp", "--hidden", "32"],
    "zero-3": ["--paradigm", "zero", "--zero-stage", "3", "--hidden", "32"],
    "ps-sync": ["--paradigm", "ps-sync", "--servers", "1", "--hidden", "32"],
    "pp": ["--paradigm", "pp", "--pp", "4", "--hidden", "32,32,32"],
}


def dtrain_launch(tmp_path, name: str, launch_flags, train_flags, fault: str | None = None, timeout: float = 240):
    """``dtrain launch -n 4 LAUNCH_FLAGS -m dtrain train TRAIN_FLAGS --out tmp/NAME``: (result, metrics or None)."""
    env = {k: v for k, v in os.environ.items() if k != faults.ENV_VAR}
    if fault is not None:
        env[faults.ENV_VAR] = fault
    out = tmp_path / name
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "4", *launch_flags, "-m", "dtrain", "train",
               *train_flags, "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)
    metrics = out / "metrics.json"
    return result, (json.loads(metrics.read_text()) if metrics.exists() else None)


def uninterrupted(tmp_path, flags) -> dict:
    """The oracle: the same flags, never stopped."""
    result, metrics = dtrain_launch(tmp_path, "whole", [], [*flags, "--checkpoint-dir", str(tmp_path / "whole-ck")])
    assert result.returncode == 0, result.stderr
    return metrics


# --- the targets: a rank killed, the run restarted, the same bits ---------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_a_rank_killed_mid_run_is_restarted_and_the_weights_are_those_of_a_run_never_stopped(tmp_path, paradigm):
    flags = [*PARADIGMS[paradigm], *COMMON]
    whole = uninterrupted(tmp_path, flags)
    restart = ["--max-restarts", "1", "--restart-delay", "0.2", "--checkpoint-dir", str(tmp_path / "ck")]
    result, metrics = dtrain_launch(tmp_path, "restarted", restart, flags, fault="1:23")
    assert result.returncode == 0, result.stderr
    assert metrics["weights_sha256"] == whole["weights_sha256"]
    assert [e["test_loss"] for e in metrics["epochs"]] == [e["test_loss"] for e in whole["epochs"]]
    attempts = metrics["restarts"]
    assert attempts["count"] == 1 and attempts["steps_lost"] == 3  # killed after step 23; checkpoint at step 20
    first = attempts["attempts"][0]
    assert (first["rank"], first["signal"], first["reached_step"]) == (1, "SIGKILL", 23) and first["exit_status"]
    assert "rank 1 was killed by SIGKILL" in result.stderr
    assert "from the checkpoint at global step 20" in result.stderr
    assert faults.fired(tmp_path / "ck")[0]["step"] == 23  # recorded: the restart went past step 23 alive
    # MPI's own box about the dead rank is in the folder's mpi.log, not on the terminal: the launcher said it
    assert "BAD TERMINATION" not in result.stdout + result.stderr
    assert "BAD TERMINATION" in (tmp_path / "ck" / restarts.MPI_LOG).read_text()


@pytest.mark.mpi
def test_a_kill_while_the_checkpoint_is_written_leaves_the_previous_one_and_the_restart_uses_it(tmp_path):
    flags = [*PARADIGMS["ddp"], *COMMON]
    whole = uninterrupted(tmp_path, flags)
    restart = ["--max-restarts", "1", "--restart-delay", "0.2", "--checkpoint-dir", str(tmp_path / "ck")]
    result, metrics = dtrain_launch(tmp_path, "restarted", restart, flags, fault="0:20:KILL:checkpoint")
    assert result.returncode == 0, result.stderr
    assert "Restarting in 0.2 s from the checkpoint at global step 10" in result.stderr  # not 20's half
    assert metrics["restarts"]["steps_lost"] == 10
    assert metrics["weights_sha256"] == whole["weights_sha256"]


def test_a_checkpoint_write_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path):
    """The rank really dies (SIGKILL, in a process of its own) with half the new file on the disk."""
    params = np.arange(1000, dtype=np.float32)
    checkpoint.save(tmp_path, params, {"steps": 10, "lr": 0.1}, {"global_step": 10})
    code = (
        "import os, signal, numpy as np; from dtrain import checkpoint\n"
        f"checkpoint.save({str(tmp_path)!r}, np.zeros(1000, np.float32), {{'steps': 20, 'lr': 0.1}}, "
        "{'global_step': 20}, during_write=lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
    )
    died = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert died.returncode == -signal.SIGKILL
    half = (tmp_path / (checkpoint.FILENAME + ".tmp")).stat().st_size
    assert 0 < half < checkpoint.path_in(tmp_path).stat().st_size
    state = checkpoint.load(tmp_path)
    assert state["meta"]["global_step"] == 10 and np.array_equal(state["params"], params)


@pytest.mark.mpi
def test_launching_a_finished_job_again_says_so_and_runs_nothing(tmp_path):
    flags = [*PARADIGMS["ddp"], "--epochs", "1", "--batch-size", "48", "--quiet", "--no-progress"]
    restart = ["--max-restarts", "1", "--checkpoint-dir", "ck"]
    first, metrics = dtrain_launch(tmp_path, "first", restart, flags)
    assert first.returncode == 0 and metrics is not None, first.stderr
    written = (tmp_path / "first" / "metrics.json").stat().st_mtime_ns
    again, _ = dtrain_launch(tmp_path, "first", restart, flags)
    assert again.returncode == 0 and again.stdout == ""
    assert (tmp_path / "first" / "metrics.json").stat().st_mtime_ns == written  # nothing ran
    assert again.stderr == (
        "dtrain launch: the job in ck has already finished (1 epoch, global step 29): nothing to run; to start "
        "afresh remove ck or give another --checkpoint-dir (more --epochs goes on from it)\n"
    )
    # a run that died after its last checkpoint, before its metrics: the same command goes on and writes them
    (tmp_path / "first" / "metrics.json").unlink()
    resumed, metrics_again = dtrain_launch(tmp_path, "first", restart, flags)
    assert resumed.returncode == 0 and "from the checkpoint at global step 29" in resumed.stderr, resumed.stderr
    assert metrics_again["weights_sha256"] == metrics["weights_sha256"]


def test_the_checkpoint_folder_given_to_the_target_is_the_launchers(tmp_path):
    """--checkpoint-dir after ``-m dtrain train`` is the train command's; the launcher takes it from there."""
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "2", "--max-restarts", "1", "--dry-run", "-m", "dtrain",
               "train", "--paradigm", "ddp", "--checkpoint-dir", "D"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split()[-4:] == ["--checkpoint-dir", "D", "--batch-size", "64"]
    other = subprocess.run([*command[:9], "script.py"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert other.returncode == 2 and other.stderr == (
        "dtrain: error: --max-restarts needs --checkpoint-dir DIR, given to dtrain launch before the target (dtrain "
        "launch -n 2 --max-restarts 1 --checkpoint-dir DIR script.py): a restart goes on from the last "
        "checkpoint there\n"
    )


# --- what is not restarted ------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_ctrl_c_on_the_launcher_stops_everything_and_restarts_nothing(tmp_path):
    ck = tmp_path / "ck"
    args = ["--max-restarts", "3", "--checkpoint-dir", ck, "-m", "dtrain", "train", "--paradigm", "ddp",
            "--epochs", "1000", "--no-progress", "--checkpoint-every", "5"]  # fmt: skip
    started = Started(args, tmp_path)
    tree = started.wait_until(lambda out: "epoch   1/1000" in out)
    try:
        started.process.send_signal(signal.SIGINT)
        status = started.finish(30)
        assert status == -signal.SIGINT, "".join(started.stderr)
        assert not left_of(tree, 10)
        assert "Restarting" not in "".join(started.stderr) and "attempt 2" not in "".join(started.stderr)
    finally:
        kill_all(tree)


ALWAYS_DIES = """
import os, signal, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
# one write per line: mpiexec merges the ranks' output, and print's pieces could interleave with another rank's
sys.stdout.write(f"attempt {os.environ['DTRAIN_RESTART']} rank {comm.Get_rank()}\\n")
sys.stdout.flush()
comm.Barrier()
if comm.Get_rank() == 2:
    time.sleep(1.5)  # (the launcher has seen every rank alive by then: it can tell which one ended first)
    os.kill(os.getpid(), signal.SIGTERM)
comm.Barrier()
"""


@pytest.mark.mpi
def test_a_failure_that_repeats_past_max_restarts_ends_with_every_attempt_reported(tmp_path):
    (tmp_path / "dies.py").write_text(ALWAYS_DIES)
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "3", "--max-restarts", "2", "--restart-delay", "0.1",
               "--checkpoint-dir", str(tmp_path / "ck"), "dies.py"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode != 0
    for n in (1, 2, 3):
        assert f"  {n}. 3 ranks from the beginning" in result.stderr and f"attempt {n - 1} rank 0" in result.stdout
    # two restarts said, three attempts listed (which rank: where the launcher saw it end first; on a busy machine
    # the ranks' ends may come too close together to tell, and then it says it does not know)
    assert result.stderr.count("was killed by SIGTERM") == 2 + 3
    assert "3 attempts failed (--max-restarts 2); giving up" in result.stderr


@pytest.mark.mpi
def test_a_mistake_in_what_was_asked_is_never_restarted(tmp_path):
    (tmp_path / "mistake.py").write_text("import sys\nsys.exit(2)\n")
    command = [sys.executable, "-m", "dtrain", "launch", "-n", "2", "--max-restarts", "3", "--checkpoint-dir",
               str(tmp_path / "ck"), "mistake.py"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert "not restarted" in result.stderr and "Restarting" not in result.stderr


# --- elastic: fewer slots after the failure, fewer ranks, the same global batch --------------------------------------
@pytest.mark.mpi
def test_with_min_ranks_a_restart_goes_on_with_the_slots_the_hostfile_lists_now(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:4\n")
    ck = tmp_path / "ck"

    def take_a_slot_away_once_the_rank_has_died():  # as a cluster's scheduler would take out a failed node
        deadline = time.monotonic() + 120
        while not (ck / faults.RECORD).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        hostfile.write_text("localhost:3\n")

    threading.Thread(target=take_a_slot_away_once_the_rank_has_died, daemon=True).start()
    flags = [*PARADIGMS["ddp"], *COMMON]
    restart = ["--hostfile", str(hostfile), "--min-ranks", "2", "--max-restarts", "1", "--restart-delay", "1.5",
               "--checkpoint-dir", str(ck)]  # fmt: skip
    result, metrics = dtrain_launch(tmp_path, "elastic", restart, flags, fault="3:23")
    assert result.returncode == 0, result.stderr
    assert metrics["world_size"] == 3 and metrics["config"]["batch_size"] == 48
    assert "going on with 3 ranks" in result.stderr
    single = subprocess.run([sys.executable, "-m", "dtrain", "train", "--paradigm", "single", "--hidden", "32",
                             *COMMON[:4], "--quiet", "--no-progress", "--out", str(tmp_path / "single")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert single.returncode == 0, single.stderr
    reference = json.loads((tmp_path / "single" / "metrics.json").read_text())
    for ours, theirs in zip(metrics["epochs"], reference["epochs"], strict=True):  # the same global batches
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-4)


# --- bad input: one line, before anything starts --------------------------------------------------------------------
def launch_line(tmp_path, *args):
    result = subprocess.run([sys.executable, "-m", "dtrain", "launch", *map(str, args)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    return result.returncode, result.stderr.strip()


def write_checkpoint(tmp_path, *flags) -> Path:
    folder = tmp_path / "old"
    result = subprocess.run([sys.executable, "-m", "dtrain", "train", "--epochs", "1", "--quiet", "--no-progress",
                             "--checkpoint-dir", str(folder), *flags], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", 2, "--max-restarts", 1, "-m", "dtrain", "train"], "--max-restarts needs --checkpoint-dir DIR"),
        (["-n", 2, "--checkpoint-dir", "ck", "-m", "dtrain", "train"], "--checkpoint-dir: only with --max-restarts"),
        (["-n", 2, "--max-restarts", -1, "--checkpoint-dir", "ck", "x.py"], "--max-restarts must be >= 0"),
        (["-n", 2, "--max-restarts", 1, "--checkpoint-dir", "ck", "--min-ranks", 3, "x.py"],
         "--min-ranks 3 must be between 1 and the ranks asked for (-n 2)"),
        (["-n", 4, "--max-restarts", 1, "--checkpoint-dir", "ck", "--min-ranks", 2, "x.py"],
         "--min-ranks below -n needs --hostfile"),
        (["-n", 4, "--hosts", "localhost:4", "--max-restarts", 1, "--checkpoint-dir", "ck", "--min-ranks", 2, "x.py"],
         "--min-ranks below -n needs --hostfile"),
        (["-n", 2, "--max-restarts", 1, "--checkpoint-dir", "ck", "-m", "dtrain", "train", "--checkpoint-dir", "b"],
         "differs from the launcher's --checkpoint-dir"),
        (["-n", 3, "--max-restarts", 1, "--checkpoint-dir", "ck", "-m", "dtrain", "train", "--paradigm", "ddp",
          "--batch-size", 64], "on 3 ranks"),
    ],
)  # fmt: skip
def test_bad_restart_flags_are_one_line_before_anything_starts(tmp_path, args, message):
    status, said = launch_line(tmp_path, *args)
    assert status == 2 and message in said, said
    assert len(said.splitlines()) == 1 and not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    ("written_with", "launched_with", "message"),
    [
        (["--hidden", "16"], ["--hidden", "32"], "model sizes"),
        (["--dataset", "synthetic", "--samples", "2000"], ["--dataset", "synthetic", "--samples", "3000"], "--dataset"),
        (["--optimizer", "adam"], [], "--optimizer"),
    ],
)
def test_a_checkpoint_folder_of_another_model_or_dataset_is_refused_before_anything_starts(
    tmp_path, written_with, launched_with, message
):
    folder = write_checkpoint(tmp_path, *written_with)
    before = checkpoint.path_in(folder).read_bytes()
    status, said = launch_line(tmp_path, "-n", 2, "--max-restarts", 1, "--checkpoint-dir", folder, "-m", "dtrain",
                               "train", "--paradigm", "ddp", *launched_with)  # fmt: skip
    assert status == 2 and message in said and "holds a checkpoint this job cannot go on from" in said, said
    assert len(said.splitlines()) == 1
    assert checkpoint.path_in(folder).read_bytes() == before


@pytest.mark.mpi
def test_launching_the_same_job_again_goes_on_from_its_checkpoint_and_another_run_is_refused(tmp_path):
    """The launcher gives up (--max-restarts 0); the same command again goes on from the checkpoint (the launcher
    that died, or a person deciding to go on): the weights of a run never stopped. The same folder with another
    --lr is another run: refused in one line, unless the target says --resume."""
    flags = [*PARADIGMS["ddp"], *COMMON]
    whole = uninterrupted(tmp_path, flags)
    launch = ["--max-restarts", "0", "--checkpoint-dir", str(tmp_path / "ck")]
    gave_up, _ = dtrain_launch(tmp_path, "first", launch, flags, fault="2:33")
    assert gave_up.returncode != 0 and "1 attempt failed (--max-restarts 0); giving up" in gave_up.stderr
    again, metrics = dtrain_launch(tmp_path, "again", launch, flags, fault="2:33")
    assert again.returncode == 0, again.stderr
    assert "attempt 1 of 1, on 4 ranks, from the checkpoint at global step 30" in again.stderr
    assert metrics["weights_sha256"] == whole["weights_sha256"] and "restarts" in metrics
    other, _ = dtrain_launch(tmp_path, "other", launch, [*flags, "--lr", "0.1"])
    assert other.returncode == 2 and "holds a checkpoint of another run (--lr 0.05 there, 0.1 here)" in other.stderr
    forced, metrics = dtrain_launch(tmp_path, "forced", launch, [*flags, "--lr", "0.1", "--epochs", "3", "--resume"])
    assert forced.returncode == 0 and len(metrics["epochs"]) == 3, forced.stderr


def test_a_checkpoint_written_without_the_launcher_is_gone_on_from_only_with_resume(tmp_path):
    folder = write_checkpoint(tmp_path, "--hidden", "16")
    target = ["-m", "dtrain", "train", "--paradigm", "ddp", "--hidden", "16", "--epochs", "2"]
    with pytest.raises(restarts.UserError, match="a run not started by dtrain launch --max-restarts"):
        restarts.prepare(2, target, folder, 1, None, 0.0)
    job = restarts.prepare(2, [*target, "--resume"], folder, 1, None, 0.0)
    assert not job.fresh and f"--checkpoint-dir={folder}" in job.target and "--resume" not in job.target
    assert job.train_config.batch_size == 64  # pinned: a restart on fewer ranks keeps the global batch


# --- the fault injector -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("2:7", faults.Fault(2, 7, signal.SIGKILL, "step")),
        ("1:12:TERM", faults.Fault(1, 12, signal.SIGTERM, "step")),
        ("1:12:sigint", faults.Fault(1, 12, signal.SIGINT, "step")),
        ("0:3:9:checkpoint", faults.Fault(0, 3, signal.SIGKILL, "checkpoint")),
    ],
)
def test_a_fault_is_read_from_its_spec(text, fault):
    assert faults.parse(text) == fault


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2", "expected RANK:STEP"),
        ("a:b", "expected RANK:STEP"),
        ("1:0", "STEP >= 1"),
        ("1:3:NOPE", "'NOPE' is not a signal"),
        ("1:3:KILL:later", "WHERE must be one of step, checkpoint"),
        ("1:3:KILL:checkpoint", "only rank 0 writes checkpoints"),
    ],
)
def test_a_malformed_fault_is_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        faults.parse(text)


def test_a_fault_that_could_never_fire_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="rank 4 does not exist in a job of 4"):
        faults.from_env(4, environ={faults.ENV_VAR: "4:1"})
    with pytest.raises(ConfigError, match="no checkpoint is written after step 15"):
        faults.from_env(4, "ck", environ={faults.ENV_VAR: "0:15:KILL:checkpoint"}, checkpoint_every=10)
    with pytest.raises(ConfigError, match="no checkpoint is written after step 20"):
        faults.from_env(4, None, environ={faults.ENV_VAR: "0:20:KILL:checkpoint"}, checkpoint_every=10)
    planned = faults.from_env(4, "ck", environ={faults.ENV_VAR: "0:20:KILL:checkpoint"}, checkpoint_every=10)
    assert [f.step for f in planned] == [20]
    with pytest.raises(ConfigError, match=r"step 60 is past the run's last global step \(58\)"):
        faults.check_reachable(faults.parse("1:60"), 58)


def test_a_fault_fires_once_per_run_of_a_checkpoint_folder(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, signum: killed.append(signum))
    fault = faults.parse("1:5")
    injector = faults.Injector(fault, rank=1, folder=tmp_path)
    for step in range(1, 8):
        injector.at_step(step)
    assert killed == [signal.SIGKILL]
    assert not faults.Injector(fault, rank=1, folder=tmp_path).armed  # the restart goes past step 5
    assert not faults.Injector(fault, rank=0, folder=tmp_path / "other").armed  # another rank's
    assert faults.Injector(fault, rank=1, folder=None).armed  # nowhere to remember: every run


def test_several_faults_each_optionally_bound_to_an_attempt_are_read_from_one_spec():
    listed = faults.parse_all(" 1:7 ,3:12:TERM,0:8:KILL:checkpoint@2,2:9@2")
    assert listed == (faults.Fault(1, 7), faults.Fault(3, 12, signal.SIGTERM), faults.Fault(0, 8, where="checkpoint",
                      attempt=2), faults.Fault(2, 9, attempt=2))  # fmt: skip
    assert [f.spec for f in listed] == ["1:7:KILL:step", "3:12:TERM:step", "0:8:KILL:checkpoint@2", "2:9:KILL:step@2"]
    assert faults.parse_all("2:7") == (faults.parse("2:7"),)  # one fault: as before
    assert listed[1].describe() == "rank 3 sent itself SIGTERM after global step 12"
    said = "server rank 2 sent itself SIGKILL after applying 27 pushes (global step 9), in attempt 2"
    assert listed[3].describe(workers=3) == said


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:7,2:x", r"^DTRAIN_FAULT item '2:x': expected RANK:STEP\[:SIGNAL\[:WHERE\]\]\[@ATTEMPT\]"),
        ("1:7,,2:9", "an empty item"),
        ("1:7,", "an empty item"),
        ("1:7@0", "ATTEMPT must be >= 1"),
        ("1:7,2:9@x", "item '2:9@x': expected RANK:STEP"),
        ("1:7@2@3", "expected RANK:STEP"),
        ("1:7,2:3:NOPE", "item '2:3:NOPE': 'NOPE' is not a signal"),
        ("1:7,1:7:KILL:step", "item '1:7:KILL:step': rank 1 at step 7 is named already \\('1:7'\\)"),
        ("1:7:TERM@2,2:1,1:7@2", "item '1:7@2': rank 1 at step 7 is named already"),
    ],
)
def test_a_bad_item_of_several_faults_is_one_line_naming_it(text, message):
    with pytest.raises(ConfigError, match=message) as caught:
        faults.parse_all(text)
    assert "\n" not in str(caught.value)


def launched(tmp_path, attempt: int, spec: str) -> dict:
    """An environment as ``dtrain launch --max-restarts`` gives attempt ``attempt`` (a made-up attempts record)."""
    record = tmp_path / f"attempts-{attempt}.json"
    record.write_text(json.dumps({"count": attempt - 1, "steps_lost": 0, "seconds_lost": 0.0, "attempts": []}))
    return {faults.ENV_VAR: spec, faults.ATTEMPTS_ENV: str(record)}


def test_a_fault_bound_to_an_attempt_fires_in_that_attempt_only(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, signum: killed.append(signum))
    spec = "1:3@1,1:5:TERM@2,2:4"
    assert faults.attempt_number({}) == 1 and faults.attempt_number(launched(tmp_path, 3, spec)) == 3
    first = faults.from_env(4, environ=launched(tmp_path, 1, spec))
    assert [f.spec for f in first] == ["1:3:KILL:step@1", "1:5:TERM:step@2", "2:4:KILL:step"]  # all checked
    second = faults.from_env(4, environ=launched(tmp_path, 2, spec))  # attempt 1's passed: skipped, not refused
    assert [f.spec for f in second] == ["1:5:TERM:step@2", "2:4:KILL:step"]
    injector = faults.Injector(second, rank=1, attempt=2)
    for step in range(1, 8):
        injector.at_step(step)
    assert killed == [signal.SIGTERM]
    assert faults.Injector(first, rank=1, attempt=1).faults == [first[0]]
    with pytest.raises(ConfigError, match=r"^DTRAIN_FAULT item '1:5@2': attempt 2 never comes: only dtrain launch"):
        faults.from_env(4, environ={faults.ENV_VAR: "0:3,1:5@2"})  # no launcher: every run is attempt 1
    with pytest.raises(ConfigError, match="item '7:2@3': rank 7 does not exist in a job of 4"):
        faults.from_env(4, environ=launched(tmp_path, 1, "1:5,7:2@3"))  # a later attempt's, refused in the first
    with pytest.raises(ConfigError, match=r"item '1:60': step 60 is past the run's last global step \(58\)"):
        faults.check_reachable(faults.parse_all("0:3,1:60"), 58)


def test_each_fault_fires_once_per_run_of_a_checkpoint_folder_and_two_ranks_record_together(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, signum: killed.append(signum))
    planned = faults.parse_all("1:3,2:3,1:5@2")
    one, two = faults.Injector(planned, 1, tmp_path, attempt=2), faults.Injector(planned, 2, tmp_path, attempt=2)
    for step in range(1, 7):
        one.at_step(step)
        two.at_step(step)
    assert killed == [signal.SIGKILL] * 3
    assert [(f["spec"], f["rank"], f["step"], f["attempt"]) for f in faults.fired(tmp_path)] == [
        ("1:3:KILL:step", 1, 3, 2), ("2:3:KILL:step", 2, 3, 2), ("1:5:KILL:step@2", 1, 5, 2)]  # fmt: skip
    assert not faults.Injector(planned, 1, tmp_path, attempt=2).armed  # the restart goes past all three
    assert faults.from_env(4, tmp_path, environ=launched(tmp_path, 2, "1:3,2:3,1:5@2")) == ()


def test_a_server_dies_once_it_has_applied_step_times_workers_pushes(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, signum: killed.append((pid, signum)))

    def dies_at(injector, workers=2, pushes=40):  # the call of at_pushes that fires (None: none does)
        for applied in range(1, pushes + 1):
            injector.at_pushes(applied, workers)
            if killed:
                return applied
        return None

    assert dies_at(faults.Injector(faults.parse("3:4"), 3, tmp_path)) == 8  # 4 x 2 workers
    assert faults.fired(tmp_path)[0] | {"pid": 0} == {"spec": "3:4:KILL:step", "rank": 3, "step": 4, "pid": 0,
                                                       "signal": "SIGKILL", "where": "step", "attempt": 1,
                                                       "pushes": 8}  # fmt: skip
    killed.clear()
    assert dies_at(faults.Injector(faults.parse("3:4"), 3, tmp_path)) is None  # once per run
    assert dies_at(faults.Injector(faults.parse("3:4"), 3), workers=3) == 12
    killed.clear()
    assert dies_at(faults.Injector(faults.parse("3:7"), 3, start_step=5)) == 4  # resumed from step 5: 2 more steps
    killed.clear()
    past = faults.Injector(faults.parse("3:4"), 3, start_step=5)
    assert dies_at(past) is None
    past.check_fired()  # resumed past it: skipped
    bound = faults.Injector(faults.parse("3:4@2"), 3, attempt=2, start_step=5)
    assert dies_at(bound) is None
    with pytest.raises(ConfigError, match="attempt 2 resumed from global step 5, past step 4, so rank 3 was never"):
        bound.check_fired()


def test_a_fault_whose_rank_neither_trains_nor_serves_is_reported_at_the_end():
    idle = faults.Injector(faults.parse("3:4"), 3)
    with pytest.raises(ConfigError, match="rank 3 neither took a training step nor applied a push, so it was never"):
        idle.check_fired()
    idle.at_pushes(3, 2)  # a server that ended short of its step: step 1 of 4
    with pytest.raises(ConfigError, match="rank 3 reached only step 1, so it was never killed"):
        idle.check_fired()
    trained = faults.Injector(faults.parse("1:9"), 1)
    trained.at_step(5)  # (a slow ps-async worker: 5 steps of its own in the run)
    with pytest.raises(ConfigError, match="rank 1 reached only step 5, so it was never killed"):
        trained.check_fired()
    faults.Injector(faults.parse("0:3:KILL:checkpoint"), 0).check_fired()  # (a write's fault: not this check's)


def test_the_launcher_names_every_fault_that_fired_in_an_attempt():
    fired = [{"spec": "1:7:KILL:step", "rank": 1, "step": 7, "signal": "SIGKILL"},
             {"spec": "3:7:KILL:step@2", "rank": 3, "step": 7, "signal": "SIGKILL", "pushes": 21}]  # fmt: skip
    attempt = restarts.Attempt(2, 4, 5)
    restarts._explain(attempt, SimpleNamespace(tail="", returncode=9, first_to_end=None), fired)
    assert attempt.ended == (
        "rank 3 was killed by SIGKILL (the fault injector, DTRAIN_FAULT=3:7:KILL:step@2, a "
        "server, after 21 pushes: at global step 7; also rank 1: 1:7:KILL:step, at global step 7)"
    )
    restarts._explain(attempt, SimpleNamespace(tail="", returncode=9, first_to_end=None), fired[:1])
    assert attempt.ended == "rank 1 was killed by SIGKILL (the fault injector, DTRAIN_FAULT=1:7:KILL:step, at global " \
        "step 7)"  # fmt: skip


# --- saying what happened ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tail", "status", "first", "said"),
    [
        ("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)", 9, 2, "rank 2 was killed by SIGKILL"),
        ("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)", 9, None,
         "a rank (MPI's report does not say which) was killed by SIGKILL"),
        ("mpiexec noticed that process rank 3 with PID 0 on node n1 exited on signal 15 (Terminated).", 15, None,
         "rank 3 was killed by SIGTERM"),
        ("dtrain watchdog: rank 1 of 4 (host vm, pid 13825) has waited 2.0 s in allreduce/ring (call #3) > Sendrecv "
         "from rank 0, to rank 2; one wait may last at most DTRAIN_TIMEOUT=2 s: aborting the job (exit status 14)\n"
         "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)", 14, 3,
         "the watchdog found rank 1 stalled"),
        ("uncaught exception (rank 0), ending the job:\nTraceback", 1, 2, "rank 0 raised an exception"),
        ("Abort(3) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 3) - process 1", 3, 0,
         "rank 1 aborted the job"),
        # every rank exited by itself (sys.exit("why")): the first to end is not a culprit, and nobody is named
        ("why\n", 1, 1, "the job's ranks exited with a failing status (1)"),
    ],
)  # fmt: skip
def test_how_a_job_ended_is_said_from_what_is_known_for_sure(tail, status, first, said):
    attempt = restarts.Attempt(1, 4, None)
    watched = SimpleNamespace(tail=tail, returncode=status, first_to_end=first)
    restarts._explain(attempt, watched, [])
    assert attempt.ended == said
