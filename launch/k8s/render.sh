#!/usr/bin/env bash
# Render launch/k8s/job.yaml for your cluster and print it:
#
#   launch/k8s/render.sh --processes=4 --image=registry/jtrain:1 -- \
#       --config=configs/base.py --workdir=/runs/base | kubectl apply -f -
#
# Options: --processes=N (required), --image=IMAGE (required; jtrain installed, python on
# PATH), --name=jtrain, --port=1234 (coordinator), --grace=30 (checkpoint.grace_seconds;
# the pod's terminationGracePeriodSeconds is that + 30), --backoff=10 (failed pods before
# the Job gives up), --claim=jtrain-runs (the PersistentVolumeClaim mounted at /runs,
# shared by all pods). Everything after -- goes to python -m jtrain.main.
# Tested from this repo by running the rendered container command locally with the
# Job's environment (tests/multihost/test_launchers.py).
set -euo pipefail
n="" image="" name=jtrain port=1234 grace=30 backoff=10 claim=jtrain-runs margin=30
die() { echo "launch/k8s/render.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --processes=*) n=${1#*=} ;;
    --image=*) image=${1#*=} ;;
    --name=*) name=${1#*=} ;;
    --port=*) port=${1#*=} ;;
    --grace=*) grace=${1#*=} ;;
    --backoff=*) backoff=${1#*=} ;;
    --claim=*) claim=${1#*=} ;;
    --) shift; break ;;
    *) die "unknown option $1 (jtrain's flags go after --)" ;;
  esac
  shift
done
case $n in '' | *[!0-9]* | 0) die "--processes=N (a positive integer) is required" ;; esac
[ -n "$image" ] || die "--image=IMAGE is required"
case $grace in '' | *[!0-9]*) die "--grace must be whole seconds, got '$grace'" ;; esac
[[ $name =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name must be a DNS label, got '$name'"
args=""
for a in "$@"; do  # YAML single-quoted strings: ' doubles
  args+="'${a//\'/\'\'}', "
done
template="$(dirname "$0")/job.yaml"
esc() { printf '%s' "$1" | sed 's/[&|\\]/\\&/g'; }
sed -e "s|@N@|$n|g" -e "s|@IMAGE@|$(esc "$image")|g" -e "s|@NAME@|$name|g" \
    -e "s|@PORT@|$port|g" -e "s|@GRACE@|$grace|g" -e "s|@MARGIN@|$margin|g" \
    -e "s|@TERMINATION@|$((grace + margin))|g" -e "s|@BACKOFF@|$backoff|g" \
    -e "s|@CLAIM@|$(esc "$claim")|g" -e "s|@ARGS@|$(esc "$args")|g" "$template"
