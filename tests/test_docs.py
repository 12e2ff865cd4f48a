"""The docs speak of the project: its contract is in the repository, its results page is short."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("triclip", "benchmarks", "tests", "scripts", "docs")
           for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")] + [ROOT / "README.md"]


def test_the_contract_is_cited_in_the_repository():
    for path in (p for p in SOURCES if p != Path(__file__).resolve()):  # this file names what it refuses
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\bSPEC\b(?!S)", text), path  # the contract is docs/CONTRACT.md
        assert "shared/SPEC" not in text, path
    contract = (ROOT / "docs" / "CONTRACT.md").read_text(encoding="utf-8")
    for section in ("Layout", "Notation", "Objectives", "Compact features", "Metrics", "Embeddings", "Environment"):
        assert f"\n## {section}" in contract, section  # the sections the code cites


def test_results_are_short_and_speak_of_the_project():
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert len(results.splitlines()) <= 400
    assert "```bash" in results  # the commands beside the numbers
    for path in (ROOT / "docs").glob("*.md"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b(?:sessions? \d|issue \d+|item \d|work period)", text, re.I), path
