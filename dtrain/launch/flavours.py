"""Which MPI an ``mpiexec`` belongs to, and how to tell that one what a dtrain job needs.

The MPI standard fixes the library's calls, not the launcher's flags, so the same wish is spelled differently:

=============================== ================================== ===========================================
what the job needs              MPICH (hydra; Intel MPI alike)     Open MPI (prte, 5.x; 4.x in brackets)
=============================== ================================== ===========================================
these machines, N slots each    ``-hosts a:N,b:N``                 ``--host a:N,b:N``
more ranks than cores/slots     nothing: hydra places them         ``--map-by :OVERSUBSCRIBE`` (``--oversubscribe``)
a waiting rank gives up its     ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` ``OMPI_MCA_mpi_yield_when_idle=1`` (the
core (ranks outnumber cores)                                       environment form of ``--mca mpi_yield_when_idle 1``)
run as root (containers)        nothing                            ``--allow-run-as-root``
dtrain's settings in the ranks  nothing: hydra passes every        ``-x NAME`` for each (only ``OMPI_MCA_*``
of other machines               variable on                        variables pass by themselves)
=============================== ================================== ===========================================

Both start remote ranks over passwordless ssh (hydra's and prte's default bootstrap) and, inside a Slurm allocation,
through Slurm itself. An ``mpiexec`` that is neither gets the flags every MPI takes (``-n``, ``-host``), after one line
that says what was found.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dtrain.launch.hosts import Host, host_list


@dataclass(frozen=True)
class Flavour:
    """An ``mpiexec``'s MPI: its name, its version as it printed it, and how to spell a job's needs for it."""

    name: str  # "MPICH", "Open MPI", or what an unknown one printed first
    version: str = ""

    def hosts_args(self, hosts: list[Host]) -> list[str]:
        return ["-host", host_list(hosts)]

    def forward_args(self, names) -> list[str]:
        """Flags that pass these environment variables to ranks on other machines (none: passed on by default)."""
        return []

    def oversubscribe_args(self) -> list[str]:
        return []

    def root_args(self) -> list[str]:
        return []

    def yield_env(self) -> dict[str, str]:
        return {}

    def __str__(self) -> str:
        return f"{self.name} {self.version}".strip()


class Mpich(Flavour):
    def hosts_args(self, hosts):
        return ["-hosts", host_list(hosts)]

    def yield_env(self):
        return {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


class OpenMpi(Flavour):
    def hosts_args(self, hosts):
        return ["--host", host_list(hosts)]

    def forward_args(self, names):
        return [word for name in names for word in ("-x", name)]

    def oversubscribe_args(self):
        return ["--oversubscribe"] if _major(self.version) < 5 else ["--map-by", ":OVERSUBSCRIBE"]

    def root_args(self):
        return ["--allow-run-as-root"]

    def yield_env(self):
        return {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _major(version: str) -> int:
    match = re.match(r"(\d+)", version)
    return int(match[1]) if match else 0


def read_version(text: str) -> Flavour:
    """The flavour an ``mpiexec --version`` printed ``text`` for."""
    if match := re.search(r"\(Open(?: MPI|RTE)\)\s*(\S+)", text):  # "mpiexec (Open MPI) 5.0.6"; 4.x: "(OpenRTE) 4.1.6"
        return OpenMpi("Open MPI", match[1])
    if "HYDRA" in text:  # MPICH: "HYDRA build details:\n    Version:  4.2.0"
        match = re.search(r"Version:\s*(\S+)", text)
        return Mpich("MPICH", match[1] if match else "")
    if match := re.search(r"Intel\(R\) MPI Library.*?Version\s+(\S+)", text):  # hydra underneath: MPICH's flags
        return Mpich("Intel MPI", match[1])
    first = next((line.strip() for line in text.splitlines() if line.strip()), "printed nothing")
    return Flavour(first[:60])


@functools.cache
def detect(mpiexec: Path) -> Flavour:
    """Ask ``mpiexec --version`` which MPI it belongs to (once per path); an unknown one is said on stderr once."""
    try:
        done = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True, timeout=30)
        text = done.stdout + done.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        text = f"could not run it: {exc}"
    flavour = read_version(text)
    if type(flavour) is Flavour:
        sys.stderr.write(
            f"dtrain launch: {mpiexec} is neither MPICH nor Open MPI (its --version: {flavour.name!r}); going on with "
            "the flags every MPI takes (-n, -host)\n"
        )
    return flavour


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0
