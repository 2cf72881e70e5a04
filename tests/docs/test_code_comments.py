"""Service code's comments and docstrings cite docs/design-decisions.md by title instead of
retelling its measurements, and every title they cite is an entry there."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE_CODE = re.compile(
    r"(gateway|services|scheduler_svc|worker_svc|tokenizer_svc|encoder_cache_svc|launcher)/"
)
# A measured figure: a time in ms or µs, a percentage, "Nx faster/slower".
FIGURE = re.compile(r"\d\s?(ms|µs|us)\b|\d\s?%|\d\s?x (faster|slower)", re.IGNORECASE)
CITATION = re.compile(r'design-decisions\.md[,;:]?\s+"([^"]+)"')


def service_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = listed.stdout.split()
    return [ROOT / n for n in names if SERVICE_CODE.match(n) and not n.endswith(("_pb2.py", "_pb2_grpc.py"))]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring and of each run of consecutive comment lines, with
    line breaks and comment markers folded into spaces."""
    found: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if tok.start[0] == last + 1 and found:
            found[-1] = (found[-1][0], f"{found[-1][1]} {text}")
        else:
            found.append((tok.start[0], text))
        last = tok.start[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                found.append((node.body[0].lineno, " ".join(doc.split())))
    return found


def titles() -> set[str]:
    lines = (ROOT / "docs" / "design-decisions.md").read_text().splitlines()
    return {line[3:].strip() for line in lines if line.startswith("## ")}


def test_service_comments_cite_instead_of_retelling_figures() -> None:
    retold = []
    for path in service_files():
        for line, text in prose(path.read_text()):
            uncited = CITATION.sub("", text)
            for match in FIGURE.finditer(uncited):
                context = uncited[max(0, match.start() - 50) : match.end() + 10]
                retold.append(f"{path.relative_to(ROOT)}:{line}: ...{context}...")
    assert not retold, "figures retold in service code (cite the design decision instead):\n" + "\n".join(
        retold
    )


def test_every_cited_design_decision_exists() -> None:
    known = titles()
    cited = [
        (path.relative_to(ROOT), line, match.group(1))
        for path in service_files()
        for line, text in prose(path.read_text())
        for match in CITATION.finditer(text)
    ]
    assert len(cited) > 10  # the pattern still finds the tree's citations
    unknown = [f"{path}:{line}: {title!r}" for path, line, title in cited if title not in known]
    assert not unknown, "citations of no docs/design-decisions.md entry:\n" + "\n".join(unknown)
