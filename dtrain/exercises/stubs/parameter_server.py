"""Exercises of lesson 4 (parameter servers): a server's stale-synchronous gate.

Check it:   dtrain exercises check 4.2 --path .
"""


def stale_synchronous_ready(waiting, clock, running, bound):
    """The workers a stale-synchronous parameter server may answer now.

    Signature: ``stale_synchronous_ready(waiting, clock, running, bound) -> list[int]``. A worker is a number
    0 .. W-1.

    * ``waiting``: the workers whose push the server has applied but whose reply (the new weights) it holds back;
    * ``clock``: ``clock[w]`` is the number of steps (pushes) worker w has made so far, for every worker;
    * ``running``: the workers still taking steps (not finished): only they can hold the others back;
    * ``bound``: the staleness bound K (``--staleness K``), an int >= 0, or None.

    Return the workers of ``waiting``, in ``waiting``'s order, that are at most ``bound`` steps ahead of the slowest
    running worker (the smallest ``clock`` among ``running``). ``bound`` 0 is lockstep: nobody gets ahead of the
    slowest. ``bound`` None is asynchronous: everyone waiting is answered. With no worker running, count the slowest
    as at step 0. Leave the three lists as they are.

    Example: ``clock = [5, 4, 3]``, all running, bound 1: worker 1 (one step ahead of worker 2) may go on, worker 0
    (two steps ahead) waits: ``stale_synchronous_ready([0, 1], [5, 4, 3], [0, 1, 2], 1) == [1]``.

    Hint: ``min(..., default=0)``; the server calls this after every push and every finished worker
    (dtrain/parallel/ps_server.py, ``ServerLoop.release``).
    """
    raise NotImplementedError("exercise 4.2: the stale-synchronous gate — see lessons/04_parameter_server.py")
