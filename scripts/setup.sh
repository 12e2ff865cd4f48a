#!/usr/bin/env bash
# Installs everything triclip needs on a fresh Debian machine: system packages
# (built-in datasets, Chromium for browser tests) and a virtual environment in
# .venv with triclip and its test extras, at the exact versions of constraints.txt
# (the last green test run's). Safe to run again: each step is skipped when
# already done; a changed pyproject.toml or constraints.txt reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES="dataset-fashion-mnist openclipart-png openclipart-svg chromium"
missing=""
for p in $APT_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" = none ]; then
    echo "setup: please install the Debian packages:$missing (apt-get install$missing)" >&2
  else
    echo "setup: installing Debian packages:$missing"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.triclip-installed"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  echo "setup: installing Python packages into .venv (first time: a few minutes, ~8 GB; ${free_gb} GB free here)"
  [ "$free_gb" -ge 10 ] || echo "setup: warning: less than 10 GB free; the install (torch with its CUDA libraries) may run out of disk" >&2
  # --no-cache-dir: no second copy of every wheel in ~/.cache/pip
  .venv/bin/python -m pip install -q --no-cache-dir -c constraints.txt pip
  .venv/bin/python -m pip install -q --no-cache-dir -c constraints.txt -e ".[test,fast]"
  # Milvus Lite (triclip index export to a local .db) declares faiss-cpu, whose files would overwrite
  # faiss-gpu's `faiss` module: here faiss-gpu provides faiss, so it goes in without its declared dependencies
  # (its others, grpcio, numpy and pyarrow, are installed above; pyproject.toml lists it for other platforms)
  if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    .venv/bin/python -m pip install -q --no-cache-dir --no-deps -c constraints.txt milvus-lite
  fi
  echo "$want" > "$stamp"
fi
