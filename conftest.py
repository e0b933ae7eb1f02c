"""pytest's settings for the whole repository (tests/ and notebooks/), read before anything is collected.

The notebooks' live parts (dtrain/course/live.py) start real MPI ranks. Under the test suite nbmake runs the notebooks'
simulator parts only: ``DTRAIN_LIVE=0``, which nbmake's kernels inherit with the rest of this process's environment,
makes each live part print that it is skipped. tests/test_live.py runs the live parts, once, in kernels of its own.
``DTRAIN_LIVE=1 pytest notebooks`` runs them under nbmake as well. (Here, not in tests/conftest.py, so that it also
holds for ``pytest notebooks/02_allreduce.ipynb`` alone.)
"""

import os

os.environ.setdefault("DTRAIN_LIVE", "0")
