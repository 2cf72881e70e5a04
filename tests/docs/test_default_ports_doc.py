"""Default ports the docs state are services.config.DEFAULT_PORTS: every mention of one is
in a form this test reads (a gateway URL, a `--NAME-address`, a services table row, a
launcher message) and names the component whose port it is."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from services.config import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[2]
HOST = r"(?:127\.0\.0\.1|localhost)"
# (pattern, component or None when the pattern's "name" group names it)
FORMS = [
    (rf"http://{HOST}:(?P<port>\d+)", "gateway"),
    (rf"--(?P<name>[a-z-]+)-address {HOST}:(?P<port>\d+)", None),
    (r"^\| `(?P<name>[a-z-]+)` \|[^|]*\| (?P<port>\d+) `(?:grpc|http)`", None),
    (r"`port (?P<port>\d+)\s+\((?P<name>[a-z-]+)\) is in use", None),
    (r"-p (?P<port>\d+):(?P=port) [^`]*python -m gateway", "gateway"),
    (r"port-forward svc/meshserve-(?P<name>[a-z-]+) (?P<port>\d+):(?P=port)", None),
    (r"(?P<name>[a-z-]+)\.config: \{advertise_address: \"\[\$\(POD_IP\)\]:(?P<port>\d+)\"", None),
]
ANY_DEFAULT = re.compile(r"\b(?:" + "|".join(str(p) for p in DEFAULT_PORTS.values()) + r")\b")


def _docs() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in names.stdout.split() if not name.startswith("deploy/results/")]


def test_every_default_port_in_the_docs_is_the_components() -> None:
    checked = 0
    for path in _docs():
        text = path.read_text()
        found = 0
        for pattern, component in FORMS:
            for match in re.finditer(pattern, text, re.MULTILINE):
                name = component or match.group("name")
                assert name in DEFAULT_PORTS, f"{path.name}: {match.group(0)!r} names no component"
                assert int(match.group("port")) == DEFAULT_PORTS[name], f"{path.name}: {match.group(0)!r}"
                found += len(ANY_DEFAULT.findall(match.group(0)))
        stated = len(ANY_DEFAULT.findall(text))
        assert stated <= found, f"{path.name} states a default port in a form this test does not read"
        checked += found
    assert checked >= 10
