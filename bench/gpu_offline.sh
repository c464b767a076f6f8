#!/usr/bin/env bash
# The GPU suite on a lent machine that reaches no package registry (the device tool's H200): the workbench runs from its
# source tree, and the packages that machine's image lacks travel beside it as wheels.
#
#   bash bench/gpu_offline.sh fetch        # here, with a registry: the wheels into .gpuwheels/ (git-ignored: add it to
#                                          # .git/info/exclude, and name it in the device call's carry)
#   bash bench/gpu_offline.sh run OUT [ARGS]  # there: install the carried wheels (no index, no dependencies), check the
#                                          # imports, run bench/gpu_suite.py into OUT (ARGS go to it: --parts 2 3)
#
# The image's own torch (CUDA) stays: only pure-Python packages and tokenizers' abi3 wheel travel, at the versions the
# workbench pins. Measured 2026-12-04 on an H200 image with torch 2.11.0+cu130 and Python 3.12: 28 MB of wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpuwheels
PACKAGES=(transformers==5.24.0 trl==1.16.0 datasets==5.2.0 plotly==7.1.0 accelerate==1.16.0 dill==0.4.1
          multiprocess==0.70.19 fastcore==1.14.5 tokenizers==0.23.3)
case "${1:-}" in
  fetch)
    mkdir -p "$WHEELS"
    python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --implementation cp -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS" ;;
  run)
    out="${2:?usage: bash bench/gpu_offline.sh run OUT [gpu_suite.py arguments]}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl 2>&1 | grep -v "Running pip as" || true
    python3 -c "import torch, transformers, trl, datasets, workbench.train, workbench.sp.ring; "\
"print('torch', torch.__version__, 'transformers', transformers.__version__)"
    timeout -k 5 450 python3 bench/gpu_suite.py --out "$out" "${@:3}" ;;
  *) echo "usage: bash bench/gpu_offline.sh fetch | run OUT [gpu_suite.py arguments]" >&2; exit 2 ;;
esac
