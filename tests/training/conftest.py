import pytest

from triclip.data.builtin import prepare


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Locked-tower caches go to a fresh folder per test."""
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory):
    """A small shapes dataset: DIR/train.jsonl and DIR/val.jsonl."""
    out = tmp_path_factory.mktemp("shapes")
    prepare("shapes", str(out), num=240, seed=0)
    return out
