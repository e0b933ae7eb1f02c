"""A parameter-server worker's side of the protocol (:mod:`dtrain.parallel.parameter_server` has the picture).

A :class:`Worker` holds the whole model for forward and backward and no optimizer state. After each backward it
pushes every server its slice of the gradient and receives that server's slice of the new weights, all at once
(non-blocking: every shard in flight together), so its wait is for the slowest shard. The coordinator's reply says,
by its tag, whether the epoch is over (END), and the worker then tells the other servers so; and, by its MARKED bit,
that a snapshot has begun (``ps_snapshot.py``): the worker records its state at the end of that step.
"""

from __future__ import annotations

import itertools
import time

from dtrain.comm import new_status, probe, waitall, watchdog
from dtrain.comm.names import ANY_TAG
from dtrain.comm.trace import labelled
from dtrain.parallel.ps_server import DONE, END, PULL, PUSH, WEIGHTS
from dtrain.parallel.ps_snapshot import MARKED


def push_and_pull(comm, params, grads, servers) -> None:
    """Send each server its slice of the gradient (tag PUSH) and receive its slice of the new weights (tag WEIGHTS)
    into ``params``, every message in flight together, then wait for them all. ``servers``: (server rank, (start,
    stop) of its shard), for each; ``params``, ``grads``: the whole flat buffers."""
    waitall(start_push_and_pull(comm, params, grads, servers))


def start_push_and_pull(comm, params, grads, servers) -> list:
    """:func:`push_and_pull`'s messages, posted: their requests, to wait for. A server may hold its reply until other
    workers catch up (stale-synchronous), so no wait comes between them: the worker's wait is for the slowest shard."""
    requests = [comm.Irecv(params[a:b], server, WEIGHTS) for server, (a, b) in servers]
    return requests + [comm.Isend(grads[a:b], server, PUSH) for server, (a, b) in servers]


class Worker:
    """A worker's side of the protocol: the whole model for forward and backward, and no optimizer (the servers
    have it). After its backward, it pushes each server its slice of the gradient and pulls the new weights."""

    def __init__(self, comm, model, served):
        """``comm``: the protocol's communicator; ``served``: (server rank, (start, stop) of its shard), for each."""
        self.comm, self.model, self.served = comm, model, served
        self.status = new_status(comm)
        self.pulled = False
        self.wait_s = 0.0  # time waiting for the servers' weights
        self.steps = 0  # steps in this epoch
        self.seq = 0  # pushes sent: the last one's sequence number (a resume goes on from the cut's)
        self.asked = False  # the coordinator's last reply was marked: a snapshot has begun
        self.snapshots = None  # ps_snapshot.WorkerSnapshots, with --checkpoint-every
        # this epoch before a resume: its steps and loss sum, where in the slices, whether it was over
        self.carried, self.start_at, self.resumed_over = (0, 0.0), 0, False
        self.cursor = 0  # where in the slices this worker is (steps into this pass over them)
        self.losses = []  # this epoch's losses since its start or the resume

    def epoch(self, batches, gradients, once: bool):
        """The steps of one epoch: for each slice, ``gradients(x, y)``, then push and pull; each step's loss. ps-sync
        (``once``): one pass over the slices. ps-async: round them again until the coordinator says the epoch is over.
        After a resume the first pass starts where this worker was; at the end of a step whose coordinator reply was
        marked, the worker records its place (a snapshot)."""
        self.steps, self.losses = 0, []
        skip, self.start_at, self.cursor = self.start_at, 0, self.start_at
        if self.resumed_over:  # resumed where this worker had ended the epoch
            self.resumed_over = False
            return
        passes = len(batches) if hasattr(batches, "__len__") else None
        while True:
            taken = 0
            for x, y in itertools.islice(batches, skip, None):
                loss = gradients(x, y)  # forward and backward; the servers take the optimizer step
                epoch_over = self.push_and_pull()
                self.cursor += 1
                if self.cursor == passes and not once:  # ps-async goes round again: a snapshot's place is the start
                    self.cursor = 0
                self.losses.append(loss)
                if self.asked:
                    self.snapshots.record(self, batches.epoch, epoch_over)
                    self.asked = False
                if self.snapshots is not None:
                    self.snapshots.poll()
                yield loss
                if epoch_over:
                    return
                taken += 1
            skip, self.cursor = 0, 0
            if once or not taken:  # (batches that cannot be gone round again: one pass)
                return

    def push_and_pull(self) -> bool:
        """Send each server its slice of the gradient and receive its slice of the new weights, all at once; True
        when the coordinator's reply says the epoch is over."""
        params, grads = self.model.flat_params, self.model.flat_grads
        if not self.pulled:
            self.pull()
        comm = self.comm
        (coordinator, (a0, b0)), others = self.served[0], self.served[1:]  # the coordinator's reply: epoch over?
        started = time.perf_counter()
        with labelled(comm, "ps/push", grads.nbytes), watchdog.watching(comm, "ps: waiting for the servers"):
            requests = [comm.Isend(grads[a0:b0], coordinator, PUSH)]
            requests += start_push_and_pull(comm, params, grads, others)
            probe(comm, self.status, coordinator, ANY_TAG)  # WEIGHTS, or END: the epoch is over (| MARKED)
            tag = self.status.Get_tag()
            epoch_over, self.asked = tag & ~MARKED == END, bool(tag & MARKED)
            comm.Recv(params[a0:b0], coordinator, tag)
            if epoch_over:  # the other servers stop waiting for this worker in this epoch
                requests += [comm.Isend(params[:0], server, END) for server, _ in others]
            waitall(requests)
        self.wait_s += time.perf_counter() - started
        self.steps += 1
        self.seq += 1
        return epoch_over

    def pull(self, label: str = "ps/pull") -> None:
        """The servers' weights: before the first push (after a resume, the checkpoint's), and for evaluation."""
        params, comm = self.model.flat_params, self.comm
        with labelled(comm, label, 0), watchdog.watching(comm, "ps: pulling the weights"):
            requests = [comm.Irecv(params[a:b], server, WEIGHTS) for server, (a, b) in self.served]
            requests += [comm.Isend(params[:0], server, PULL) for server, _ in self.served]
            waitall(requests)
        self.pulled = True

    def done(self) -> dict:
        """Tell every server this worker is done; what it reports for metrics.json."""
        for server, _ in self.served:
            self.comm.Send(self.model.flat_params[:0], server, DONE)
        return {"held": self.held_bytes(), "wait_s": self.wait_s, "pushes": self.seq}

    def held_bytes(self) -> dict:
        m = self.model
        return {"parameters": m.flat_params.nbytes, "gradients": m.flat_grads.nbytes, "optimizer": 0}

    def parameters(self):
        return self.model.flat_params

    def optimizer_state(self) -> dict:
        raise RuntimeError("a worker holds no optimizer state: the servers do (gathered at the end of training)")

    def load(self, whole, optimizer_state: dict) -> None:
        """The whole model (the servers load the optimizer state, shard by shard)."""
        self.model.flat_params[...] = whole
