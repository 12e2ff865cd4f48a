#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 CUDA_VISIBLE_DEVICES=""
exec .venv/bin/python -m pytest "$@"
