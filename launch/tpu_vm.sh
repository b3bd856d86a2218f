#!/usr/bin/env bash
# Cloud TPU VM (multi-host): the same command on every worker of the slice; JAX finds
# the slice's coordinator, process count and ids itself (--distributed=auto).
#
#   launch/tpu_vm.sh my-tpu us-central2-b --config=configs/base.py --workdir=/mnt/runs/x
#
# Assumes the repo is checked out with its venv (README install) at JTRAIN_REMOTE_DIR
# (default ~/jtrain) on every worker; the venv is activated explicitly and jtrain is
# exec'ed, so a SIGTERM to the worker's command reaches jtrain itself (it saves its step
# and exits 0). The workdir must be one directory all workers see: a mounted filesystem
# (gcsfuse for a bucket, Filestore/NFS) or a local path on a single-host slice; jtrain
# refuses a gs://... URI in one line (it writes logs and metrics with local file I/O).
# JTRAIN_DISTRIBUTED replaces --distributed=auto (e.g. empty on a single-host VM).
# Tested from this repo under a fake gcloud (tests/multihost/test_launchers.py).
set -euo pipefail
usage="usage: launch/tpu_vm.sh TPU_NAME ZONE --config=... --workdir=DIR [flags]"
tpu=${1:?$usage}
zone=${2:?$usage}
shift 2
for a in "$@"; do
  case $a in --workdir=*://*)
    echo "launch/tpu_vm.sh: ${a#--workdir=} is a remote URI; jtrain writes the workdir with local file I/O: mount it (gcsfuse) and pass the mounted path" >&2
    exit 2 ;;
  esac
  # A password in a URI would be on every worker's command line (ps shows it to all).
  if [[ $a =~ ://[^/@[:space:]]*:[^/@[:space:]]*@ ]]; then
    echo "launch/tpu_vm.sh: an argument holds a URI with a password; it would be on every worker's command line: give the URI without it (a database password: JTRAIN_TUNE_DB_PASSWORD in the workers' environment)" >&2
    exit 2
  fi
done
dir=${JTRAIN_REMOTE_DIR:-'~/jtrain'}  # expanded on the worker
dist=${JTRAIN_DISTRIBUTED---distributed=auto}
args=$(printf ' %q' "$@")
exec gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all \
  --command="cd $dir && . .venv/bin/activate && exec .venv/bin/python -m jtrain.main $dist$args"
