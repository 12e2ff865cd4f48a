"""Dependencies point one way (SPEC "Layout"): retrieval <- training, index <- app.

Read from the source with ``ast`` (every ``import`` / ``from ... import``, lazy ones
inside functions included), so a backwards import anywhere fails here.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("retrieval", "training", "index", "app")
ALLOWED = {
    "retrieval": {"retrieval"},
    "training": {"retrieval", "training"},
    "index": {"retrieval", "index"},
    "app": set(PACKAGES),  # the CLI's train / eval commands and the demo call training
}
# app modules that serve search read runs through the library only (the CLI's train / eval handlers
# and the demo are the only places that import training)
SERVING = (
    "app/gradio_app.py", "app/live.py", "app/endpoints.py", "app/json_api.py", "app/panels.py",
    "app/gradio_patches.py", "app/server.py", "app/options.py", "app/__main__.py", "app/__init__.py",
)


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = {
        str(f.relative_to(ROOT)): sorted(_imported_packages(f) - ALLOWED[package])
        for f in (ROOT / package).rglob("*.py")
    }
    assert {f: w for f, w in wrong.items() if w} == {}


def test_serving_modules_never_import_training():
    for name in SERVING:
        assert "training" not in _imported_packages(ROOT / name), name


def test_search_and_index_commands_never_import_training():
    """In the CLI, only the train / eval / solve handlers (and their option builders) reach training/."""
    tree = ast.parse((ROOT / "app" / "cli.py").read_text(encoding="utf-8"))
    allowed = {"cmd_train", "cmd_eval", "cmd_solve", "_train_options", "_eval_options", "_solve_options"}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name not in allowed):
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "training", fn.name


def test_a_backwards_import_is_caught(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from training.train import train\n")
    assert _imported_packages(bad) == {"training"}
