#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the demo on the built-in default data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/triclip demo "$@"
