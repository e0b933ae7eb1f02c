"""Who sent to whom in a check: a :class:`Recorder` notes where every message of the learner's function went, and
the closed forms of a binomial tree's edges say where they should have gone (exercises 2.2 and 2.3; gossip's 6.1)."""

from __future__ import annotations

from dtrain.comm.wrapper import CommWrapper, forward


class Recorder(CommWrapper):
    """A communicator that notes every message this rank sends, ``(dest, bytes)``, in ``sent`` (the check reads
    and clears it after each call of the learner's function). Sub-communicators are passed through unrecorded."""

    def __init__(self, comm):
        super().__init__(comm)
        self.sent: list[tuple[int, int]] = []

    def p2p(self, call):
        if call.sends:
            self.sent.append((int(call.dest), int(call.sendbuf.nbytes)))
        return forward(self.comm, call)

    def sibling(self, comm):
        return comm

    def take(self) -> list[tuple[int, int]]:
        sent, self.sent = self.sent, []
        return sent


def messages(comm, recorder) -> list[tuple[int, int, int]]:
    """Every message of the world since the last call, ``(source, dest, bytes)`` (an object all-gather: uncounted)."""
    everyone = comm.allgather(recorder.take())
    return sorted((source, dest, nbytes) for source, sent in enumerate(everyone) for dest, nbytes in sent)


def arrows(edges) -> str:
    return ", ".join(f"{a} -> {b}" for a, b in edges) or "none"


def tree_parents(p: int, root: int) -> dict[int, int]:
    """The binomial tree rooted at ``root``: each other rank's parent. Relative to the root (v = (rank - root) % p),
    v's parent is v with its lowest set bit cleared."""
    return {(v + root) % p: (v - (v & -v) + root) % p for v in range(1, p)}


def tree_traffic(sent, p: int, root: int, nbytes: int, upward: bool, what: str) -> str | None:
    """``sent`` (every message of the case) against the binomial tree rooted at ``root``: each edge once, the whole
    buffer each time, child to parent (``upward``, a reduce) or parent to child (a broadcast). Returns what is wrong,
    or None."""
    parents = tree_parents(p, root)
    expected = sorted((c, q) if upward else (q, c) for c, q in parents.items())
    actual = [(a, b) for a, b, _ in sent]
    if actual == expected:
        wrong_size = [(a, b, n) for a, b, n in sent if n != nbytes]
        if not wrong_size:
            return None
        a, b, n = wrong_size[0]
        return f"the message {a} -> {b} carried {n} bytes; {what} sends the whole buffer ({nbytes} bytes) each time"
    lines = [f"the messages went {arrows(actual)}; {what} rooted at {root} sends exactly {arrows(expected)} "
             f"(p - 1 = {p - 1} messages, one {'from' if upward else 'to'} every rank but the root)"]  # fmt: skip
    for a, b in actual:
        child = a if upward else b
        if child == root:
            lines.append(f"rank {a} sent to rank {b}, but the root {'sends nothing' if upward else 'receives nothing'} "
                         f"in {what}")  # fmt: skip
            break
        if child in parents and (b if upward else a) != parents[child]:
            v = (child - root) % p
            lines.append(f"rank {a} sent to rank {b}: rank {child}'s parent is rank {parents[child]} (v = (rank - "
                         f"root) % p = {v}; parent v - lowbit(v) = {v - (v & -v)}, plus the root {root}, "
                         "mod p)")  # fmt: skip
            break
    return "\n".join(lines)
