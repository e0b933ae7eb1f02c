#!/usr/bin/env bash
# Everything dtrain checks and measures on a GPU, in one run, with its logs and results in one folder:
#
#     bash scripts/gpu_check.sh [OUT]          # OUT defaults to gpu-check/ (git-ignored); ~6 min on an H100 machine
#     GPU_CHECK_QUICK=1 bash scripts/gpu_check.sh   # the benchmarks' --quick forms: ~3 min
#     GPU_CHECK_PARTS="tests bench" ...   # some of: env tests bench kernels calibrate lesson lessons plan tour
#
# Run it with the Python environment that has CuPy (and NumPy, and PyTorch for its comparisons): GPU_CHECK_PYTHON
# (default python3). It installs into that environment the wheels found in .whl/ (mpich's mpiexec and mpi4py, for a
# machine with no registry: `pip download` them where one can be reached) and dtrain itself, editable and without
# dependencies; then runs each part on its own, a failure never stopping the next: the GPU tests (pytest -m gpu),
# the reduction kernels (bench_kernels.py --device gpu), the step and the all-reduce (bench_gpu.py), this machine as
# a dtrain plan preset (calibrate.py --gpu), lesson 12 (its part 4 from the benchmark's results), lessons 1-9 with
# --device gpu (small flags, four jobs at a time), dtrain plan
# --device gpu --check (the lent-h100 preset against runs) and the tour on the GPU. The last lines printed are a summary.
set -u
OUT=${1:-${OUT:-gpu-check}}
mkdir -p "$OUT"
PARTS=${GPU_CHECK_PARTS:-env tests bench kernels calibrate lesson lessons plan tour}
QUICK=${GPU_CHECK_QUICK:+--quick}
export PYTHONUNBUFFERED=1  # (dtrain launch sets the yielding wait itself, only when ranks outnumber cores)
PY=${GPU_CHECK_PYTHON:-python3}
summary=()

step() {  # step NAME TIMEOUT COMMAND...: run it, its output in $OUT/NAME.log, one summary line
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-9s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - started))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")")
}

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "pip install -e . failed (see install.log): dtrain runs from the source tree (PYTHONPATH)" | tee -a "$OUT/install.log"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"  # its mpiexec first

for part in $PARTS; do
    case $part in
    env)
        step env 60 bash -c "nvidia-smi; $PY - <<'EOF'
import platform, numpy, cupy, mpi4py
from mpi4py import MPI
from dtrain import backend
from dtrain.comm.cuda_aware import cuda_awareness_reason
print('python', platform.python_version(), 'numpy', numpy.__version__, 'cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)
print(MPI.Get_library_version().splitlines()[0])
print(backend.select_gpu(0), backend.gpu_missing())
print('CUDA-aware MPI:', cuda_awareness_reason())
try:
    import torch; print('torch', torch.__version__, torch.cuda.get_device_name())
except Exception as exc: print('torch:', exc)
EOF"
        ;;
    tests)
        step tests 300 "$PY" -m pytest -m gpu -rs -v -s -p no:cacheprovider -o addopts= --timeout 240 tests/test_gpu.py
        ;;
    kernels)
        step kernels 120 "$PY" scripts/bench_kernels.py --device gpu $QUICK --json "$OUT/kernels_gpu.json"
        ;;
    bench)
        step bench 240 "$PY" scripts/bench_gpu.py $QUICK --json "$OUT/gpu.json"
        ;;
    calibrate)
        step calibrate 180 "$PY" scripts/calibrate.py --gpu "$OUT/preset.json"
        ;;
    lesson)
        results=()
        [ -f docs/bench/gpu.json ] && results=(--results docs/bench/gpu.json)
        [ -f "$OUT/gpu.json" ] && results=(--results "$OUT/gpu.json")
        step lesson 120 "$PY" lessons/12_gpu.py $QUICK "${results[@]}" --json "$OUT/lesson.json"
        ;;
    lessons)  # lessons 1-9 with --device gpu and their tests' small flags, four 4-rank jobs at a time
        lesson_gpu() {  # lesson_gpu NAME RANKS FLAGS...
            local name=$1 ranks=$2
            shift 2
            if [ "$ranks" = 1 ]; then set -- "$PY" "lessons/$name.py" "$@"
            else set -- "$PY" -m dtrain launch -n "$ranks" "lessons/$name.py" "$@"; fi
            timeout 90 "$@" --device gpu >"$OUT/lesson_$name.log" 2>&1
            echo "rc=$? $(tail -n 1 "$OUT/lesson_$name.log" | cut -c1-140)" >"$OUT/lesson_$name.rc"
        }
        started=$SECONDS
        lesson_gpu 01_single_device 1 --epochs 2 &
        lesson_gpu 02_allreduce 4 --size-mib 0.05 --repeats 2 &
        lesson_gpu 03_data_parallel 4 --epochs 2 --steps 8 --big-batch 192 &
        lesson_gpu 04_parameter_server 4 --epochs 2 --quick &
        lesson_gpu 05_local_sgd 4 --epochs 2 --seeds 2 --warmup-sync-steps 10 &
        wait
        lesson_gpu 06_gossip 4 --epochs 2 --rounds 6 &
        lesson_gpu 07_tensor_parallel 4 --epochs 2 --hidden 256,256 --big-batch 64 --steps 2 &
        lesson_gpu 08_pipeline_parallel 4 --epochs 2 --max-microbatches 4 &
        lesson_gpu 09_zero 4 --epochs 2 --hidden 256,256 --big-batch 48 --steps 2 &
        wait
        for f in "$OUT"/lesson_0*.rc; do summary+=("$(basename "$f" .rc): $(cat "$f")"); done
        summary+=("lessons: $((SECONDS - started))s")
        ;;
    plan)
        step plan 200 bash -c "$PY -m dtrain plan --device gpu --ranks 2 --check 3 && $PY -m dtrain plan --device gpu --ranks 4 --check 3"
        ;;
    tour)
        step tour 200 "$PY" -m dtrain tour --device gpu --ranks 4 --epochs 3 --out "$OUT/tour"
        ;;
    esac
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
