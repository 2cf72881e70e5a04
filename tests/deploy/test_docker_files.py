"""Static checks of deploy/docker (no Docker engine needed): the build reaches no network,
the stages and non-root user, the build-context allow-list, and agreement of the image with
the rendered chart that runs it: entrypoint, user, ports, env names, model paths."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from services.config import DEFAULT_PORTS
from tests.deploy.conftest import Rendered
from tests.deploy.test_helm_chart import COMPONENTS, config_fields, container, env_of, meshserve_deployments

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = (DOCKER / "Dockerfile").read_text()


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


STEPS = instructions(DOCKERFILE)
FINAL = max(i for i, (op, _) in enumerate(STEPS) if op == "FROM")


def runtime_env() -> dict[str, str]:
    """ENV of the runtime stage (KEY=VALUE pairs, ${ARG} left as written)."""
    env: dict[str, str] = {}
    for op, arg in STEPS[FINAL:]:
        if op == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", arg)))
    return env


def runtime_user() -> tuple[int, int]:
    users = [arg for op, arg in STEPS[FINAL:] if op == "USER"]
    assert users, "the runtime stage must switch to a non-root user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "USER must be numeric uid:gid (runAsNonRoot checks it)"
    return int(uid), int(gid)


def copied_packages() -> set[str]:
    """Top-level Python packages copied into the code directory (/src, /app at run time)."""
    return {m.group(1) for op, arg in STEPS if op == "COPY" for m in [re.fullmatch(r"(\w+)/ \1/", arg)] if m}


def test_stages_and_runtime_user() -> None:
    stages = [
        m.group(1) for op, arg in STEPS if op == "FROM" for m in [re.search(r"\bAS\s+(\S+)", arg, re.I)] if m
    ]
    assert len(stages) == len(set(stages)), stages
    for op, arg in STEPS:
        source = re.search(r"--from=(\S+)", arg)
        if op == "COPY" and source:
            assert source.group(1) in stages, arg
    assert runtime_user()[0] != 0
    assert any(op == "CMD" and "python" in arg for op, arg in STEPS[FINAL:])


def test_the_build_reaches_no_network() -> None:
    """No BuildKit frontend to pull, no registry base, no index: base and wheels are local."""
    assert not re.search(r"^#\s*syntax=", DOCKERFILE, re.M), "a syntax line makes BuildKit pull a frontend"
    assert "://" not in "".join(arg for _, arg in STEPS), "the build must not name any URL"
    for op, arg in STEPS:
        if op == "FROM":
            assert arg.split()[0] in ("${BASE_IMAGE}", "build"), arg
    assert re.search(r"PIP_NO_INDEX=1", DOCKERFILE) and re.search(r"PIP_FIND_LINKS=/wheels", DOCKERFILE)
    assert "grep -E '^torch==' requirements.txt" in DOCKERFILE
    pins = [
        line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("torch==")
    ]
    assert len(pins) == 1, "the image installs requirements.txt's single torch== pin"


def test_base_packages_are_pinned() -> None:
    base = (DOCKER / "base.sh").read_text()
    lists = re.findall(r'^\w+_PKGS="([^"]+)"', base, re.M)
    assert lists
    for entry in ",".join(lists).split(","):
        if entry.startswith("$"):
            continue
        name, _, version = entry.partition("=")
        assert version, f"base.sh: {name} is not pinned"


def test_build_context_allow_list() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "allow-list: ignore everything, then re-include"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for op, arg in STEPS:
        if op != "COPY" or arg.startswith("--from"):
            continue
        source = arg.split()[0].rstrip("/")
        if source.startswith("${"):
            continue  # a build arg: a directory build.sh stages under build/docker
        assert any(source == a or source.startswith(a + "/") for a in allowed), (
            f"{source} is not in .dockerignore"
        )
        assert (ROOT / source).exists(), source
    staged = [m for m in re.findall(r"ARG (?:WHEELS|MODELS)=(\S+)", DOCKERFILE)]
    assert staged and all(s.startswith("build/docker/") for s in staged) and "build/docker" in allowed


@pytest.mark.parametrize("values", ["default", "gpu"])
def test_image_agrees_with_the_chart(values: str, request: pytest.FixtureRequest) -> None:
    """Every meshserve container of the chart runs the image's way: `python -m MODULE` for a
    package the image holds, as the image's numeric user, on ports the image exposes, with
    env names the services read and writable paths where the image keeps its caches."""
    rendered: Rendered = request.getfixturevalue(f"{values}_render")
    uid, gid = runtime_user()
    env = runtime_env()
    exposed = {int(p) for op, arg in STEPS[FINAL:] if op == "EXPOSE" for p in arg.split()}
    assert set(DEFAULT_PORTS.values()) <= exposed, "the image exposes every default port"
    assert "/opt/venv/bin" in env["PATH"].split(":") and env["PYTHONPATH"] == "/app"
    for component, deployment in meshserve_deployments(rendered).items():
        c = container(deployment)
        pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
        assert c["command"][:2] == ["python", "-m"] and c["command"][2] in copied_packages(), component
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
        assert {p["containerPort"] for p in c["ports"]} <= exposed, component
        fields = config_fields(COMPONENTS[component][1]) | config_fields("services.config")
        image_names = {n for n in env if n.startswith("MESHSERVE_")} & fields
        chart_env = env_of(deployment)
        for name in image_names:  # what the chart also sets, it sets the same way here
            if name in chart_env and name != "MESHSERVE_DEVICE":
                assert chart_env[name]["value"] == env[name], (component, name)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert f"{env['HOME']}/.cache" in mounts and env["TRITON_CACHE_DIR"].startswith(
            f"{env['HOME']}/.cache/"
        )
        for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            assert env[offline] == "1"
    for op, arg in STEPS[FINAL:]:
        if op == "ENV":
            for name in re.findall(r"(MESHSERVE_\w+)=", arg):
                assert any(name in config_fields(m) for _, m in COMPONENTS.values()), name


def test_model_paths_match_the_chart(default_render: Rendered) -> None:
    (config_map,) = default_render.of_kind("ConfigMap")
    build = (DOCKER / "build.sh").read_text()
    model_dir = re.search(r'MODEL_DIR="\$\{MODEL_DIR:-([^}]+)\}"', build)
    assert model_dir and "COPY ${MODELS}/ /opt/meshserve/models/" in DOCKERFILE
    staged_as = "/opt/meshserve/models/" + Path(model_dir.group(1)).name
    assert config_map["data"]["model-dir"] == staged_as
    assert f'ln -s "$emb" {config_map["data"]["embedding-model-dir"]}' in DOCKERFILE
    makefile = (ROOT / "Makefile").read_text()
    assert f"MODEL_DIR ?= {model_dir.group(1)}" in makefile, "build.sh stages what `make model` builds"
