"""Exercise 2.6's check: the shared-memory all-reduce, and a model of the window's memory under which a missing or
misplaced fence fails every time on simulated ranks.

Under ``mpiexec`` the learner's window is MPI's own (``windows.allocate`` on the real communicator): the check holds
the result against the sum over the ranks and counts messages (none: the ranks load and store each other's memory).
A forgotten fence there may pass by luck on one machine and fail on another.

On simulated ranks (threads of one process) the ranks would share the very same arrays, and a forgotten fence would
mostly go unseen as well. So the check hands the learner's function a :class:`WeakMemory`, a communicator whose
``Allocate_shared`` (what ``windows.allocate`` asks a simulated communicator for) gives every rank *a copy of its
own* of every segment, and whose fences publish what the ranks stored::

    rank r stores into any segment       -> into rank r's copy only (rank r sees its own stores at once)
    win.fence() (its Barrier)            -> every rank's stores since the last fence (the bytes where its copy
                                            differs from the window's memory) go into the window's memory, in
                                            rank order, and every rank's copies are refreshed from it
    a new window                         -> a signalling NaN of the case's dtype in every element until someone
                                            stores there and a fence follows (summing it stores another NaN)

So a rank sees another's store exactly when a fence follows it, never earlier and never by luck: the pessimistic
reading of MPI's rule ("visible after Win.Sync, Barrier, Win.Sync"). A ``comm.Barrier()`` that is not a window's
``fence()`` orders the ranks but publishes nothing, as on a weakly ordered CPU without ``Win.Sync``. At every fence
(and once more when the call returns) the model looks at what each rank stored (an element whose bytes changed in
its copy), and knows for every element of every segment who first stored it and between which fences. What it
finds, at most one finding per rank and case, the first of:

1. a rank stored a NaN made from the new window's (its payload says so), or holds NaN in ``buf`` at the end: it
   loaded window memory that no store and fence had made visible to it, and summed it. The first such element
   names the chunk; the model looks at that place in every other rank's segment (in rank order, then the rank's
   own) and says what was there: "rank 1 read rank 0's chunk 1 (buf[1:2]) before rank 0's fence: rank 0 wrote it
   before fence 1, and rank 1 read it then too, with no fence between" (fence 1 forgotten), "rank 1 read rank 0's
   chunk 1 (buf[1:2]) before rank 0 had written it and fenced: rank 0 wrote it before fence 1, and rank 1 read it
   before fence 1 too (it stored what it read only between fence 1 and fence 2)" (the load came before the owner's
   copy and fence), or "... before anyone wrote it" (nobody ever stored there);
2. two ranks stored into the same element between the same two fences: a race (the model keeps the higher rank's);
3. a rank stored into another rank's segment after its last fence: no fence followed, so the owner need not see it;
4. a rank made no fence at all (with more than one rank): whatever it computed, it was not through the window.
"""

from __future__ import annotations

import itertools
import sys
import threading

import numpy as np

from dtrain.collectives._chunks import chunk_offsets
from dtrain.comm import windows
from dtrain.comm.wrapper import CommWrapper, forward, innermost
from dtrain.course.exercises.checks.collectives import DTYPES, elements, sizes, untouched
from dtrain.course.exercises.grading import plural, rank_values

# A new window holds signalling NaNs of the case's dtype: arithmetic on one gives a quiet NaN, other bits, so a rank
# that sums garbage and stores the sum where garbage was is still seen to have stored (a store is a changed byte).
# The NaN carries its payload through sums (x86, Arm), so a stored value is known to come from the garbage by its
# bits, quiet or not, either sign: not a NaN from elsewhere, nor an integer the window holds (-1 is a NaN's bits).
POISON = {np.dtype(np.float64): np.array([0x7FF4_0000_0000_0001], dtype=np.uint64),
          np.dtype(np.float32): np.array([0x7FA0_0001], dtype=np.uint32)}  # fmt: skip
QUIET = {np.dtype(np.float64): 1 << 51, np.dtype(np.float32): 1 << 22}  # the bit that makes a NaN quiet
ALGORITHM = "a shared-memory all-reduce (the ranks load and store each other's segments)"
FENCES = "fence 1 after copying buf in, fence 2 after storing the sums"
# A Barrier called from one of these is a window's fence: SharedWindow.fence, and windows.fence (several windows at
# once, as dtrain's own shm.allreduce fences its control window and its scratch together).
_FENCES = frozenset(f.__code__ for f in (windows.SharedWindow.fence, getattr(windows, "fence", None)) if f is not None)

_registry: dict[int, Memory] = {}  # id(the simulator's segments) -> their Memory, until every rank has attached
_registry_lock = threading.Lock()


def shm_allreduce(fn, comm, grade) -> None:
    """``fn(comm, buf)`` leaves the sum over all ranks in every rank's ``buf`` and sends no message. On simulated
    ranks the function gets a :class:`WeakMemory` (see the module docstring): a rank that loads what another stored
    before a fence made it visible is named, with the chunk and the fence; under mpiexec a :class:`FenceCount`,
    which only counts fences (so an exception names the fence it came after)."""
    p, r = comm.Get_size(), comm.Get_rank()
    theirs = WeakMemory(comm) if hasattr(innermost(comm), "Allocate_shared") else FenceCount(comm)
    grade.logs.append(theirs)  # (reset at each case; its phase(), the fences made, names where an exception came)
    every = [(dtype, n) for dtype in DTYPES for n in sizes(p)]
    for number, (dtype, n) in enumerate(every, 1):
        buf = rank_values(r, n, dtype)
        expected = sum(rank_values(q, n, dtype) for q in range(p))
        about = f"{plural(p, 'rank')}, {elements(n, dtype)}; rank r holds 100 r + 1, 100 r + 2, ..."
        with grade.step(number, about, len(every)):
            theirs.begin(n, dtype)
            with np.errstate(invalid="ignore"):  # (the sum of a window's garbage, on simulated ranks: said below)
                returned = fn(theirs, buf)
            found = theirs.finish(buf)  # (every rank: on simulated ranks, the last publication and the findings)
            grade.same(buf, expected, "buf after the call (the sum over all ranks)")
            if found:
                grade.fail(found)
            elif p > 1 and theirs.fences == 0 and isinstance(theirs, WeakMemory):
                grade.fail(f"rank {r} made no fence on a shared window: the sum must go through the window "
                           f"(windows.allocate(comm, buf.nbytes), win.fence(): {FENCES})")  # fmt: skip
            grade.traffic(0, None, ALGORITHM)
            untouched(comm, grade, buf, rank_values(r, n, dtype), expected, returned)
            if theirs.barriers and grade.problems:
                grade.note(f"rank {r} called comm.Barrier() {plural(theirs.barriers, 'time')} outside a fence: a "
                           "barrier orders the ranks, not their memory (on simulated ranks it publishes no store); "
                           "win.fence() is Win.Sync, Barrier, Win.Sync")  # fmt: skip


# --- the phase an exception came in: the fences made so far in the case -----------------------------------------


class Fences:
    """What both communicators below have: the fences this rank made in the case, and the phase they name."""

    fences = barriers = 0

    def reset(self) -> None:
        """A new case (:meth:`Grade.step` calls it)."""
        self.fences = self.barriers = 0

    def phase(self) -> str:
        if not self.fences:
            return "before fence 1"
        return f"after fence {self.fences}"

    def begin(self, n: int, dtype) -> None:
        """The case's buffer: ``n`` elements of ``dtype``."""
        self.n, self.dtype = n, np.dtype(dtype)

    def finish(self, buf) -> str | None:
        """After the call, on every rank: what went wrong in the window, in words (None: nothing seen)."""
        return None


class FenceCount(Fences, CommWrapper):
    """Under mpiexec: the communicator as it is (MPI's windows, MPI's fences), counting its barriers as fences."""

    def __init__(self, comm):
        CommWrapper.__init__(self, comm)
        self.reset()

    def collective(self, call):
        if call.name == "Barrier":
            self.fences += 1
        return forward(self.comm, call)

    def sibling(self, comm):
        return comm


# --- on simulated ranks: every rank its own copy of the window, made consistent by fences only -------------------


class Memory:
    """One window's memory as the ranks see it after the last fence (``published``, the simulator's own segments),
    shared by every rank's :class:`WeakMemory`; and, for every byte of every segment, the number of fences before it
    was first stored (``first_fence``, -1: never) and by which rank (``first_writer``), whole elements at a time."""

    def __init__(self, published: list, dtype):
        self.published = published
        poison = POISON.get(np.dtype(dtype), POISON[np.dtype(np.float64)]).view(np.uint8)
        for segment in published:
            segment[...] = np.resize(poison, segment.size)
        self.p = len(published)
        self.first_fence = [np.full(s.size, -1, dtype=np.int32) for s in published]
        self.first_writer = [np.full(s.size, -1, dtype=np.int32) for s in published]
        self.fences = 0  # fences made on it (every rank's, together)
        self.merges = 0  # publications: at each fence, and at the end of each call
        self.copies: dict[int, dict[int, tuple]] = {}  # publication -> rank -> (its copies, its buf at the end)
        self.findings: dict[int, list] = {}  # rank -> [(priority, text)], until the rank takes them
        self.lock = threading.Lock()
        self.attached = 0

    def deposit(self, number: int, rank: int, copies: list, buf) -> None:
        with self.lock:
            self.copies.setdefault(number, {})[rank] = (copies, buf)

    def publish(self, number: int, fence: bool, n: int, dtype) -> None:
        """Publication ``number`` (made once, by the first rank past the barrier): find what the ranks did wrong,
        then every rank's stores into the window's memory, in rank order."""
        with self.lock:
            if self.merges > number:
                return
            deposited = self.copies.pop(number)
            ranks = sorted(deposited)
            size = np.dtype(dtype).itemsize  # (an element is stored if any of its bytes changed)
            stored = {r: [widen(deposited[r][0][s] != self.published[s], size) for s in range(self.p)] for r in ranks}
            for r in ranks:
                self.nan_stored(r, deposited[r], stored, fence, n, dtype)
            self.races(ranks, stored, n, dtype)
            if not fence:
                self.unfenced(ranks, stored, n, dtype)
            for s in range(self.p):
                for r in sorted(ranks, key=lambda r: r != s):  # (the owner first: it wrote first, if anyone did)
                    fresh = stored[r][s] & (self.first_fence[s] < 0)
                    self.first_fence[s][fresh] = self.fences
                    self.first_writer[s][fresh] = r
                for r in ranks:
                    self.published[s][stored[r][s]] = deposited[r][0][s][stored[r][s]]
            self.merges += 1
            self.fences += fence

    def take(self, rank: int) -> list:
        with self.lock:
            return self.findings.pop(rank, [])

    def find(self, rank: int, priority: int, text: str) -> None:
        self.findings.setdefault(rank, []).append((priority, text))

    # --- what went wrong ----------------------------------------------------------------------------------------
    def nan_stored(self, r, deposit, stored, fence, n, dtype) -> None:
        """Rank r stored NaN into the window (or holds it in buf at the end): say what it loaded too early."""
        copies, buf = deposit
        for s in range(self.p):
            element = first_garbage(copies[s], stored[r][s], dtype)
            if element is not None:
                where, used = f"into {whose(s, r)} segment", "stored what it read"
                break
        else:
            if buf is None or not np.isnan(buf).any():
                return
            element, where, used = int(np.flatnonzero(np.isnan(buf))[0]), "into its buf", "put it into buf"
        said = self.read_too_early(r, element, stored, fence, n, dtype, used)
        self.find(r, 0, said or f"rank {r} stored NaN {where} at {chunk_of(element, n, self.p)}: the window holds "
                  "garbage (NaN, on simulated ranks) wherever nothing has been stored and fenced yet, and rank "
                  f"{r} loaded such a place")  # fmt: skip

    def read_too_early(self, r, element, stored, fence, n, dtype, used) -> str | None:
        """Rank r stored NaN at ``element`` (``used``: where, in words): what was at that place of each segment
        (every other rank's in rank order, then its own) that rank r could not yet see."""
        size = np.dtype(dtype).itemsize
        at = slice(element * size, (element + 1) * size)
        what = chunk_of(element, n, self.p)
        now = self.when(self.fences, fence)
        for q in [*(q for q in range(self.p) if q != r), r]:
            first, w = int(self.first_fence[q][at.start]), int(self.first_writer[q][at.start])
            if first >= 0 and w != r:  # visible since fence first + 1: rank r read it before that
                return (f"rank {r} read {whose(q, r)} {what} before rank {w} had written it and fenced: rank {w} "
                        f"wrote it {self.when(first)}, and rank {r} read it before fence {first + 1} too (it {used} "
                        f"only {now}); {SEEN}")  # fmt: skip
            if first >= 0:
                continue
            writing = [w for w in sorted(stored) if w != r and stored[w][q][at].any()]
            if writing:  # stored in this very stretch, which no fence has closed yet
                w = q if q in writing else writing[0]
                return (f"rank {r} read {whose(q, r)} {what} before rank {w}'s fence: rank {w} wrote it {now}, and "
                        f"rank {r} read it then too, with no fence between; {SEEN}")  # fmt: skip
            if q != r:
                return (f"rank {r} read rank {q}'s {what} before anyone wrote it: nothing had been stored there "
                        f"(every rank copies its whole buf into its segment before fence 1)")  # fmt: skip
            if stored[r][r][at].any():
                return (f"rank {r} read its own {what} from its segment before it copied buf in there (a rank sees "
                        "its own stores at once, but only those made before the load)")  # fmt: skip
        return None

    def races(self, ranks, stored, n, dtype) -> None:
        """Two ranks stored into the same bytes between the same two fences."""
        size = np.dtype(dtype).itemsize
        for s in range(self.p):
            for a, b in itertools.combinations(ranks, 2):
                both = stored[a][s] & stored[b][s]
                if both.any():
                    element = int(np.flatnonzero(both)[0]) // size
                    said = (f"ranks {a} and {b} both stored into {whose(s)} segment at "
                            f"{chunk_of(element, n, self.p)} {self.when(self.fences)}: with no fence between, "
                            "which store is left there is a race")  # fmt: skip
                    for w in (a, b):
                        if w != s:
                            self.find(w, 1, said)

    def unfenced(self, ranks, stored, n, dtype) -> None:
        """At the end of a call: a rank stored into another's segment after its last fence."""
        size = np.dtype(dtype).itemsize
        for r in ranks:
            for s in range(self.p):
                if s != r and stored[r][s].any():
                    element = int(np.flatnonzero(stored[r][s])[0]) // size
                    self.find(r, 2, f"rank {r} stored into rank {s}'s segment at {chunk_of(element, n, self.p)} "
                              f"{self.when(self.fences, False)}, and no fence followed: rank {s} need not see that "
                              "store (fence 2 comes after every rank has stored its sums, before anyone copies its "
                              "segment out)")  # fmt: skip
                    break

    def when(self, fences: int, closed: bool = True) -> str:
        """The stretch after ``fences`` fences, in words; ``closed``: a fence ends it."""
        if not closed:
            return f"after fence {fences}" if fences else "before any fence"
        return f"between fence {fences} and fence {fences + 1}" if fences else "before fence 1"


SEEN = "a rank sees another's stores only after a fence that follows them"


def whose(q: int, r: int | None = None) -> str:
    return "its own" if q == r else f"rank {q}'s"


def widen(mask, size: int):
    """A mask of bytes, made whole elements of ``size`` bytes: every byte of an element that has one in ``mask``."""
    if mask.size % size:
        return mask
    return np.repeat(mask.reshape(-1, size).any(axis=1), size)


def from_garbage(values, dtype):
    """Which of ``values`` (unsigned integers, the bits of ``dtype``'s elements) are the window's garbage or came from
    it: :data:`POISON`, quiet or not, of either sign."""
    dtype = np.dtype(dtype)
    if dtype not in POISON:
        return np.zeros(values.shape, dtype=bool)
    kind = values.dtype.type
    sign, quiet = kind(1 << (8 * dtype.itemsize - 1)), kind(QUIET[dtype])
    return ((values | quiet) & ~sign) == ((POISON[dtype][0] | quiet) & ~sign)


def first_garbage(copy, mask, dtype) -> int | None:
    """The first element (of ``dtype``) of ``copy`` that was stored (a byte of it is in ``mask``) and came from the
    window's garbage (:func:`from_garbage`)."""
    dtype = np.dtype(dtype)
    size = dtype.itemsize
    count = copy.size // size
    if dtype not in POISON or not count:
        return None
    values = copy[: count * size].view(POISON[dtype].dtype)
    hits = np.flatnonzero(mask[: count * size].reshape(count, size).any(axis=1) & from_garbage(values, dtype))
    return int(hits[0]) if hits.size else None


def chunk_of(element: int, n: int, p: int) -> str:
    """``"chunk 1 (buf[3:6])"``: the chunk of an n-element buffer that holds ``element``."""
    if element >= n:
        return f"element {element} (past the buffer's {n})"
    offsets = chunk_offsets(n, p)
    c = next(c for c in range(p) if offsets[c] <= element < offsets[c + 1])
    return f"chunk {c} (buf[{offsets[c]}:{offsets[c + 1]}])"


class WeakMemory(Fences):
    """On simulated ranks: the communicator handed to the learner's function. Not a wrapper (``innermost`` stops
    here, so ``windows.allocate`` calls this ``Allocate_shared``); everything else goes to the communicator below."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.windows: list[tuple[Memory, list]] = []  # every window allocated through it, and this rank's copies
        self.publications: dict[int, int] = {}  # id(memory) -> the publications this rank has taken part in
        self.reset()
        self.begin(0, np.float64)

    def __getattr__(self, name):
        if name == "comm":
            raise AttributeError(name)
        return getattr(self.comm, name)

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Allocate_shared(self, nbytes: int) -> list:
        published = innermost(self.comm).Allocate_shared(nbytes)  # (a collective: one list, the same on every rank)
        with _registry_lock:
            memory = _registry.get(id(published))
            if memory is None:
                memory = _registry[id(published)] = Memory(published, self.dtype)
            memory.attached += 1
            if memory.attached == memory.p:
                del _registry[id(published)]
            copies = [segment.copy() for segment in published]
        self.windows.append((memory, copies))
        self.publications[id(memory)] = 0
        return copies

    def Barrier(self) -> None:
        if sys._getframe(1).f_code not in _FENCES:  # comm.Barrier() of the learner's own
            self.barriers += 1
            self.comm.Barrier()
            return
        self.fences += 1
        self.publish(self.comm.Barrier, fence=True)

    def publish(self, meet, fence: bool, buf=None) -> None:
        """Every rank: deposit its copies, meet the others, publish (once), take the window's memory back."""
        newest = self.windows[-1][0] if self.windows else None  # (buf goes to it alone: the one this call used)
        for memory, copies in self.windows:
            memory.deposit(self.publications[id(memory)], self.rank, copies, buf if memory is newest else None)
        meet()
        for memory, copies in self.windows:
            memory.publish(self.publications[id(memory)], fence, self.n, self.dtype)
            self.publications[id(memory)] += 1
            for mine, theirs in zip(copies, memory.published):
                mine[...] = theirs

    def finish(self, buf) -> str | None:
        self.publish(lambda: self.comm.allgather(None), fence=False, buf=buf)  # (not a Barrier: no fence matches it)
        found = [f for memory, _ in self.windows for f in memory.take(self.rank)]
        if not found:
            return None
        priority, said = min(found, key=lambda f: f[0])
        if priority == 0 and self.fences < 2:
            said += (f" (rank {self.rank} made {plural(self.fences, 'fence')} in this call; the algorithm makes 2: "
                     f"{FENCES})")  # fmt: skip
        return said
