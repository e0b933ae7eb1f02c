"""Which rank of a job ended first, seen from outside the job: the one that died, when one was killed."""

from __future__ import annotations

import os
import select
import threading
import time

from dtrain.launch import processes


class Endings:
    """The order in which the ranks' processes end, seen from outside the job.

    When one rank dies, MPI's process manager kills the others, and its report names one of the processes it
    reaped, often not the one that died first. A thread here sleeps in ``poll`` on a Linux ``pidfd`` of each rank's
    process (readable when that process ends, whoever its parent is), so it wakes the moment the first one ends,
    before the process manager has even begun to kill the rest. The first is known for sure only if every rank was
    watched, alive, before it ended (a rank that dies in its first tenth of a second, or one on another machine,
    leaves it unknown; so do systems without pidfds)."""

    def __init__(self):
        self.order: list[int] = []
        self.when: dict[int, float] = {}  # rank -> when its process was seen ending (time.monotonic())
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self._wake_read = self._wake_write = None
        self.watched = 0  # ranks watched while alive
        self.watched_at_first_end: int | None = None
        self.late = False  # a rank was seen only once it had ended
        self.first_together: list[int] = []  # the ranks seen ending first, all at once
        self._poll = select.poll() if hasattr(os, "pidfd_open") else None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self._poll is not None:
            self._wake_read, self._wake_write = os.pipe()
            self._poll.register(self._wake_read, select.POLLIN)
            self._thread.start()
        return self

    def watch(self, pid: int, rank: int) -> None:
        if self._poll is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # it has ended already (or pidfds are not allowed here)
            return
        stat = processes.stat_of(pid)
        if stat is None or stat[0] == "Z":
            self.late = True
        else:
            self.watched += 1
        self._fds[fd] = rank
        self._poll.register(fd, select.POLLIN)
        os.write(self._wake_write, b"x")  # (poll's set changed: look again)

    def first(self, nranks: int) -> int | None:
        """The rank that ended first, if every one of the ``nranks`` was watched alive before it did."""
        if len(self.first_together) == 1 and not self.late and self.watched_at_first_end == nranks:
            return self.first_together[0]
        return None

    def _run(self) -> None:
        while not self._closed:
            together = []  # ranks that ended between two looks: their order is not known
            events = self._poll.poll()
            now = time.monotonic()
            for fd, _ in events:
                if fd == self._wake_read:
                    os.read(fd, 4096)
                    continue
                together.append(self._fds.pop(fd))
                self._poll.unregister(fd)
                os.close(fd)
            if together and not self.order:
                self.watched_at_first_end, self.first_together = self.watched, sorted(together)
            self.order += together
            self.when.update(dict.fromkeys(together, now))

    def __exit__(self, *exc_info):
        if self._poll is None:
            return
        self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # (never seen): its descriptors stay open rather than be closed under it
            return
        for fd in [*self._fds, self._wake_read, self._wake_write]:
            os.close(fd)
