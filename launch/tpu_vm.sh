#!/usr/bin/env bash
# Cloud TPU VM (multi-host): run the same command on every worker; JAX discovers the
# slice itself (--distributed=auto).
#
#   launch/tpu_vm.sh my-tpu us-central2-b --config=configs/base.py --workdir=gs://b/runs/x
#
# Assumes the repo is checked out and installed (pip install -e '.') at ~/jtrain on every
# worker. Not tested from this repo (no TPU here).
set -euo pipefail
tpu=${1:?usage: launch/tpu_vm.sh TPU_NAME ZONE --config=... --workdir=DIR}
zone=${2:?usage: launch/tpu_vm.sh TPU_NAME ZONE --config=... --workdir=DIR}
shift 2
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all \
  --command="cd ~/jtrain && python -m jtrain.main --distributed=auto$args"
