"""The docs speak of the project: its contract is in the repository, its results page is short."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("triclip", "benchmarks", "tests", "scripts", "docs")
           for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")] + [ROOT / "README.md"]
# how the work was done, not what the code does: a ticket's number or items, a trial, a session, the lead
PROCESS = re.compile(r"\b(?:issues?\b|trials?\b|tickets?\b|work period|sessions? \d|items? \d"
                     r"|(?:for|from|to|by|ask) the lead\b)|#\d+\)", re.I)


def test_the_contract_is_cited_in_the_repository():
    for path in (p for p in SOURCES if p != Path(__file__).resolve()):  # this file names what it refuses
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bSPEC\b(?!S)", text), path  # the contract is docs/CONTRACT.md
        assert "shared/SPEC" not in text, path
    contract = (ROOT / "docs" / "CONTRACT.md").read_text(encoding="utf-8")
    for section in ("Layout", "Notation", "Objectives", "Compact features", "Metrics", "Embeddings", "Environment"):
        assert f"\n## {section}" in contract, section  # the sections the code cites


def test_results_are_short():
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert len(results.splitlines()) <= 400
    assert "```bash" in results  # the commands beside the numbers


def test_code_and_docs_speak_of_the_project_not_of_the_work():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
             for path in SOURCES + [ROOT / "pyproject.toml"] if path != Path(__file__).resolve()  # this file names them
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if PROCESS.search(line)]
    assert found == []


def test_the_process_words_are_caught():
    for text in ("(issue 26 item 3)", "the quality issue (#13)", "the hostile trial", "ask the lead", "ticket 4",
                 "session 2", "item 5: x", "for the lead, who"):
        assert PROCESS.search(text), text
    for text in ("a Gradio session per client", "the lead shrinks as k grows", "an ONNX Runtime session", "key#2"):
        assert not PROCESS.search(text), text


def test_library_code_never_cites_the_archive():
    """The code cites docs/CONTRACT.md or docs/results.md; the archive holds superseded tables only."""
    citing = [str(p.relative_to(ROOT)) for p in (ROOT / "triclip").rglob("*.py")
              if "results_archive" in p.read_text(encoding="utf-8")]
    assert citing == []
