#!/usr/bin/env bash
# Local multi-process launch: N processes on this machine over loopback, each with
# DEVICES fake CPU devices (or its share of the GPUs), one jax.distributed job.
#
#   launch/local.sh 2 --config=configs/base.py:debug --workdir=runs/mp
#   DEVICES=2 PORT=29500 launch/local.sh 4 --config=... --workdir=...
#   JTRAIN_MODULE=jtrain.tune launch/local.sh 2 --config=... --workdir=...  # a search
#
# Process 0 prints; every process writes its stdout/stderr to WORKDIR/logs/proc_<i>.log.
# The launcher's exit status is the first failing process's (a signal death: 128 + the
# signal, as bash reports it), noticed at once whichever process it is (wait -n); the
# others then get SIGTERM and, GRACE seconds later (default 60), SIGKILL — a stopped
# (SIGSTOPped) process gets SIGCONT too, so nothing hangs. A SIGTERM / SIGINT to the
# launcher goes to every process (each saves its step and exits 0; then so does this).
# PYTHON names the interpreter (default: python from PATH).
set -uo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES --config=... --workdir=DIR [flags]}
shift
case $n in '' | *[!0-9]* | 0) echo "launch/local.sh: NUM_PROCESSES must be a positive integer, got '$n'" >&2; exit 2 ;; esac
py=${PYTHON:-python}
grace=${GRACE:-60}
devices=${DEVICES:-1}
workdir=$(printf '%s\n' "$@" | sed -n 's/^--workdir=//p' | tail -1)
[ -n "$workdir" ] || { echo "launch/local.sh: --workdir=DIR is required" >&2; exit 2; }
port=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')} || exit 2
mkdir -p "$workdir/logs" || exit 2

pids=()
forwarded=""
forward() {  # a signal to the launcher: every process gets it once, then we keep waiting
  forwarded=$1
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done
}
stop_all() {  # TERM now, KILL after the grace period; SIGCONT so a stopped one can act
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; kill -CONT "$p" 2>/dev/null; done
  local deadline=$((SECONDS + grace))
  while [ $SECONDS -lt $deadline ]; do
    local alive=0
    for p in "${live[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return
    sleep 0.2
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

# The roll call's shared secret for this launch (jtrain/multihost/rollcall.py).
token=${JTRAIN_ROLLCALL_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
for ((i = 0; i < n; i++)); do
  JTRAIN_ROLLCALL_TOKEN="$token" JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
  JTRAIN_COORDINATOR="127.0.0.1:$port" JTRAIN_NUM_PROCESSES="$n" JTRAIN_PROCESS_ID="$i" \
    "$py" -m "${JTRAIN_MODULE:-jtrain.main}" "$@" >"$workdir/logs/proc_$i.log" 2>&1 &
  pids+=($!)
done
tailer=""
if [ -t 1 ]; then
  tail -n +1 -f "$workdir/logs/proc_0.log" --pid="${pids[0]}" &
  tailer=$!
fi

# wait -n returns when any process ends (or a trapped signal interrupts it: then the
# status is > 128 and no process has ended; wait again). -p names the one that ended.
status=0
live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  ended=""
  wait -n -p ended "${live[@]}" 2>/dev/null
  rc=$?
  if [ -z "${ended:-}" ]; then
    [ $rc -gt 128 ] && continue  # a trapped signal interrupted the wait: wait again
    # None reported (bash had reaped it already): its status, from bash's record.
    ended=${live[0]}
    wait "$ended" 2>/dev/null
    rc=$?
  fi
  rest=(); for p in "${live[@]}"; do [ "$p" = "$ended" ] || rest+=("$p"); done
  live=("${rest[@]}")
  if [ $rc -ne 0 ] && [ $status -eq 0 ]; then
    status=$rc
    i=0; for p in "${pids[@]}"; do [ "$p" = "$ended" ] && break; i=$((i + 1)); done
    echo "launch/local.sh: process $i exited with status $rc; stopping the others" >&2
    stop_all
  fi
done
[ -n "$tailer" ] && wait "$tailer" 2>/dev/null
[ -t 1 ] || cat "$workdir/logs/proc_0.log"
[ $status -ne 0 ] && [ -s "$workdir/logs/proc_$i.log" ] && [ "$i" != 0 ] &&
  { echo "launch/local.sh: the end of process $i's log:" >&2; tail -n 3 "$workdir/logs/proc_$i.log" >&2; }
exit "$status"
