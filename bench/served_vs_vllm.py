"""Served throughput and latency of `make serve`'s mesh against vLLM's own server, one client for both.

    .venv/bin/python -m bench.served_vs_vllm --vllm /tmp/peer/venv/bin/vllm \\
        --model tiny-llama=/tmp/peer/tiny-llama --model smollm2-135m-instruct=.cache/models/smollm2-135m-instruct \\
        --concurrency 1,8,32 --rounds 3 --out bench/results/served_vs_vllm.json

The client is vLLM's `vllm bench serve` (random prompts, 128 in / 64 out, ignore_eos, max(64, 4c)
prompts per run: `--min-prompts`). Per model and round, each server is started, benchmarked at every
concurrency and stopped before the other starts (they share the host's cores); the order of the two
alternates between rounds. The mesh runs as `make serve` runs it (`python -m launcher up
--model-dir DIR`, its defaults, no flags); vLLM gets the dtype the mesh resolves on this host
(`default_dtype`), so both compute alike. The JSON holds every run, the medians per system and
concurrency, the ratios mesh / vLLM, the host's CPU model, flags and class, both sides' dtype,
compile settings and versions, and the exact commands; it is kept in `--out` under the host's
class (`amx`, `avx512-bf16`, `avx2`) beside the other classes' latest results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.host import commit, host_info
from services.config import DEFAULT_PORTS, default_of
from worker_svc.engine.config import EngineConfig, default_dtype

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / ".cache/logs/served_vs_vllm"  # each server's output, and the mesh's services' logs
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")


@dataclass(frozen=True)
class Server:
    """How to start one system on `port` for a model, and the process group running it."""

    system: str
    command: list[str]
    port: int
    env: dict[str, str]
    cwd: Path = ROOT  # where it starts (a mesh runs the code of the checkout it starts in)


def servers(vllm: str, name: str, model_dir: str, dtype: str, log_dir: Path) -> list[Server]:
    """vLLM's server and the mesh, each serving `model_dir` as `name`."""
    vllm_cmd = [vllm, "serve", model_dir, "--host", "127.0.0.1", "--port", "8011"]
    vllm_cmd += ["--served-model-name", name, "--dtype", dtype, "--max-model-len", "1024"]
    vllm_env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return [Server("vllm", vllm_cmd, 8011, vllm_env), mesh_server(name, model_dir, log_dir)]


def mesh_server(name: str, model_dir: str, log_dir: Path, extra: Sequence[str] = ()) -> Server:
    """The mesh as `make serve` starts it (its defaults, and `extra` launcher flags), serving
    `model_dir` as `name`."""
    mesh_cmd = [sys.executable, "-m", "launcher", "up", "--model-dir", model_dir]
    mesh_cmd += ["--served-model-name", name, "--log-dir", str(log_dir), *extra]
    return Server("meshserve", mesh_cmd, DEFAULT_PORTS["gateway"], {})


def wait_up(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> float:
    """Seconds until `GET /health` answers 200 (both servers: every component ready; the mesh's
    `/v1/models` answers before its workers are); RuntimeError if the server exits first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"no answer on port {port} after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def bench_command(
    vllm: str, base_url: str, name: str, tokenizer: str, concurrency: int, min_prompts: int, out: Path
) -> list[str]:
    """`vllm bench serve` against `base_url` at one concurrency, its result saved as JSON in `out`."""
    prompts = max(min_prompts, 4 * concurrency)
    return [
        vllm, "bench", "serve", "--backend", "vllm", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", name, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--random-range-ratio", "0", "--num-prompts", str(prompts), "--request-rate", "inf",
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def bench_once(
    vllm: str, base_url: str, name: str, tokenizer: str, concurrency: int, min_prompts: int
) -> dict[str, float]:
    """One `vllm bench serve` run against `base_url`: its failed count and METRICS."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = bench_command(vllm, base_url, name, tokenizer, concurrency, min_prompts, out)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
        result = json.loads(out.read_text())
    return {"failed": result.get("failed", 0), **{m: result[m] for m in METRICS}}


def bench_runs(
    vllm: str, base_url: str, name: str, tokenizer: str, concurrencies: Sequence[int], min_prompts: int
) -> dict[int, dict[str, float]]:
    """`bench_once` at each concurrency, in order, a line printed per run."""
    runs = {}
    for c in concurrencies:
        runs[c] = bench_once(vllm, base_url, name, tokenizer, c, min_prompts)
        print(f"  {base_url} c={c:<3d} {runs[c]['output_throughput']:8.1f} tok/s", flush=True)
    return runs


@contextlib.contextmanager
def serving(server: Server) -> Iterator[float]:
    """Starts `server` (its output in LOG_DIR/SYSTEM.log), yields the seconds it took to be
    up, stops it."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with (LOG_DIR / f"{server.system}.log").open("wb") as log:
        proc = subprocess.Popen(
            server.command, cwd=server.cwd, env={**os.environ, **server.env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield wait_up(server.port, proc)
        finally:
            stop(proc)


def run_server(
    server: Server, vllm: str, name: str, tokenizer: str, concurrencies: Sequence[int], min_prompts: int
) -> list[dict]:
    """Starts `server`, benchmarks it at each concurrency, stops it; one record per run."""
    with serving(server) as up_s:
        runs = bench_runs(
            vllm, f"http://127.0.0.1:{server.port}", name, tokenizer, concurrencies, min_prompts
        )
    return [
        {"system": server.system, "concurrency": c, "up_s": round(up_s, 1), **result}
        for c, result in runs.items()
    ]


def median_table(
    runs: list[dict], key: str, labels: Sequence[str], concurrencies: Sequence[int]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per label (of the runs' field `key`) and concurrency, each metric's median over the rounds."""
    return {
        label: {
            str(c): {
                m: round(
                    statistics.median(r[m] for r in runs if r[key] == label and r["concurrency"] == c), 2
                )
                for m in METRICS
            }
            for c in concurrencies
        }
        for label in labels
    }


def summarize(runs: list[dict], concurrencies: Sequence[int]) -> dict:
    """Medians per system and concurrency, and the mesh / vLLM ratios of throughput and TTFT."""
    medians = median_table(runs, "system", ("vllm", "meshserve"), concurrencies)
    ratios = {
        str(c): {
            "throughput": round(
                medians["meshserve"][str(c)]["output_throughput"]
                / medians["vllm"][str(c)]["output_throughput"],
                3,
            ),
            "ttft_p50": round(
                medians["meshserve"][str(c)]["median_ttft_ms"] / medians["vllm"][str(c)]["median_ttft_ms"], 3
            ),
        }
        for c in concurrencies
    }
    return {"medians": medians, "mesh_over_vllm": ratios}


def settings(vllm: str, dtype: str) -> dict[str, dict[str, str]]:
    """What each side ran: the peer's version, both sides' dtype and compile settings."""
    version = subprocess.run([vllm, "--version"], capture_output=True, text=True, check=False)
    return {
        "vllm": {
            "version": version.stdout.strip().splitlines()[-1] if version.stdout.strip() else "unknown",
            "dtype": dtype,
            "compile": "its CPU backend's defaults (no compilation flags given)",
        },
        "meshserve": {
            "version": commit(),
            "dtype": f"{dtype} (worker default: auto)",
            "compile": f"compile_model={default_of(EngineConfig, 'compile_model')} (worker default)",
        },
    }


def keep(out: Path, report: dict) -> None:
    """Writes `report` into `out` under its host class, keeping the other classes' results:
    one current result per class (an AMX host's bf16 run never replaces an AVX2 host's)."""
    try:
        kept = json.loads(out.read_text()).get("by_host_class", {})
    except (OSError, ValueError):
        kept = {}
    kept[report["host"]["host_class"]] = report
    out.write_text(json.dumps({"by_host_class": dict(sorted(kept.items()))}, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--vllm", required=True, help="the vllm command (of an environment of its own)")
    parser.add_argument(
        "--model", action="append", required=True, help="NAME=DIR, served as NAME (repeatable)"
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per model and system (default 3)")
    parser.add_argument(
        "--min-prompts",
        type=int,
        default=64,
        help="prompts per run: max(this, 4 * concurrency) (default 64; fewer leave a TTFT median to chance)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/served_vs_vllm.json")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    dtype = default_dtype("cpu")
    report: dict = {
        "command": " ".join(["python -m bench.served_vs_vllm", *(argv if argv is not None else sys.argv[1:])]),
        "host": host_info(), "dtype": dtype,
        "settings": settings(args.vllm, dtype),
        "workload": f"vllm bench serve, random 128 in / 64 out, ignore_eos, max({args.min_prompts}, 4*c) prompts",
        "models": {},
        "client_command": " ".join(
            bench_command(args.vllm, "URL", "NAME", "DIR", 0, args.min_prompts, Path("RESULT.json"))
        ),
    }  # fmt: skip
    for spec in args.model:
        name, model_dir = spec.split("=", 1)
        runs: list[dict] = []
        pair = servers(args.vllm, name, model_dir, dtype, LOG_DIR / "mesh")
        for round_index in range(args.rounds):
            print(f"{name}: round {round_index + 1}/{args.rounds}", flush=True)
            for server in pair if round_index % 2 == 0 else pair[::-1]:
                for record in run_server(server, args.vllm, name, model_dir, concurrencies, args.min_prompts):
                    runs.append({"round": round_index + 1, **record})
        commands = {s.system: " ".join(s.command) for s in pair}
        report["models"][name] = {
            "dir": model_dir,
            "commands": commands,
            "runs": runs,
            **summarize(runs, concurrencies),
        }
        keep(args.out, report)
    print(json.dumps({n: m["mesh_over_vllm"] for n, m in report["models"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
