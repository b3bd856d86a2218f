#!/usr/bin/env bash
# SLURM: one jtrain process per node (or per GPU), started by srun. JAX reads the job's
# layout from SLURM's environment (jax.distributed.initialize() auto-detection), so
# every process gets --distributed=auto and the same arguments.
#
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 launch/slurm.sh \
#       --config=configs/base.py --workdir=/shared/runs/base
#
# The workdir must be on a filesystem all nodes see (checkpoints are written by all
# processes and read back by all of them). Not tested on a real cluster from this repo:
# what is tested is the same code path over loopback (launch/local.sh, tests).
#SBATCH --job-name=jtrain
#SBATCH --output=jtrain-%j.out
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: sbatch [options] launch/slurm.sh --config=... --workdir=DIR" >&2; exit 2; }
# SIGTERM before the time limit (--signal) gives jtrain its grace period to checkpoint.
exec srun --kill-on-bad-exit=1 python -m jtrain.main --distributed=auto "$@"
