"""A parameter server's side of the protocol (:mod:`dtrain.parallel.parameter_server` has the picture).

A :class:`Server` owns a shard of the flat parameter buffer and that shard's optimizer. Its :class:`ServerLoop` takes
the next message from any worker (``Probe(ANY_SOURCE)``, then the receive the tag calls for) and answers it, until
every worker has said DONE, with one method per message. The policy shows in the PUSH handler: ps-sync keeps each
push and steps once all W are in; ps-async steps on every push, and with a staleness bound K holds back the reply to
a worker more than K steps ahead of the slowest (stale-synchronous). The worker's side is in ``ps_worker.py``.

**Termination.** Each worker sends DONE to every server after its last step; a server leaves its loop once all W
workers are done (a DONE can only follow that worker's last reply, so nothing is in flight). Then every rank meets in
``finish``: the servers' shards and optimizer states are gathered, so every rank ends with the final model.
**Snapshots** (``--checkpoint-every``): a PUSH of 0 bytes is a worker's marker (``ps_snapshot.py``).
"""

from __future__ import annotations

import collections
import time

import numpy as np

from dtrain.backend import array_module, to_host
from dtrain.comm import new_status, probe, waitall, watchdog
from dtrain.comm.names import ANY_SOURCE, ANY_TAG
from dtrain.comm.trace import EVALUATION, labelled
from dtrain.optim import FlatBuffers, state_bytes
from dtrain.parallel.ps_snapshot import MARKED, ServerRecording, replay

PUSH, PULL, DONE, WEIGHTS, END = 1, 2, 3, 4, 5  # the protocol's tags (END: the weights, and the epoch is over)
COORDINATOR = 0  # the server (by index) that counts an epoch's pushes and tells each worker when it is over


def stale_synchronous_ready(waiting, clock, running, bound):
    """The held workers that may be answered now: those of ``waiting`` (in its order) no more than ``bound`` steps
    ahead of the slowest worker of ``running``, ``clock[w]`` being worker w's steps (pushes) so far. ``bound`` 0 is
    lockstep (ps-sync's pace), None no bound at all (ps-async: everyone); with no worker running the slowest is at 0."""
    slowest = min((clock[w] for w in running), default=0)
    return [w for w in waiting if bound is None or clock[w] - slowest <= bound]


class ProtocolError(RuntimeError):
    """A message the protocol has no place for (a bug, reported instead of a hang)."""


class Server:
    """A server's side: shard ``index`` of the whole flat buffer (``bounds[index]``), its optimizer, and its loop."""

    def __init__(self, comm, whole, bounds, index: int, make_optimizer, *, workers: int, synchronous: bool,
                 bound: int | None):  # fmt: skip
        """``whole``: the initial flat parameters (every rank builds the same from the seed); this server keeps its
        slice of them."""
        xp = array_module(whole)
        self.comm, self.index, self.workers = comm, index, workers
        self.synchronous, self.bound = synchronous, bound
        self.start, self.stop = bounds[index]
        shard = whole[self.start : self.stop].copy()
        self.shard = FlatBuffers(shard, xp.zeros_like(shard))
        self.optimizer = make_optimizer(self.shard)
        # ps-sync keeps each worker's push in a slot of its own and sums them in worker order: reproducible
        self.slots = xp.empty((workers, self.stop - self.start), dtype=whole.dtype) if synchronous else None
        self.loop, self.serve_s = None, 0.0

    def serve(self, steps_per_epoch: int, lr: float, done: int = 0, *, start: int = 0, snapshots=None, every: int = 0,
              injector=None, resumed=None) -> None:  # fmt: skip
        """Answer the workers until every one has said DONE; ``lr``: the run's learning rate; ``done``: the steps of
        the first epoch already taken (a resume from a checkpoint in the middle of an epoch), ``start`` the global steps
        (the first one's, from 0). ``snapshots``: the
        communicator a recording goes to rank 0 on, one every ``every`` global steps; ``injector``: this rank's
        fault injector; ``resumed``: this server's recording at the cut a resume goes on from (header, rows)."""
        if not self.synchronous:  # each push is 1/W of a step (set here, after any checkpoint's state was loaded)
            self.optimizer.lr = lr / self.workers
        self.loop = ServerLoop(self.comm, self.shard, self.optimizer, workers=self.workers, server=self.index,
                               steps_per_epoch=steps_per_epoch, synchronous=self.synchronous, bound=self.bound,
                               slots=self.slots, done=done, start=start, snapshots=snapshots, every=every,
                               injector=injector)  # fmt: skip
        if resumed is not None:
            self.loop.replayed = replay(self.loop, *resumed)
        started = time.perf_counter()
        self.loop.run()
        self.serve_s = time.perf_counter() - started
        self.optimizer.lr = lr  # (what a checkpoint stores)

    def done(self) -> dict:
        """What this server reports at the end: its shard and optimizer state (to be gathered), and its figures."""
        loop = self.loop
        return {
            "held": self.held_bytes(),
            "params": to_host(self.shard.flat_params),
            "optimizer": self.optimizer.state_dict(),
            "staleness": dict(loop.staleness) if loop else {},
            "updates": loop.version if loop else 0,
            "applied": list(loop.clock) if loop else [0] * self.workers,  # each worker's pushes this shard took
            "replayed": loop.replayed if loop else 0,
            "snapshots": loop.ordinal if loop else 0,
            "busy_fraction": 1.0 - loop.idle_s / self.serve_s if loop and self.serve_s else 0.0,
        }

    def held_bytes(self) -> dict:
        slots = self.slots.nbytes if self.slots is not None else 0  # (ps-sync's, a row a worker)
        return {"parameters": self.shard.flat_params.nbytes, "gradients": self.shard.flat_grads.nbytes + slots,
                "optimizer": state_bytes(self.optimizer)}  # fmt: skip

    def parameters(self):
        return self.shard.flat_params

    def load(self, whole, optimizer_state: dict) -> None:
        """This server's shard of the whole model and of the whole optimizer state."""
        self.shard.flat_params[...] = whole[self.start : self.stop]
        self.optimizer.load_state_dict({k: v[self.start : self.stop] if isinstance(v, np.ndarray) else v
                                        for k, v in optimizer_state.items()})  # fmt: skip


class ServerLoop:
    """One server's loop: it takes the next message from any worker and answers it, until every worker is done.

    The coordinator (server 0) also keeps the epochs: after W x ``steps_per_epoch`` pushes it answers END instead of
    WEIGHTS, to each worker once, and the worker passes END on to the other servers. Every server holds back the reply
    to a worker more than K steps ahead of the slowest worker still in the epoch (each shard's weights must be sent
    after the updates the bound waits for); a worker that has ended the epoch, or said DONE, is no longer the slowest.
    """

    def __init__(self, comm, shard, optimizer, *, workers: int, server: int, steps_per_epoch: int, synchronous: bool,
                 bound: int | None = None, slots=None, done: int = 0, start: int = 0, snapshots=None, every: int = 0,
                 injector=None):  # fmt: skip
        """``comm``: the protocol's communicator (workers are its ranks 0 to ``workers`` - 1); ``shard``: this
        server's slice (``flat_params``, ``flat_grads``), which ``optimizer`` updates; ``server``: this server's index
        (0 is the coordinator); ``synchronous``: ps-sync's policy, else ps-async's, with the staleness ``bound``;
        ``slots``: ps-sync's (workers x shard) array, a row for each worker's push; ``done``: the first epoch's
        steps already taken before a resume, ``start`` the global steps; ``snapshots``, ``every``, ``injector``: see
        :meth:`Server.serve`."""
        self.comm, self.status = comm, new_status(comm)
        self.params, self.grads, self.optimizer, self.slots = shard.flat_params, shard.flat_grads, optimizer, slots
        self.workers, self.bound, self.synchronous = workers, bound, synchronous
        self.coordinator = server == COORDINATOR
        self.budget = workers * steps_per_epoch  # pushes in an epoch (the coordinator counts them)
        self.pushes = workers * done  # this epoch's so far
        self.version = 0  # updates applied to this shard
        self.sent_version = [0] * self.workers  # the version each worker's weights are at
        self.clock = [0] * self.workers  # pushes taken from each worker: its sequence number, as this shard knows it
        self.total = workers * start  # pushes taken since training began (what the snapshots count: global step x W)
        self.total_before = self.total  # (those of the run this resumed: a server's fault counts this run's)
        self.server, self.injector = server, injector
        self.snapshots, self.every = snapshots, every
        self.recordings = {}  # ps_snapshot.ServerRecording of each snapshot being taken, by its ordinal
        self.markers = [0] * workers  # markers from each worker so far: its k-th is snapshot k's (FIFO)
        self.ordinal = self.snapshots_taken = 0  # the coordinator's: snapshots begun; the last one's number; and the
        self.mark = set()  # workers whose next reply is marked (the snapshot has begun)
        self.sends, self.replayed = [], 0  # recordings on their way to rank 0; pushes replayed after a resume
        self.waiting = []  # workers whose reply is held back (stale-synchronous)
        self.arrived = []  # ps-sync: workers whose push for this step is in
        self.ended, self.done = set(), set()  # workers that have ended this epoch; that have finished
        self.pulled = set()  # workers that have had their first weights
        self.staleness = collections.Counter()
        self.idle_s = 0.0  # time spent waiting for a message
        self.handlers = {PUSH: self.on_sync_push if synchronous else self.on_async_push, PULL: self.on_pull,
                         END: self.on_end, DONE: self.on_done}  # fmt: skip

    def run(self) -> None:
        while len(self.done) < self.workers:
            t0 = time.perf_counter()
            with watchdog.watching(self.comm, "ps server: waiting for any worker"):
                probe(self.comm, self.status, ANY_SOURCE, ANY_TAG)
            self.idle_s += time.perf_counter() - t0
            w, tag = self.status.Get_source(), self.status.Get_tag()
            if tag not in self.handlers:
                raise ProtocolError(f"server rank {self.comm.Get_rank()}: unexpected tag {tag} from rank {w}")
            if tag == PUSH and self.status.Get_count() == 0:
                self.on_marker(w)
            else:
                self.handlers[tag](w)
        waitall(self.sends)  # (rank 0 posted their receives before the last marker came)

    # --- one method per message ----------------------------------------------------------------------------------
    def on_sync_push(self, w: int) -> None:
        """ps-sync: keep the push; once all W are in, average them in worker order, update, answer everyone."""
        self.comm.Recv(self.slots[w], w, PUSH)
        for recording in self.recordings.values():
            recording.note("push", w, self.slots[w])
        if self.take_push(w, None, 0):
            self.after_update()
            self.reply(range(self.workers))
        else:
            self.after_push()

    def on_async_push(self, w: int) -> None:
        """ps-async: apply the push now (at lr / W), note its staleness, answer when the bound allows."""
        self.comm.Recv(self.grads, w, PUSH)
        staleness = self.version - self.sent_version[w]
        for recording in self.recordings.values():
            recording.note("push", w, self.grads, staleness)
        self.take_push(w, None, staleness)
        self.after_update()
        self.waiting.append(w)
        self.release()

    def take_push(self, w: int, data, staleness: int) -> bool:
        """Take w's push (``data``, or already in its buffer): ps-async applies it, ps-sync keeps it until the
        step's W are in. True when the shard was updated. (A resume replays the pushes in flight through here.)"""
        self.pushes += 1
        self.total += 1
        self.clock[w] += 1
        if not self.synchronous:
            if data is not None:
                self.grads[...] = data
            self.staleness[staleness] += 1
            self.optimizer.step()
            self.version += 1
            return True
        if data is not None:
            self.slots[w] = data
        self.arrived.append(w)
        if len(self.arrived) < self.workers:
            return False
        array_module(self.grads).sum(self.slots, axis=0, out=self.grads)
        self.grads *= 1.0 / self.workers
        self.optimizer.step()
        self.version += 1
        self.staleness[0] += self.workers
        self.arrived.clear()
        return True

    def after_push(self) -> None:  # DTRAIN_FAULT on a server: this run's pushes taken / W (faults.py)
        if self.injector is not None:
            self.injector.at_pushes(self.total - self.total_before, self.workers)

    def after_update(self) -> None:
        """The coordinator begins snapshot m once m x N x W pushes are in and no worker is between two epochs (a
        worker that had ended it would record in the next: ``ps_snapshot.py``); its next reply to each is marked."""
        self.after_push()
        number = self.total // (self.every * self.workers) if self.every else 0
        if (self.server == COORDINATOR and number > self.snapshots_taken and not self.recordings
                and not self.ended and not self.done):  # fmt: skip
            self.snapshots_taken, self.ordinal = number, self.ordinal + 1
            self.recordings[self.ordinal] = ServerRecording(self, self.ordinal, number)
            self.mark = set(range(self.workers))

    def on_marker(self, w: int) -> None:
        """Worker w's marker (a PUSH of 0 bytes), its k-th: the first of snapshot k to come starts this server's
        recording of it (another worker's marker of k + 1 can come before w's of k); the last one ends it, and the
        recording goes to rank 0."""
        self.comm.Recv(self.params[:0], w, PUSH)
        self.markers[w] += 1
        k = self.markers[w]
        recording = self.recordings.get(k)
        if recording is None:
            recording = self.recordings[k] = ServerRecording(self, k)
        if recording.marker(w):
            self.sends += recording.send(self.snapshots, self.server)
            del self.recordings[k]

    def on_pull(self, w: int) -> None:
        """A worker's first pull is training's; later ones are for evaluating (counted apart, as the worker does)."""
        self.comm.Recv(self.params[:0], w, PULL)
        with labelled(self.comm, "ps/pull" if w not in self.pulled else EVALUATION, 0):
            self.comm.Send(self.params, w, WEIGHTS)
        self.pulled.add(w)
        self.sent_version[w] = self.version

    def on_end(self, w: int) -> None:
        """(Not on the coordinator.) The coordinator has ended the epoch for w, who may have been the slowest."""
        self.comm.Recv(self.params[:0], w, END)
        for recording in self.recordings.values():
            recording.note("end", w)
        self.end_epoch([w])
        self.release()

    def on_done(self, w: int) -> None:
        self.comm.Recv(self.params[:0], w, DONE)
        self.done.add(w)
        self.release()  # the slowest may just have left

    # --- answering ---------------------------------------------------------------------------------------------
    def reply(self, workers) -> None:
        """Send the shard's weights to ``workers`` (END instead of WEIGHTS once the coordinator's budget is spent)."""
        tag = END if self.coordinator and self.pushes >= self.budget else WEIGHTS
        with labelled(self.comm, "ps/weights", self.params.nbytes):  # (all sent before the next update changes it)
            waitall([self.comm.Isend(self.params, w, tag | MARKED if w in self.mark else tag) for w in workers])
        for w in workers:
            self.sent_version[w] = self.version
            self.mark.discard(w)
        if tag == END:
            self.end_epoch(workers)

    def release(self) -> None:
        """Answer every held worker no more than K steps ahead of the slowest still in the epoch (all of them once
        the epoch's budget is spent); an answer can end the epoch for its worker, which can free others."""
        while True:
            running = [w for w in range(self.workers) if w not in self.done and w not in self.ended]
            spent = self.pushes >= self.budget
            ready = stale_synchronous_ready(self.waiting, self.clock, running, None if spent else self.bound)
            if not ready:
                return
            self.waiting = [w for w in self.waiting if w not in ready]
            self.reply(ready)

    def end_epoch(self, workers) -> None:
        self.ended.update(workers)
        if len(self.ended) == self.workers:  # every worker has ended the epoch: the next one starts at 0
            self.pushes = 0
            self.ended.clear()
