"""The one dependency that depends on where dtrain is installed; everything else is in pyproject.toml.

With pip (a virtualenv), dtrain needs the ``mpich`` wheel: it brings ``libmpi`` and ``mpiexec`` into the environment,
so no system MPI is needed. In a conda environment that already has an MPI from conda-forge (environment.yml installs
``mpich``), a second MPI from PyPI would overwrite conda's ``mpiexec`` and could load a library that ``mpi4py`` was not
built against, so the wheel is left out there.
"""

import sys
from pathlib import Path

from setuptools import setup

CONDA_MPI_PACKAGES = ("mpich", "openmpi", "impi_rt", "msmpi")


def conda_provides_mpi() -> bool:
    meta = Path(sys.prefix) / "conda-meta"
    return any(any(meta.glob(f"{name}-[0-9]*.json")) for name in CONDA_MPI_PACKAGES)


dependencies = ["numpy>=1.24", "mpi4py>=4", "tqdm>=4.60"]
if sys.platform != "win32" and not conda_provides_mpi():
    dependencies.append("mpich")

setup(install_requires=dependencies)
