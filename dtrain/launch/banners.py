"""MPI's own words on how a job ended, kept out of what a person reads: the launcher says it in a line of its own.

When a rank dies, MPICH's process manager prints a box; on Ctrl-C, two lines of its own; after an ``MPI_Abort``, one
more; Open MPI frames its reports in lines of dashes::

    (a blank line)
    ===================================================================================
    =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
    =   PID 8389 RUNNING AT vm           ...         =   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
    ===================================================================================
    YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
    This typically refers to a problem with your application.
    Please see the FAQ page for debugging suggestions
    [mpiexec@vm] Press Ctrl-C again to force abort                 (hydra, on Ctrl-C: often without a newline)
    Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1) - process 1

:class:`Banners` reads a job's output as it comes and holds these back (:attr:`Banners.held`), for whoever explains
the ending to keep or show. It must never cost a learner a line of their own, nor delay one for long:

* a line with one of the sentences above is MPI's (nobody else prints "YOUR APPLICATION TERMINATED WITH ...");
* a blank line, a rule of ``=`` or one of dashes is held only while what follows may still make it MPI's: a rule
  followed by "=   BAD TERMINATION ..." is the box, dashes followed by Open MPI's words on a dead rank are its frame
  (at most :data:`FRAME_LINES` lines); anything else, and the held lines go out unchanged;
* a line still being written goes out at once unless it may be the start of one of these;
* nothing waits longer than :data:`WAIT_S`: MPI writes each banner in one go, so a line held longer than that is
  somebody else's (a prompt, a progress bar redrawn with ``\\r``) and goes out;
* bytes go out as they came (``\\r\\n``, binary): only the held ones are missing.
"""

from __future__ import annotations

import re

WAIT_S = 0.25  # the longest a line is held back to see what follows it
FRAME_LINES = 40  # Open MPI's longest report is shorter: a longer "frame" is someone else's

SENTENCE = re.compile(
    rb"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*"
    rb"|This typically refers to a problem with your application\."
    rb"|Please see the FAQ page for debugging suggestions"
    rb"|\[mpiexec@[^\]]*\] (Sending Ctrl-C to processes as requested|Press Ctrl-C again to force abort)"
    rb"|\[mpiexec@[^\]]*\] \S+ \(\S+:\d+\): .*"  # hydra's own errors once its proxies are gone
    rb"|Abort\(\d+\) on node \d+.*MPI_Abort.*"
    rb"|\[[^\]]*\] \*\*\* (An error occurred in|MPI_ABORT was invoked).*"
)  # fmt: skip
RULE = re.compile(rb"={20,}")  # the top and the bottom of MPICH's box
BOX_FIRST = b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
BOX_LINE = re.compile(rb"=   .*")
DASHES = re.compile(rb"-{20,}")  # Open MPI's frame
FRAME_FIRST = re.compile(rb".*(noticed that process rank|MPI_ABORT was invoked|exited on signal|aborted the job).*")
STARTS = (b"YOUR APPLICATION", b"This typically", b"Please see the FAQ", b"[", b"Abort(", b"=", b"-")


class Banners:
    """One stream of a job's output, MPI's banners held back: :meth:`feed` what comes, show what it returns; call
    :meth:`due` when nothing came for a while, and :meth:`finish` at the end of the stream."""

    def __init__(self):
        self.held = bytearray()
        self._pending: list[bytes] = []  # whole lines held to see what follows them
        self._partial = b""  # a line still being written, held back
        self._passing = False  # the line being written was let through: the rest of it follows unread
        self._state = "line"  # or "rule?", "box", "frame?", "frame"
        self._since: float | None = None  # when what is held back now began to wait

    def feed(self, chunk: bytes, now: float) -> bytes:
        """What of ``chunk`` may be shown now (``now``: a monotonic clock's seconds)."""
        out = bytearray()
        if self._passing:
            end = chunk.find(b"\n")
            out += chunk if end < 0 else chunk[: end + 1]
            chunk = b"" if end < 0 else chunk[end + 1 :]
            self._passing = end < 0
        lines = (self._partial + chunk).splitlines(keepends=True)
        self._partial = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        for line in lines:
            out += self._line(line)
        if self._partial and self._state == "line" and not self._pending and not _may_start(self._partial):
            out += self._partial
            self._partial, self._passing = b"", True
        held_back = bool(self._pending or self._partial)
        self._since = (self._since or now) if held_back else None
        return bytes(out + self.due(now))

    def due(self, now: float) -> bytes:
        """What has waited :data:`WAIT_S` and goes out now (a learner's line, after all)."""
        if self._since is None or now - self._since < WAIT_S:
            return b""
        return self.finish()

    def finish(self) -> bytes:
        """Everything still held back, but MPI's own: the stream has ended (or waited long enough)."""
        out = b"".join(self._pending)
        self._pending, self._state, self._since = [], "line", None
        if self._partial:
            if SENTENCE.fullmatch(self._partial.rstrip(b"\r\n")):  # (hydra's last words come without a newline)
                self.held += self._partial
            else:
                out += self._partial
                self._passing = True
            self._partial = b""
        return out

    def _line(self, line: bytes) -> bytes:
        """What to show of one whole line, as the state of the stream says."""
        text = line.rstrip(b"\r\n")
        if self._state == "box":
            if RULE.fullmatch(text) or BOX_LINE.fullmatch(text):
                self.held += line
                self._state = "line" if RULE.fullmatch(text) else "box"  # (the bottom rule ends the box)
                return b""
            self._state = "line"
        elif self._state == "rule?":
            last = self._pending[-1].rstrip(b"\r\n")
            if RULE.fullmatch(last) and text == BOX_FIRST:
                self.held += b"".join(self._pending) + line
                self._pending, self._state = [], "box"
                return b""
            if not last.strip() and RULE.fullmatch(text):  # a blank line, then a rule: the box may follow
                self._pending.append(line)
                return b""
            return self._release() + self._line(line)
        elif self._state == "frame?":
            if not FRAME_FIRST.fullmatch(text):
                return self._release() + self._line(line)
            self._pending.append(line)
            self._state = "frame"
            return b""
        elif self._state == "frame":
            self._pending.append(line)
            if DASHES.fullmatch(text):
                self.held += b"".join(self._pending)
                self._pending, self._state = [], "line"
            elif len(self._pending) > FRAME_LINES:
                return self._release()
            return b""
        if SENTENCE.fullmatch(text):
            self.held += line
            return b""
        if not text.strip() or RULE.fullmatch(text) or DASHES.fullmatch(text):
            self._pending = [line]
            self._state = "frame?" if DASHES.fullmatch(text) else "rule?"
            return b""
        return line

    def _release(self) -> bytes:
        out = b"".join(self._pending)
        self._pending, self._state = [], "line"
        return out


def _may_start(start: bytes) -> bool:
    """Whether a line that begins with ``start`` may turn out to be one of MPI's (or a blank one)."""
    return not start.strip() or any(s.startswith(start) or start.startswith(s) for s in STARTS)
