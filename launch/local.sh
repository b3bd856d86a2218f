#!/usr/bin/env bash
# Local multi-process launch: N processes on this machine over loopback, each with
# DEVICES fake CPU devices (or its share of the GPUs), one jax.distributed job.
#
#   launch/local.sh 2 --config=configs/base.py:debug --workdir=runs/mp
#   NPROC=4 DEVICES=2 launch/local.sh 4 --config=... --workdir=...
#   JTRAIN_MODULE=jtrain.tune launch/local.sh 2 --config=... --workdir=...  # a search
#
# Process 0 prints; all processes write their stdout/stderr to WORKDIR/logs/proc_<i>.log.
# If any process fails, the others are stopped and the script exits with its code.
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES --config=... --workdir=DIR [flags]}
shift
port=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
devices=${DEVICES:-1}
workdir=$(printf '%s\n' "$@" | sed -n 's/^--workdir=//p' | tail -1)
[ -n "$workdir" ] || { echo "launch/local.sh: --workdir=DIR is required" >&2; exit 2; }
mkdir -p "$workdir/logs"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for ((i = 0; i < n; i++)); do
  log="$workdir/logs/proc_$i.log"
  JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
  JTRAIN_COORDINATOR="127.0.0.1:$port" JTRAIN_NUM_PROCESSES="$n" JTRAIN_PROCESS_ID="$i" \
    python -m "${JTRAIN_MODULE:-jtrain.main}" "$@" >"$log" 2>&1 &
  pids+=($!)
done
[ -t 1 ] && tail -n +1 -f "$workdir/logs/proc_0.log" --pid="${pids[0]}" &
status=0
for p in "${pids[@]}"; do
  if ! wait "$p"; then status=$?; cleanup; fi
done
[ -t 1 ] || cat "$workdir/logs/proc_0.log"
exit "$status"
