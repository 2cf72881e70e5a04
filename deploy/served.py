"""What the deployed mesh serves, held against what `make serve` serves on the same host.

Two comparisons of `make deploy-check` (deploy/check.py):
- the engine each decoder runs: the effective configuration its start-up line states
  (``LLMEngine.describe``: dtype, attention backend, compiled, native CPU kernels), read
  from each decoder container's log and from `make serve`'s decoder log. A container whose
  engine differs (an image without a compiler serves eagerly, without native kernels) fails
  the check.
- throughput under `vllm bench serve` (bench/served_vs_vllm.py's client and workload: random
  128 in / 64 out, ignore_eos) at each concurrency, against the gateway container and against
  `make serve`'s gateway, both up on the same host and commit, in rounds whose order
  alternates; the ratio is of the medians over the rounds.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.served_vs_vllm import bench_runs, mesh_server, serving
from services.log import logged_message

# The fields of the engine's start-up line that must agree, each with the pattern of its value.
ENGINE_FIELDS = {
    "dtype": r"dtype (\w+)",
    "attention": r"attention (\w+)",
    "compiled": r"compiled (yes|no)",
    "native CPU kernels": r"native CPU kernels (yes|no|n/a)",
}


def engine_config(log_text: str) -> dict[str, str]:
    """The ENGINE_FIELDS of the last engine start-up line in a service log; ValueError
    naming what is missing when the log holds no such line."""
    messages = [logged_message(line) or "" for line in log_text.splitlines()]
    lines = [m for m in messages if m.startswith("engine: dtype ")]
    if not lines:
        raise ValueError("no engine start-up line ('engine: dtype ...') in the log")
    line = lines[-1]
    found = {name: re.search(pattern, line) for name, pattern in ENGINE_FIELDS.items()}
    missing = [name for name, match in found.items() if match is None]
    if missing:
        raise ValueError(f"the engine start-up line lacks {missing}: {line}")
    return {name: match.group(1) for name, match in found.items() if match is not None}


def config_differences(deployed: dict[str, str], served: dict[str, str]) -> list[str]:
    """'field: deployed X, make serve Y' for every field on which the two engines differ."""
    return [
        f"{name}: deployed {deployed.get(name)}, make serve {served.get(name)}"
        for name in ENGINE_FIELDS
        if deployed.get(name) != served.get(name)
    ]


@dataclass
class MakeServe:
    """`make serve`'s mesh while it is up: its command, seconds to be up, decoders' engine, URL."""

    command: str
    up_s: float
    engine: dict[str, str]
    url: str

    def report(self) -> dict[str, Any]:
        return {"command": self.command, "up_s": round(self.up_s, 1), "engine": self.engine}


@contextlib.contextmanager
def make_serve(model_dir: Path, decoders: int) -> Iterator[MakeServe]:
    """`make serve`'s mesh on this host (the launcher, its defaults) with as many decoders as
    the deployment runs, up (every decoder's engine line logged) until the block ends. The
    same number of decoders, because what the ratio is for is what the containers cost; one
    decoder with the host's cores against two of one core each measures the topology instead
    (docs/design-decisions.md, "Images carry a C/C++ toolchain")."""
    extra = ["--num-decoders", str(decoders)] if decoders != 1 else []
    with tempfile.TemporaryDirectory() as logs:
        server = mesh_server(model_dir.name, str(model_dir), Path(logs), extra)
        with serving(server) as up_s:
            engine = _engines_up(Path(logs), decoders)
            yield MakeServe(" ".join(server.command), up_s, engine, f"http://127.0.0.1:{server.port}")


def alternating_rounds(
    vllm: str, urls: dict[str, str], model: str, tokenizer: str, concurrencies: Sequence[int],
    min_prompts: int, rounds: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """`vllm bench serve` at every concurrency against each of `urls` (label -> base URL), both
    systems up, the order alternating between rounds so that a shared host's drift falls on
    both; one record per run (its round, label as "side", concurrency and results)."""
    labels = list(urls)
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        for label in labels if index % 2 == 0 else labels[::-1]:
            print(f"round {index + 1}/{rounds}: {label}", flush=True)
            results = bench_runs(vllm, urls[label], model, tokenizer, concurrencies, min_prompts)
            runs += [{"round": index + 1, "side": label, "concurrency": c, **r} for c, r in results.items()]
    return runs


def _engines_up(logs: Path, decoders: int, timeout_s: float = 900) -> dict[str, str]:
    """The engine configuration of `make serve`'s decoders, once every one has logged it
    (the mesh answers as soon as one decoder is ready); ValueError when they differ."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            engines = [engine_config((logs / f"decoder-{i}.log").read_text()) for i in range(decoders)]
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    if any(e != engines[0] for e in engines):
        raise ValueError(f"make serve's decoders run different engines: {engines}")
    return engines[0]


def ratios(medians: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Deployed / `make serve` median output tok/s per concurrency (keys "c=N"), from
    `median_table`'s medians keyed by side ("deployed", "make_serve")."""
    deployed, served = medians["deployed"], medians["make_serve"]
    return {
        f"c={c}": round(deployed[c]["output_throughput"] / served[c]["output_throughput"], 3) for c in served
    }
