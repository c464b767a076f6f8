#!/usr/bin/env bash
# Train with workbench.train on one or more Slurm nodes: one torchrun agent per node (srun), one process per GPU.
# The same training function as the notebook's run(cfg) and as `python -m workbench.train --nproc N`.
#
#   sbatch bench/slurm_train.sh                                  # 2 nodes x 8 GPUs, SP=8 inside each node, DP=2
#   SP=4 STEPS=200 sbatch --nodes=4 bench/slurm_train.sh --model /ckpt/llama-8b --data /data/train.jsonl
#
# Extra arguments are passed to `python -m workbench.train` (see `python -m workbench.train --help`).
# World = nodes x GPUs per node; SP must divide the model's attention heads and the GPUs per node (an SP group
# then stays inside one node, on NVLink); DP = world / SP. docs/cluster.md explains the layout.
#
#SBATCH --job-name=workbench-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
SP="${SP:-8}"
STEPS="${STEPS:-100}"
MAX_TOKENS="${MAX_TOKENS:-65536}"
OUT="${OUT:-runs/${SLURM_JOB_NAME:-workbench}-${SLURM_JOB_ID:-local}}"
PORT="${PORT:-29500}"
NNODES="${SLURM_NNODES:-1}"

WORLD=$((NNODES * GPUS_PER_NODE))
if (( GPUS_PER_NODE % SP != 0 )); then
  echo "SP=${SP} must divide the ${GPUS_PER_NODE} GPUs per node so that an SP group stays inside one node" >&2
  exit 1
fi
DP=$((WORLD / SP))

# The first node of the allocation hosts the rendezvous.
MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run under sbatch or salloc}" | head -n 1)"
export MASTER_ADDR
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

echo "workbench: ${NNODES} nodes x ${GPUS_PER_NODE} GPUs = ${WORLD} processes, SP=${SP} x DP=${DP}," \
     "rendezvous ${MASTER_ADDR}:${PORT}, run directory ${OUT}"

# One task per node; each starts a torchrun agent that forks GPUS_PER_NODE ranks and joins the c10d rendezvous.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  torchrun \
    --nnodes "${NNODES}" \
    --nproc_per_node "${GPUS_PER_NODE}" \
    --rdzv_id "${SLURM_JOB_ID}" \
    --rdzv_backend c10d \
    --rdzv_endpoint "${MASTER_ADDR}:${PORT}" \
    -m workbench.train \
      --ulysses "${SP}" --dp "${DP}" --steps "${STEPS}" --max-tokens "${MAX_TOKENS}" --out "${OUT}" "$@"
