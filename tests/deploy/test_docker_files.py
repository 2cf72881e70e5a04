"""Static checks of deploy/docker (no Docker engine here): stages, non-root user, stub
generation, the torch pin, the build-context allow-list, and agreement with the chart's
default model paths and ports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
VALUES = yaml.safe_load((ROOT / "deploy" / "helm" / "meshserve" / "values.yaml").read_text())
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
# What the image must contain: every service's package, the shared runtime, the model builder.
PACKAGES = [
    "services",
    "gateway",
    "tokenizer_svc",
    "scheduler_svc",
    "worker_svc",
    "encoder_cache_svc",
    "devtools",
]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(params=DOCKERFILES)
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, list[tuple[str, str]], str]:
    text = (DOCKER / request.param).read_text()
    return request.param, instructions(text), text


def test_stages_and_runtime_user(dockerfile: tuple[str, list[tuple[str, str]], str]) -> None:
    name, steps, _ = dockerfile
    stages = [
        m.group(1) for op, arg in steps if op == "FROM" for m in [re.search(r"\bAS\s+(\S+)", arg, re.I)] if m
    ]
    assert len(stages) == len(set(stages)), stages
    for op, arg in steps:
        source = re.search(r"--from=(\S+)", arg)
        if op == "COPY" and source:
            assert source.group(1) in stages, (name, arg)
    final = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    users = [arg for op, arg in steps[final:] if op == "USER"]
    assert users, f"{name}: the runtime stage must switch to a non-root user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{name}: USER must be numeric (runAsNonRoot checks it)"
    assert int(uid) == VALUES["podSecurityContext"]["runAsUser"]
    assert any(op == "CMD" and "python" in arg for op, arg in steps[final:]), name


def test_bases_and_torch(dockerfile: tuple[str, list[tuple[str, str]], str]) -> None:
    name, _, text = dockerfile
    pins = [
        line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch==")
    ]
    assert len(pins) == 1, "the Dockerfiles install torch from requirements.txt's single torch== pin"
    assert "grep -E '^torch==' requirements.txt" in text
    if name == "Dockerfile":
        assert re.search(r"python:3\.11-slim", text)
        assert "download.pytorch.org/whl/cpu" in text
    else:
        assert re.search(r"nvidia/cuda:\S+-runtime-", text)
        assert "python3.11" in text and "import torch, triton" in text
        assert re.search(r"download\.pytorch\.org/whl/cu\d+", text)


def test_stubs_and_models_match_the_chart(dockerfile: tuple[str, list[tuple[str, str]], str]) -> None:
    name, _, text = dockerfile
    assert "scripts/gen_proto.sh" in text and (ROOT / "scripts" / "gen_proto.sh").is_file()
    assert (ROOT / "devtools" / "default_model.py").is_file()
    model_dir = VALUES["model"]["dir"]
    assert f"python -m devtools.default_model --out {model_dir}" in text, name
    embedding_dir = VALUES["embeddingModel"]["dir"]
    assert f'ln -s "$emb" {embedding_dir}' in text, name
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert set(VALUES["ports"].values()) | {VALUES["metrics"]["port"]} <= exposed, name


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_allow_list(name: str) -> None:
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "allow-list: ignore everything, then re-include"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for required in [*PACKAGES, "requirements.txt", "proto", "scripts/gen_proto.sh"]:
        assert required in allowed, f"{name}.dockerignore must re-include {required}"
    for path in allowed:
        assert (ROOT / path).exists(), f"{path} does not exist"
