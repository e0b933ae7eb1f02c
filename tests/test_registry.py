"""Adding a paradigm is one new file: its class, its flags and its checks, found by the registry and the CLI.

The file here lives outside the package, as a learner's exercise would, and is named by ``$DTRAIN_PARADIGMS``.
Its algorithm is the plainest data parallelism (MPI's own ``Allreduce`` of the gradients, then the mean), so the
oracle is dtrain's ``ddp`` with ``--allreduce mpi``: the same sums in the same order, the same weights bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dtrain.launch import launcher

MODULE = "learner_paradigm"
PARADIGM = textwrap.dedent('''
    """Data parallelism in a dozen lines: average the gradients with MPI's own all-reduce after every backward."""

    from dtrain.comm.names import IN_PLACE, SUM
    from dtrain.parallel import Paradigm, check_replicas, register
    from dtrain.parallel.flags import Flag

    VERIFY_EVERY = Flag("verify_every", 0, "compare every rank's weights every N steps (0: never)", type=int,
                        metavar="N", at_least=0)


    @register
    class PlainDataParallel(Paradigm):
        name = "plain-ddp"
        summary = "gradients averaged with MPI's own Allreduce (a learner's first data parallelism)"
        flags = (VERIFY_EVERY,)

        def __init__(self, comm, config):
            super().__init__(comm, config)
            self.steps = 0

        def step(self, x, y):
            loss = self.gradients(x, y)
            self.comm.Allreduce(IN_PLACE, self.model.flat_grads, op=SUM)
            self.model.flat_grads *= self.model.flat_grads.dtype.type(1 / self.world)
            self.optimizer.step()
            self.steps += 1
            if self.config.verify_every and self.steps % self.config.verify_every == 0:
                check_replicas(self.comm, self.model.flat_params, f"after step {self.steps}")
            return loss

        def global_loss(self, local_mean):
            return self.comm.allreduce(local_mean) / self.world
''')


@pytest.fixture
def learner(tmp_path):
    (tmp_path / f"{MODULE}.py").write_text(PARADIGM)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "DTRAIN_PARADIGMS": MODULE}


def dtrain(*args, env, cwd):
    return subprocess.run([sys.executable, "-m", "dtrain", *map(str, args)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_new_paradigm_and_its_flag_are_in_the_help(learner, tmp_path):
    result = dtrain("train", "--help", env=learner, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "plain-ddp: gradients averaged with MPI's own Allreduce" in result.stdout
    assert "--paradigm plain-ddp: gradients averaged" in result.stdout  # its own group of flags
    assert "--verify-every N" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--paradigm", "ddp", "--verify-every", "3"], "--verify-every is a flag of --paradigm plain-ddp, not of ddp"),
        (["--paradigm", "plain-ddp", "--verify-every", "-1"], "--verify-every must be >= 0, got -1"),
    ],
)
def test_the_new_flag_is_checked_like_every_other(learner, tmp_path, args, message):
    result = dtrain("train", *args, "--epochs", "1", env=learner, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"dtrain: error: {message}"], result


def test_a_module_that_cannot_be_found_is_one_line(tmp_path):
    env = {**os.environ, "DTRAIN_PARADIGMS": "no_such_learner_module"}
    result = dtrain("train", "--epochs", "1", env=env, cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        "dtrain: error: DTRAIN_PARADIGMS names 'no_such_learner_module', which Python cannot find (is its folder on "
        "PYTHONPATH?)"
    ], result.stderr


@pytest.mark.mpi
def test_the_new_paradigm_trains_through_dtrain_train_and_matches_ddp(learner, tmp_path):
    common = ["-m", "dtrain", "train", "--epochs", "2", "--batch-size", "63", "--quiet", "--no-progress"]
    runs = {"plain": ["--paradigm", "plain-ddp", "--verify-every", "5"], "ddp": ["--paradigm", "ddp", "--allreduce",
                                                                              "mpi"]}  # fmt: skip
    metrics = {}
    for run, flags in runs.items():
        result = launcher.launch(3, [*common, *flags, "--out", str(tmp_path / run)], timeout=240, capture=True,
                                 env=learner, cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        metrics[run] = json.loads((tmp_path / run / "metrics.json").read_text())
    assert metrics["plain"]["config"]["verify_every"] == 5  # metrics.json's config holds the new flag too
    assert metrics["plain"]["final"]["test_accuracy"] > 0.9
    assert metrics["plain"]["weights_sha256"] == metrics["ddp"]["weights_sha256"]
    assert [e["train_loss"] for e in metrics["plain"]["epochs"]] == [e["train_loss"] for e in metrics["ddp"]["epochs"]]


def test_the_base_class_documents_exactly_its_members_in_three_groups():
    """Paradigm's docstring lists its members in three groups (what the driver calls, the hooks of a step, what the
    planner asks); the list and the class must not drift apart: a member added or removed is a member documented."""
    import inspect

    from dtrain.parallel import Paradigm

    doc = inspect.cleandoc(Paradigm.__doc__)
    groups = doc.split("**")[1::2]
    assert groups == ["What the driver calls", "The hooks of a step", "What the planner asks"], groups
    documented = set()
    for block in doc.split("::")[1:]:
        for line in block.splitlines():
            if line.startswith("    ") and not line.startswith("     "):  # a member's line, not its notes
                call = re.match(r"(\w+)\(", line.strip())  # build(make_model, ...) ...
                listed = re.match(r"(\w+(?:, \w+)*)\s{2,}", line.strip())  # name, summary, flags, order   ...
                documented |= {call.group(1)} if call else set(listed.group(1).split(", "))
    members = {name for name in vars(Paradigm) if not name.startswith("__")} | {"__init__"}
    assert documented == members, (documented - members, members - documented)
    assert 13 <= len(documented & {*members}) and len(members) <= 26
