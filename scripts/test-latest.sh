#!/usr/bin/env bash
# Drift check: installs the NEWEST versions pyproject.toml allows (no constraints.txt) into .venv-latest,
# says which packages moved from the pins, and runs the fast suite (not slow, not cuda) there.
#   bash scripts/test-latest.sh            report only
#   bash scripts/test-latest.sh --freeze   on a green run, rewrite constraints.txt from .venv-latest
# Extra arguments go to pytest (e.g. -x, -k NAME). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
freeze=0
if [ "${1:-}" = "--freeze" ]; then freeze=1; shift; fi

bash scripts/setup.sh >/dev/null  # the Debian packages and the pinned .venv the comparison reads
PY=${PYTHON:-python3}
[ -x .venv-latest/bin/python ] || "$PY" -m venv .venv-latest
echo "test-latest: installing the newest allowed versions into .venv-latest"
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }  # this machine's pip.conf noise
.venv-latest/bin/python -m pip install -q --no-cache-dir --upgrade pip 2>&1 | quiet
.venv-latest/bin/python -m pip install -q --no-cache-dir --upgrade --upgrade-strategy eager -e ".[test,fast]" 2>&1 | quiet
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then  # as scripts/setup.sh: faiss-gpu provides faiss
  .venv-latest/bin/python -m pip install -q --no-cache-dir --upgrade --no-deps milvus-lite 2>&1 | quiet
fi

.venv-latest/bin/python - <<'PY'
"""Print each package whose installed version differs from constraints.txt, and the bounds that hold one back."""
import re
import subprocess
from importlib.metadata import distributions
from pathlib import Path

from packaging.version import Version

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
pins = {}
for line in Path("constraints.txt").read_text().splitlines():
    if "==" in line and not line.startswith("#"):
        name, version = line.split("==", 1)
        pins[norm(name)] = version.strip()
now = {norm(d.metadata["Name"]): d.version for d in distributions()}
moved = sorted((n, pins[n], now[n]) for n in pins if n in now and now[n] != pins[n])
new = sorted(n for n in now if n not in pins and n != "triclip")
print(f"test-latest: {len(moved)} of {len(pins)} pinned packages moved")
for name, old, cur in moved:
    print(f"  moved: {name} {old} -> {cur}")
for name in new:
    print(f"  new (not in constraints.txt): {name} {now[name]}")
toml = Path("pyproject.toml").read_text()
for name, bound in re.findall(r'"([A-Za-z0-9_.-]+)[^"]*?<\s*([0-9][0-9.]*)', toml):
    out = subprocess.run([".venv-latest/bin/python", "-m", "pip", "index", "versions", name],
                         capture_output=True, text=True).stdout
    newest = re.search(r"\(([^)]+)\)", out)
    if not newest:
        continue
    newest, installed = newest.group(1), now.get(norm(name), "-")
    if Version(newest) >= Version(bound):
        why = f"held back by the bound <{bound}"
    elif installed != newest:
        why = "within the bound, held back by another requirement or a pip constraint file on this machine"
    else:
        why = "the newest release is installed"
    print(f"  {name}: installed {installed}, newest released {newest}: {why}")
PY

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 CUDA_VISIBLE_DEVICES=""
set +e
.venv-latest/bin/python -m pytest -q -m "not slow and not cuda" -p no:cacheprovider "$@" 2>&1 | tee .venv-latest/pytest.log | tail -40
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 0 ]; then
  echo "test-latest: the fast suite passes on the newest allowed versions"
  if [ "$freeze" = 1 ]; then
    { sed -n '1,3p' constraints.txt
      echo "pip==$(.venv-latest/bin/python -m pip --version | cut -d' ' -f2)"
      .venv-latest/bin/python -m pip freeze --exclude-editable | grep -v '^-e\|^#'; } > constraints.txt.new
    mv constraints.txt.new constraints.txt
    echo "test-latest: constraints.txt rewritten; run bash scripts/test.sh (the whole suite) before committing it"
  fi
else
  echo "test-latest: FAILED on the newest allowed versions (rc $rc); the failing tests, with the 'moved' lines above, say what broke:"
  grep -E "^(FAILED|ERROR) " .venv-latest/pytest.log || true
fi
exit "$rc"
