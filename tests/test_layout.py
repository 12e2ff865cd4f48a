"""Dependencies point one way, in pipeline order (docs/CONTRACT.md "Layout"); no import circles.

The packages under ``triclip/``: ``core`` <- ``data``, ``compact`` <- ``codecs``, ``model``, ``losses`` <-
``training`` <- ``index`` <- ``app``, where ``codecs`` (byte codes) imports only ``core`` and ``compact``, and
``index`` (search) never imports ``training`` or ``losses``: a served index reads runs through
``triclip.model.run`` only.

Read from the source with ``ast`` (every ``import`` / ``from ... import``, lazy ones
inside functions included), so a backwards import anywhere fails here.

Circles between modules: the rule counts every import of one project module by another,
at module level or lazy inside a function (a lazy import that closes a circle only
defers it: the two modules still cannot be understood or changed apart). Imports under
``if TYPE_CHECKING:`` do not count (they never run). ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, else to ``a.b``.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "data", "compact", "codecs", "model", "losses", "training", "index", "app")  # pipeline order
ALLOWED = {
    "core": {"core"},
    "data": {"core", "data"},
    "compact": {"core", "compact"},
    "codecs": {"core", "compact", "codecs"},  # byte codes: FAISS and numpy, never the index that stores them
    "model": {"core", "data", "compact", "model"},
    "losses": {"core", "compact", "losses"},
    "training": {"core", "data", "compact", "model", "losses", "training"},
    "index": {"core", "data", "compact", "codecs", "model", "index"},
    "app": set(PACKAGES),  # the CLI's train / eval commands and the demo call training
}
# app modules that serve search read runs through the library only (the CLI's train / eval handlers
# and the demo are the only places that import training)
SERVING = tuple(f"triclip/app/{name}.py" for name in (
    "gradio_app", "live", "endpoints", "json_api", "panels", "gradio_patches", "server", "options", "__init__"))
OLD_PACKAGES = ("retrieval", "training", "index", "app")  # the flat layout before triclip/; no alias is kept


# circles known and being removed elsewhere; each entry must still be a circle (test below), so the entry
# goes once the circle does.
KNOWN_CIRCLES: list[list[str]] = []


def _imported_packages(path: Path) -> set[str]:
    """The triclip packages (``core``, ``data``, ...) that ``path`` imports, lazy imports included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
    return {m.split(".")[1] for m in modules if m.startswith("triclip.") and m.count(".") >= 1} & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = {
        str(f.relative_to(ROOT)): sorted(_imported_packages(f) - ALLOWED[package])
        for f in (ROOT / "triclip" / package).rglob("*.py")
    }
    assert {f: w for f, w in wrong.items() if w} == {}


def test_the_packages_are_the_pipeline_and_nothing_else():
    """Every folder under triclip/ is a package of the pipeline; the old flat packages are gone, imports too."""
    assert sorted(p.name for p in (ROOT / "triclip").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(PACKAGES)
    assert [p for p in OLD_PACKAGES if (ROOT / p).exists()] == []
    for path in [*ROOT.glob("triclip/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"),
                 *ROOT.glob("scripts/*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            assert not [n for n in names if n.split(".")[0] in OLD_PACKAGES], path


def test_no_package_holds_more_than_a_quarter_of_the_code():
    """Non-test lines per package (triclip's, benchmarks/, scripts/): none over 25%."""
    folders = [ROOT / "triclip" / p for p in PACKAGES] + [ROOT / "benchmarks", ROOT / "scripts"]
    lines = {f.name: sum(len(p.read_text(encoding="utf-8").splitlines()) for p in f.rglob("*.py")) for f in folders}
    total = sum(lines.values())
    assert {name: n for name, n in lines.items() if n > total / 4} == {}


def test_no_function_outside_tests_is_over_80_lines():
    """Functions that read in one sitting: none in triclip/, benchmarks/ or scripts/ is over 80 lines."""
    files = [f for d in ("triclip", "benchmarks", "scripts") for f in (ROOT / d).rglob("*.py")]
    long = [f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for f in files for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []


def _defined_twice(tree: ast.Module) -> list[str]:
    """Functions and classes a module (or a class) defines twice under one name: the later one silently
    replaces the earlier (a test defined twice never runs its first copy). Property setters are not counted."""
    twice, bodies = [], [tree.body]
    while bodies:
        body = bodies.pop()
        seen = set()
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.ClassDef):
                bodies.append(node.body)
            elif any(isinstance(d, ast.Attribute) for d in node.decorator_list):  # @x.setter, @x.deleter
                continue
            if node.name in seen:
                twice.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def test_no_module_defines_a_name_twice():
    files = [f for d in ("triclip", "benchmarks", "scripts", "tests") for f in (ROOT / d).rglob("*.py")]
    twice = {str(f.relative_to(ROOT)): found for f in files
             if (found := _defined_twice(ast.parse(f.read_text(encoding="utf-8"))))}
    assert twice == {}


def test_a_name_defined_twice_is_caught():
    source = "def f(): pass\nclass C:\n    def g(self): pass\n    def g(self): pass\ndef f(): pass\n"
    assert sorted(_defined_twice(ast.parse(source))) == ["f (line 5)", "g (line 4)"]
    prop = "class C:\n    @property\n    def x(self): pass\n    @x.setter\n    def x(self, v): pass\n"
    assert _defined_twice(ast.parse(prop)) == []


def test_serving_modules_never_import_training():
    for name in SERVING:
        assert "training" not in _imported_packages(ROOT / name), name


def test_search_and_index_commands_never_import_training():
    """In the CLI, only the train / eval / solve handlers (and their option builders) reach training/."""
    tree = ast.parse((ROOT / "triclip" / "app" / "cli.py").read_text(encoding="utf-8"))
    allowed = {"cmd_train", "cmd_eval", "cmd_solve", "_train_options", "_eval_options", "_solve_options"}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name not in allowed):
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("triclip.training"), fn.name


def test_a_backwards_import_is_caught(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from triclip.training.train import train\n")
    assert _imported_packages(bad) == {"training"}


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports, lazy imports included, ``if TYPE_CHECKING:`` ones not."""
    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name in modules)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.update([sub] if sub in modules else [child.module] if child.module in modules else [])
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _import_graph(roots: list[Path], base: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports, for the packages at ``roots`` (folders under ``base``)."""
    files = {_module_name(f, base): f for root in roots for f in root.rglob("*.py")}
    return {name: _module_imports(f, set(files)) - {name} for name, f in files.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def test_no_import_circles_between_modules():
    circles = _circles(_import_graph([ROOT / "triclip"]))
    assert [c for c in circles if c not in KNOWN_CIRCLES] == []


def test_each_known_circle_is_still_a_circle():
    """An entry of KNOWN_CIRCLES whose circle is gone must be deleted from it."""
    circles = _circles(_import_graph([ROOT / "triclip"]))
    assert [c for c in KNOWN_CIRCLES if c not in circles] == []


def test_a_circle_is_caught_lazy_or_not(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    graph = _import_graph([pkg], base=tmp_path)
    assert graph["pkg.d"] == set()  # TYPE_CHECKING imports never run
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
