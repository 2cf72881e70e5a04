"""Two checkouts of the mesh side by side under vLLM's `vllm bench serve`: is a change no
worse (or better) where users see it?

    .venv/bin/python -m bench.mesh_ab --tree before=/tmp/before --tree after=. \\
        --model tiny-llama=/tmp/peer/tiny-llama --concurrency 1,8,32 --rounds 3 --out bench/results/mesh_ab.json

Each tree's mesh starts as `make serve` starts it (`python -m launcher up`, its defaults) from
that tree (this environment's Python, the tree's own code), one at a time: per round, each is
started, benchmarked at every concurrency (the same client runs as `bench.served_vs_vllm`'s)
and stopped; the order alternates between rounds, so drift on a shared host falls on both.
The JSON holds every run, the medians per tree and concurrency, and the ratios of the
second tree to the first, with both trees' commits and the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.host import host_info
from bench.served_vs_vllm import LOG_DIR, METRICS, ROOT, Server, bench_runs, median_table, serving
from services.config import DEFAULT_PORTS


def tree_server(label: str, tree: Path, name: str, model_dir: str) -> Server:
    """The mesh of checkout `tree`, serving `model_dir` as `name` (labelled `label`)."""
    command = [sys.executable, "-m", "launcher", "up", "--model-dir", model_dir, "--served-model-name", name]
    command += ["--log-dir", str(LOG_DIR / f"ab-{label}")]
    return Server(label, command, DEFAULT_PORTS["gateway"], {}, cwd=tree)


def tree_commit(tree: Path) -> str:
    """The tree's HEAD, with `+dirty` when it has uncommitted changes."""
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "-uno"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--vllm", default=str(ROOT / ".cache/vllm-client/bin/vllm"), help="the vllm client command"
    )
    parser.add_argument("--tree", action="append", required=True, help="LABEL=DIR, a checkout (exactly two)")
    parser.add_argument("--model", required=True, help="NAME=DIR, served as NAME")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree (default 3)")
    parser.add_argument("--min-prompts", type=int, default=64, help="prompts per run: max(this, 4 * c)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/mesh_ab.json")
    args = parser.parse_args(argv)
    trees = dict(spec.split("=", 1) for spec in args.tree)
    if len(trees) != 2:
        parser.error("--tree: give exactly two, LABEL=DIR each")
    name, model_dir = args.model.split("=", 1)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    pair = [tree_server(label, Path(tree).resolve(), name, model_dir) for label, tree in trees.items()]
    runs: list[dict] = []
    for round_index in range(args.rounds):
        for server in pair if round_index % 2 == 0 else pair[::-1]:
            print(f"round {round_index + 1}/{args.rounds}: {server.system}", flush=True)
            with serving(server) as up_s:
                results = bench_runs(
                    args.vllm,
                    f"http://127.0.0.1:{server.port}",
                    name,
                    model_dir,
                    concurrencies,
                    args.min_prompts,
                )
            runs += [
                {
                    "round": round_index + 1,
                    "tree": server.system,
                    "concurrency": c,
                    "up_s": round(up_s, 1),
                    **r,
                }
                for c, r in results.items()
            ]
    first, second = trees
    table = median_table(runs, "tree", list(trees), concurrencies)
    ratios = {
        str(c): {m: round(table[second][str(c)][m] / table[first][str(c)][m], 3) for m in METRICS}
        for c in concurrencies
    }
    report = {
        "command": " ".join(["python -m bench.mesh_ab", *(argv if argv is not None else sys.argv[1:])]),
        "host": host_info(),
        "trees": {label: {"dir": tree, "commit": tree_commit(Path(tree))} for label, tree in trees.items()},
        "model": {"name": name, "dir": model_dir, "dtype": "the worker's default (auto)"},
        "workload": f"vllm bench serve, random 128 in / 64 out, ignore_eos, max({args.min_prompts}, 4*c) prompts",
        "runs": runs,
        "medians": table,
        f"{second}_over_{first}": ratios,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
