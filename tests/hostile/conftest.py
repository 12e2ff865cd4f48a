"""Fixtures of the hostile suite: tiny shapes data, an untrained tiny run, a tiny index, the CLI.

Everything is small (tens of records, ``tiny`` at D = 32, no training unless a test is
about training) so the suite stays fast; ``cli`` runs ``triclip.app.cli.main`` in this process and
returns ``(status, stdout, stderr)``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # FAISS on a busy CPU (see tests/index/conftest.py)

import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from triclip.app.cli import main  # noqa: E402
from triclip.data.builtin import prepare  # noqa: E402
from tests.index.conftest import make_run  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Locked-tower caches go to a fresh folder per test."""
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def cli(capsys):
    """``cli(*args) -> (status, stdout, stderr)`` of ``triclip ARGS`` run in this process."""

    def run(*args) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def one_line_error(status: int, err: str) -> str:
    """Assert the CLI's user-error shape (exit 2, one ``triclip: error:`` line, no traceback); return the line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("triclip: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> Path:
    """A shapes data folder with ~40 records (train.jsonl, val.jsonl, images/)."""
    out = tmp_path_factory.mktemp("hostile") / "shapes"
    prepare("shapes", str(out), num=44, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """An untrained tiny run (seeded weights, random importance), D = 32."""
    return make_run(tmp_path_factory.mktemp("hostile") / "run", seed=0)


@pytest.fixture(scope="session")
def built_index(tmp_path_factory, shapes, tiny_run) -> Path:
    """A tiny index over the shapes train split; copy it before changing it (:func:`copy_tree`)."""
    from triclip.index.sources import IndexBuildConfig, build_index

    out = tmp_path_factory.mktemp("hostile") / "index"
    build_index(IndexBuildConfig(run=str(tiny_run), data=str(shapes / "train.jsonl"), out=str(out), dims=[8]))
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def first_rows(manifest: Path, out: Path, n: int) -> Path:
    """A manifest of the first ``n`` rows of ``manifest`` with absolute image paths."""
    import json

    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()][:n]
    for row in rows:
        row["image"] = str((manifest.parent / row["image"]).resolve())
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def unprivileged_prefix() -> list[str]:
    """The command prefix that makes a child process subject to file permissions.

    We run as root in CI, and root ignores chmod (CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH), so
    a chmod-000 test would pass or fail for the wrong reason. ``setpriv`` (util-linux) starts
    the child as the same uid 0 with an empty capability bounding set: it then meets the
    mode bits like any user (files owned by root with mode 000 are closed to it), while the
    venv and the repository stay readable. Skips the test where that is not possible.
    """
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested honestly")
    prefix = [setpriv, "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"]
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as probe:
        os.chmod(probe, 0)
        denied = subprocess.run([*prefix, "test", "-r", probe + "/."]).returncode != 0
        os.chmod(probe, 0o700)
    if not denied:
        pytest.skip("setpriv could not drop the capabilities that let root ignore permissions")
    return prefix


def run_triclip(args, tmp_path: Path, unprivileged: bool = False, stdout=None, timeout: float = 300):
    """``triclip ARGS`` in a child process (``python -m triclip``); returns the CompletedProcess (text)."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               TRICLIP_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # fmt: skip
    cmd = [*(unprivileged_prefix() if unprivileged else []), sys.executable, "-m", "triclip", *map(str, args)]
    return subprocess.run(cmd, env=env, text=True, stdout=stdout or subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=timeout)  # fmt: skip


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MB tmpfs (root only; skipped where mount is not permitted), filled to ``fill(leave)`` bytes free."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("a small filesystem needs root and mount (tmpfs)")

    def fill(leave: int) -> Path:
        st = os.statvfs(mount)
        (mount / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
        return mount

    try:
        yield fill
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
