"""The docs' links lead somewhere: every relative Markdown link of a tracked .md file (docs/,
docs/features/, the READMEs) names a file that exists, every Markdown file under docs/ that
the docs or the code cite by path exists, and docs/features/README.md lists every feature
spec."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]+\.md")
FEATURES = ROOT / "docs" / "features"


def tracked(*patterns: str) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [ROOT / n for n in listed.stdout.split()]


def test_relative_markdown_links_resolve() -> None:
    broken = []
    for path in tracked("*.md"):
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to no file:\n" + "\n".join(broken)


def test_cited_doc_paths_exist() -> None:
    missing = []
    for path in tracked("*.md", "*.py", "*.yaml", "*.tpl", "*.proto", "Makefile"):
        for cited in DOC_PATH.findall(path.read_text(errors="replace")):
            if not (ROOT / cited).exists():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, "cites a doc that is not there:\n" + "\n".join(missing)


def test_features_index_lists_every_feature() -> None:
    index = (FEATURES / "README.md").read_text()
    specs = sorted(p.name for p in FEATURES.glob("*.md") if p.name != "README.md")
    assert specs, "docs/features/ holds no feature spec"
    assert [s for s in specs if f"]({s})" not in index] == [], (
        "feature specs missing from docs/features/README.md"
    )
