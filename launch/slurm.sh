#!/usr/bin/env bash
# SLURM: one jtrain process per task (one task per node, or per GPU), started by srun.
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sh \
#       --config=configs/base.py --workdir=/shared/runs/base
#
# - The environment is activated explicitly: JTRAIN_VENV (default: .venv in the directory
#   sbatch was run from), and its python runs jtrain; no bare `python` from PATH.
# - Coordinator: the allocation's first node, on a port that is free on it when the job
#   starts (the batch script runs there) — two jobs sharing a node get different ports;
#   JTRAIN_PORT sets one by hand. Process count and ids: SLURM_NTASKS, SLURM_PROCID.
# - SLURM sends SIGTERM 120 s before the time limit (--signal=B:TERM@120: above
#   checkpoint.grace_seconds, 30 s by default, plus start-up of the save); this script
#   forwards it to srun, every process saves its step and exits 0, and the job is
#   requeued (--requeue); the requeued job runs this script again and resumes from the
#   workdir. A preemption that requeues the job does the same. Raise the 120 if you
#   raise checkpoint.grace_seconds.
# - The workdir must be on a filesystem all nodes see (every process writes and reads
#   checkpoints there).
#
# Tested from this repo under a fake srun/scontrol (tests/multihost/test_launchers.py):
# the SLURM environment, the signal path, the requeue and the resume.
#SBATCH --job-name=jtrain
#SBATCH --output=jtrain-%j.out
#SBATCH --open-mode=append
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: sbatch [options] launch/slurm.sh --config=... --workdir=DIR" >&2; exit 2; }
for a in "$@"; do  # a password in a URI would be on every task's command line
  if [[ $a =~ ://[^/@[:space:]]*:[^/@[:space:]]*@ ]]; then
    echo "launch/slurm.sh: an argument holds a URI with a password; it would be on every task's command line: give the URI without it (a database password: JTRAIN_TUNE_DB_PASSWORD, which srun passes on)" >&2
    exit 2
  fi
done
: "${SLURM_JOB_ID:?launch/slurm.sh: not inside a SLURM job (submit it with sbatch)}"
venv=${JTRAIN_VENV:-${SLURM_SUBMIT_DIR:-$PWD}/.venv}
[ -x "$venv/bin/python" ] || {
  echo "launch/slurm.sh: no python in JTRAIN_VENV=$venv; create the venv (README) or set JTRAIN_VENV" >&2
  exit 2
}
# shellcheck disable=SC1091
. "$venv/bin/activate"
py="$venv/bin/python"
head=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)
port=${JTRAIN_PORT:-$("$py" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
export JTRAIN_COORDINATOR="$head:$port" JTRAIN_NUM_PROCESSES="${SLURM_NTASKS:?}"
# The roll call's shared secret for this job step (srun passes the environment on).
export JTRAIN_ROLLCALL_TOKEN="${JTRAIN_ROLLCALL_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
echo "launch/slurm.sh: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NTASKS processes, coordinator $JTRAIN_COORDINATOR"

# Not exec: this shell stays to forward SLURM's SIGTERM and requeue afterwards.
srun --kill-on-bad-exit=1 bash -c 'export JTRAIN_PROCESS_ID=$SLURM_PROCID; exec "$0" -m jtrain.main "$@"' \
  "$py" "$@" &
srun_pid=$!
signalled=""
on_term() { signalled=TERM; kill -TERM "$srun_pid" 2>/dev/null; }
trap on_term TERM
trap 'signalled=INT; kill -INT "$srun_pid" 2>/dev/null' INT
while :; do
  before=$signalled
  wait "$srun_pid"
  rc=$?
  # A trapped signal interrupts wait (status > 128) while srun runs on: wait again.
  [ $rc -gt 128 ] && [ "$signalled" != "$before" ] && continue
  break
done
if [ "$signalled" = TERM ] && [ $rc -eq 0 ]; then
  echo "launch/slurm.sh: stopped by SIGTERM with its step saved; requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID" || true
fi
exit "$rc"
