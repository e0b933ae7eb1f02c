#!/bin/bash
# A real Slurm cluster of one node, this machine, for as long as this script runs: it proves train.sbatch (and, with
# --tour, tour.sbatch) the way a cluster would run them, then takes the cluster down again.
#
#   sudo bash scripts/slurm/try_local_slurm.sh                  train.sbatch on 4 tasks, checked against single
#   sudo bash scripts/slurm/try_local_slurm.sh --tour           and the tour
#   sudo bash scripts/slurm/try_local_slurm.sh -- pytest tests/test_slurm.py -m slurm
#                                                               and then COMMAND, while the cluster is up
#
# What it does, in order (Debian or Ubuntu, as root, no systemd needed):
#   1. installs Debian's slurm-wlm and munge with apt-get, if slurmctld, slurmd, sbatch or munged is missing;
#   2. writes a munge key and a minimal slurm.conf into a temporary folder: one node (this machine) that takes 2 tasks
#      per core, ports that are free, every file and socket in that folder, listening on 127.0.0.1 only;
#   3. starts munged (who signs each request), slurmctld (the scheduler) and slurmd (the node's agent) in the
#      background, and waits until the node is idle;
#   4. submits scripts/slurm/train.sbatch --paradigm ddp --dtype float64 with 4 tasks, waits for it, and holds each
#      epoch's train loss in its metrics.json against `dtrain train --paradigm single --dtype float64` on one
#      process: equal to 1e-10 relative, the bound tests/train_util.py's follows_single holds every paradigm to under
#      mpiexec. The only difference is the order in which the 4 ranks' gradients are summed, so in float64 the
#      curves agree to ~1e-15 (measured); in float32 that round-off grows to a few 1e-6 over 20 epochs (measured:
#      2.7e-6), too close to any bound one would write, while a real bug (a missing 1/p) moves the loss by ~1e-2;
#   5. with --tour, submits scripts/slurm/tour.sbatch and checks that every paradigm ran;
#   6. runs COMMAND (after --) with SLURM_CONF set, so sbatch, squeue and pytest find this cluster;
#   7. prints PASS or FAIL for each, and ALWAYS (trap) cancels its jobs, stops the three daemons and anything they
#      left running, and removes the temporary folder. The jobs' outputs stay in runs/ (runs/slurm-JOBID.out and
#      runs/slurm-JOBID/).
#
# Exit status: 0 when everything passed, 1 when something failed, 2 for bad usage.
set -euo pipefail

usage="usage: bash scripts/slurm/try_local_slurm.sh [--tour] [-- COMMAND ...]"
tour=0
command=()
while [ $# -gt 0 ]; do
    case $1 in
        --tour) tour=1 ;;
        --) shift; command=("$@"); break ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "try_local_slurm.sh: unknown argument $1 ($usage)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$(id -u)" != 0 ]; then
    echo "try_local_slurm.sh: the daemons (slurmd starts jobs as any user) need root: sudo bash $0 $*" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${DTRAIN_VENV:-$repo/.venv}
if [ ! -x "$venv/bin/python" ]; then
    echo "try_local_slurm.sh: no virtualenv at $venv: make it (python3 -m venv .venv && .venv/bin/pip install -e .)" \
         "or set DTRAIN_VENV" >&2
    exit 2
fi
job_timeout=${TRY_SLURM_TIMEOUT:-600}  # seconds a job may take before it is cancelled and counted as failed
started=$(date +%s)
say() { echo "[$(($(date +%s) - started))s] $*"; }
since() {  # seconds since $1 (a date +%s%N), to a tenth
    local ms=$((($(date +%s%N) - $1) / 1000000))
    printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100))
}

# --- 1. Slurm and munge -----------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
   ! command -v munged >/dev/null; then
    say "installing Debian's slurm-wlm and munge (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
slurm_version=$(slurmctld -V)  # (sbatch --version wants a slurm.conf first)

# --- 2. The cluster's folder and configuration ---------------------------------------------------------------------
tmp=$(mktemp -d /tmp/dtrain-slurm.XXXXXX)
chmod 755 "$tmp"  # munged refuses a socket in a folder that not everyone may enter
mkdir -p "$tmp/state" "$tmp/spool"
export SLURM_CONF=$tmp/slurm.conf  # every Slurm command (sbatch, squeue, srun inside the jobs) reads this one
pids=()                            # the daemons this script started

# The trap: whatever happens from here on (a failure, Ctrl-C, the end), leave nothing behind.
# shellcheck disable=SC2317  # (called by the trap)
cleanup() {
    local status=$? pid alive jobs
    trap - EXIT INT TERM
    set +e
    mapfile -t jobs < <(timeout 10 squeue -h -o %i 2>/dev/null)
    if [ ${#jobs[@]} -gt 0 ]; then  # the jobs first, while slurmd can still stop their ranks
        timeout 10 scancel --full --quiet "${jobs[@]}"
        for _ in $(seq 20); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for _ in $(seq 50); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.2
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    # A slurmstepd (one per job step) outlives slurmd; ours are those that hold a file in our folder (slurmd.log).
    for pid in $(holding "$tmp"); do kill -KILL "$pid" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$tmp"
    say "stopped munged, slurmctld and slurmd; removed $tmp"
    exit "$status"
}
# shellcheck disable=SC2317
holding() {  # the processes with a file open under folder $1 or their working directory there, by PID
    local fd pid
    for fd in /proc/[0-9]*/fd/* /proc/[0-9]*/cwd; do
        [[ $(readlink "$fd" 2>/dev/null) == "$1"/* ]] || continue
        pid=${fd#/proc/}; pid=${pid%%/*}
        [ "$pid" != $$ ] && echo "$pid"
    done | sort -u
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {  # a TCP port no one listens on now (the system picks it)
    "$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
node=$(hostname -s)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# Two tasks per core: the node is declared with 2 hardware threads per core, and slurmd told to believe the
# configuration over the hardware (config_overrides). Slurm gives a task a CPU: without this, --ntasks=4 on 2 CPUs
# waits forever (Reason=PartitionConfig). OverSubscribe=FORCE or select/linear do not help: they let *jobs* share
# CPUs, not one job's tasks.
slots=$((2 * cores))
cat >"$SLURM_CONF" <<EOF
# A one-node cluster for try_local_slurm.sh; everything it writes is in $tmp.
ClusterName=dtrain-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge.socket
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
# no cgroups, no accounting database: plain processes, as few moving parts as can run a job
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# Job ids of their own for every try (from the clock), never 1, 2, ... again: MPICH names its shared-memory segment
# (/dev/shm/mpich_shm_*) after Slurm's JOBID.STEP, a rank killed mid-run leaves it behind, and a later job with the
# same id on this node then hangs in MPI_Init on the stale segment (seen here; docs/slurm.md). It also keeps an earlier
# try's runs/slurm-JOBID/ from being written over.
FirstJobId=$(($(date +%s) % 60000000 + 1000000))
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$slots Boards=1 SocketsPerBoard=1 CoresPerSocket=$cores ThreadsPerCore=2 \
    State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF

# --- 3. The daemons, in the foreground of a background job each, so their PIDs are ours to stop --------------------
"$venv/bin/python" -c 'import os, sys; sys.stdout.buffer.write(os.urandom(1024))' >"$tmp/munge.key"
chmod 600 "$tmp/munge.key"
munged -F --key-file="$tmp/munge.key" --socket="$tmp/munge.socket" --pid-file="$tmp/munged.pid" \
    --log-file="$tmp/munged.log" --seed-file="$tmp/munged.seed" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$tmp/munge.socket" ] && break; sleep 0.1; done
slurmctld -D -c -f "$SLURM_CONF" >/dev/null 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 60); do
    [ "$(timeout 5 sinfo -h -N -o %T 2>/dev/null)" = idle ] && break
    sleep 0.5
done
if [ "$(timeout 5 sinfo -h -N -o %T 2>/dev/null)" != idle ]; then
    say "FAIL: the node did not become idle within 30 s; the daemons' last words:"
    tail -n 5 "$tmp"/slurmctld.log "$tmp"/slurmd.log "$tmp"/munged.log 2>/dev/null
    exit 1
fi
say "cluster up: $slurm_version, node $node ($cores cores, $slots CPUs declared), config $SLURM_CONF"
say "MPI: $("$venv/bin/mpichversion" 2>/dev/null | head -1 | tr -s ' ')"

# --- Submitting and waiting ------------------------------------------------------------------------------------------
# submit SCRIPT ARGS...: sbatch from the repository's root (where a learner types it); prints the job id
submit() {
    mkdir -p "$repo/runs"  # Slurm opens --output=runs/slurm-%j.out before the script starts
    (cd "$repo" && DTRAIN_VENV=$venv sbatch --parsable --ntasks=4 "$@")
}
# wait_for JOB: until it leaves the queue (cancelled after job_timeout seconds); sets state to how it ended. (Not in a
# $(...) subshell: a signal sent to this script must find it here, between two short commands, and stop the wait.)
wait_for() {
    local deadline=$(($(date +%s) + job_timeout))
    while [ -n "$(timeout 10 squeue -h -j "$1" -o %i 2>/dev/null)" ]; do
        if [ "$(date +%s)" -gt "$deadline" ]; then
            scancel "$1"
            state=TIMEOUT
            return
        fi
        sleep 0.5
    done
    state=$(timeout 10 scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
}
results=()
failed=0
record() {  # record PASS|FAIL TEXT...
    results+=("$1  ${*:2}")
    [ "$1" = PASS ] || failed=1
}

# --- 4. train.sbatch on 4 tasks against single on one process --------------------------------------------------------
t0=$(date +%s%N)
if job=$(submit scripts/slurm/train.sbatch --paradigm ddp --dtype float64); then
    say "submitted train.sbatch --paradigm ddp --dtype float64 as job $job (4 tasks on $cores cores)"
    wait_for "$job"
else
    job="(none)" state="NOT SUBMITTED"
fi
train_s=$(since "$t0")
say "job $job: $state after $train_s s; its output: runs/slurm-$job.out"
metrics=$repo/runs/slurm-$job/metrics.json
t0=$(date +%s%N)
"$venv/bin/python" -m dtrain train --paradigm single --dtype float64 --out "$tmp/single" --quiet >/dev/null ||
    say "dtrain train --paradigm single failed: nothing to compare with"
single_s=$(since "$t0")
if [ "$state" = COMPLETED ] && [ -f "$metrics" ] && [ -f "$tmp/single/metrics.json" ]; then
    # The oracle: each epoch's global-batch train loss equals single's to 1e-10 relative (step 4 above says why).
    verdict=$("$venv/bin/python" - "$metrics" "$tmp/single/metrics.json" <<'EOF'
import json, sys
run, single = (json.load(open(path)) for path in sys.argv[1:])
ours, theirs = ([e["train_loss"] for e in m["epochs"]] for m in (run, single))
worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) if len(ours) == len(theirs) else float("inf")
world = run["world_size"]
ok = len(ours) == len(theirs) and worst <= 1e-10 and world == 4
print(("PASS" if ok else "FAIL") + f" {len(ours)} epochs on {world} ranks, each epoch's train_loss = single's to "
      f"{worst:.1e} relative (bound 1e-10), test accuracy {run['final']['test_accuracy']:.2%}")
EOF
) || verdict="FAIL could not compare the two metrics.json"
    record "${verdict%% *}" "train.sbatch --paradigm ddp --dtype float64, job $job, 4 Slurm tasks:" \
           "${verdict#* } (the job $train_s s from sbatch to its end; single $single_s s)"
else
    record FAIL "train.sbatch --paradigm ddp --dtype float64, job $job ended $state, or a metrics.json is missing"
    tail -n 15 "$repo/runs/slurm-$job.out" 2>/dev/null | sed 's/^/    | /'
fi

# --- 5. tour.sbatch ---------------------------------------------------------------------------------------------------
if [ "$tour" = 1 ]; then
    t0=$(date +%s%N)
    if job=$(submit scripts/slurm/tour.sbatch); then
        say "submitted tour.sbatch as job $job"
        wait_for "$job"
    else
        job="(none)" state="NOT SUBMITTED"
    fi
    tour_s=$(since "$t0")
    out=$repo/runs/slurm-$job.out
    ran=$(grep -cE '^\[[0-9]+/[0-9]+\] .* [0-9.]+% \(' "$out" 2>/dev/null || true)
    planned=$(grep -oE '^\[[0-9]+/[0-9]+\]' "$out" 2>/dev/null | tail -1 | sed 's/.*\///; s/\]//')
    if [ "$state" = COMPLETED ] && [ -f "$repo/runs/slurm-$job/tour/tour.json" ]; then
        record PASS "tour.sbatch, job $job: $ran of $planned paradigms ran, each its own mpiexec job inside the" \
                    "allocation ($tour_s s); the table: runs/slurm-$job/tour/tour.txt"
    else
        record FAIL "tour.sbatch, job $job ended $state ($ran of ${planned:-?} paradigms ran); see runs/slurm-$job.out"
        tail -n 15 "$out" 2>/dev/null | sed 's/^/    | /'
    fi
fi

# --- 6. COMMAND, while the cluster is up ------------------------------------------------------------------------------
if [ ${#command[@]} -gt 0 ]; then
    say "running: ${command[*]} (SLURM_CONF=$SLURM_CONF)"
    if (cd "$repo" && DTRAIN_VENV=$venv "${command[@]}"); then
        record PASS "${command[*]}"
    else
        record FAIL "${command[*]} (exit status $?)"
    fi
fi

# --- 7. The summary (the trap then takes the cluster down) ---------------------------------------------------------
echo
for line in "${results[@]}"; do echo "$line"; done
if [ "$failed" = 0 ]; then
    echo "try_local_slurm.sh: PASS ($(($(date +%s) - started)) s in all)"
else
    echo "try_local_slurm.sh: FAIL ($(($(date +%s) - started)) s in all)"
fi
exit "$failed"
