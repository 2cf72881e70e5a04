"""The GPU readiness kit: every GPU figure of the project in one time-boxed run.

    python -m bench.gpu.kit --profile gpu --out bench/results/gpu.json       # on a GPU host (run.sh)
    python -m bench.gpu.kit --profile cpu-dry-run --out /tmp/gpu.json --inline  # the CPU dry run

Steps (run in STEPS' order, the baselines last; each in a process of its own unless
``--inline``, killed at its time box; a failed, timed-out or skipped step is recorded and
the next one runs; the JSON is rewritten after every step, so a crash leaves what was
measured until then):

* ``build``: the bench model (Llama-3.2-1B's shape in the ``gpu`` profile, random
  weights) and a word-level tokenizer of its vocabulary, in the work directory.
* ``correctness``: greedy tokens of the engine == transformers ``generate`` on tiny random
  Llama, Qwen3 and Gemma 3 (sliding window) models (devtools.arch_matrix), float32; on
  CUDA with the triton attention backend, plain eager and as the CUDA default (the
  compiled forward in CUDA graphs).
* ``roofline``: device-to-device copy bandwidth (bytes read + written per second) and the
  bench model's weight bytes: the floor of one decode step is weights / bandwidth.
* ``decode_attention``: the paged decode kernel alone, one layer, every row at the
  workload's full context, at each concurrency: GPU microseconds per call unsplit and
  split (split-KV), and the largest difference between the two outputs (CUDA only).
* ``engine_graphs`` / ``engine_eager``: the engine in-process (bench.engine_bench's
  closed-loop client) at every concurrency, output tok/s, TPOT and TTFT: as the CUDA
  default (the forward compiled in CUDA graphs; graphs need CUDA: skipped elsewhere) and
  plain eager (neither); per concurrency the steps' count,
  total and median wall time by kind (a graph replay or eager), the GPU's busy time and
  its idle time between steps (waiting for the host) by the kind of step that waited
  (``gpu``); the mesh's concurrency again with top-p sampling, by each of the sampler's
  top-p paths: the nuclei searched on the device (the default), the best candidates after
  a synchronising check, a sort of the vocabulary (``top_p_rows``); and with graphs the
  kernels of one replay of the largest bucket and of one prefill step, and the places
  where a mixed workload's steps synchronise with the GPU (``sync_points``).
* ``mesh``: the whole mesh over loopback (Redis, scheduler, tokenizer, one decoder,
  gateway; bench.engine_bench.bench_mesh) at the profile's mesh concurrency, with the
  cores each process (and the client) kept busy meanwhile; then, while its box allows,
  the same with 4 gateway processes sharing the port.
* ``hf_naive``: transformers ``generate`` one request at a time (c=1).
* ``c1_anatomy``: where a c=1 decode step of the default engine goes (on CUDA the compiled
  forward in CUDA graphs): the step's wall time, the graph replay alone (GPU), the rest
  (host), cProfile's top functions and the kernels one forward launches; then the step,
  replay and tokens with the projections merged the other way (on CUDA: unmerged), and on
  Hopper with inductor's kernels as programmatic dependent launches (``pdl``).
* ``skinny_gemm``: the decode projections at 1 and 8 rows by cuBLAS and by the Triton
  experiment of bench/gpu/skinny_gemm.py, and q/k/v and gate/up merged, by cuBLAS.
* ``prefill_attention``: one layer's attention of an eager step on the triton backend (a
  prefill step, continued chunks, a mixed step), its prompt chunks by one SDPA call each
  and by the one launch the engine makes (triton_attention.paged_prefill_attention).
* ``norm_parity``: the c=1 step and replay with RMSNorm's mean left to inductor (fused)
  against the default's ATen mean kept for bf16 parity with transformers, and the first
  token where the two part: what the parity costs.
* ``top_p_sampler``: the sampler alone on a batch of top-p rows at c=1/64/256, by each of
  its top-p paths (GPU microseconds per call); rows at a temperature alone by the draw
  kernel and by torch's ops; and the rows whose nucleus found on the device differs from
  the sort's.
* ``host_overhead``: the engine's host work per decode step at c=1/64/256 with the forward
  stubbed out (bench.host_overhead), on the device: what a step waits for on the host;
  through the graphs' buffers also with every request penalized.

``summary`` holds the headline ratios: graphs over eager, decode step over the roofline,
served over in-process throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu import env_info
from bench.gpu.context import PROFILES, Profile, Skip, StepContext, write_json

__all__ = ["PROFILES", "STEPS", "Profile", "Skip", "StepContext", "main", "run_kit", "summarize"]

KIT_VERSION = 1


def _steps() -> dict[str, Callable[[StepContext], None]]:
    from bench.gpu import steps

    return {
        "build": steps.build,
        "correctness": steps.correctness,
        "roofline": steps.roofline,
        "decode_attention": steps.decode_attention,
        "engine_graphs": steps.engine_graphs,
        "engine_eager": steps.engine_eager,
        "lora_mix": steps.lora_mix,
        "mesh": steps.mesh,
        "hf_naive": steps.hf_naive,
        "c1_anatomy": steps.c1_anatomy,
        "host_overhead": steps.host_overhead,
        "skinny_gemm": steps.skinny_gemm,
        "prefill_attention": steps.prefill_attention,
        "norm_parity": steps.norm_parity,
        "top_p_sampler": steps.top_p_sampler,
    }


STEPS = (
    "build",
    "correctness",
    "roofline",
    "decode_attention",
    "engine_graphs",
    "c1_anatomy",
    "lora_mix",
    "mesh",
    "skinny_gemm",
    "prefill_attention",
    "norm_parity",
    "top_p_sampler",
    # The last three go first when the budget runs out: host_overhead is measured on the
    # CPU host too (bench/host_overhead.py), the last two are the baselines.
    "host_overhead",
    "engine_eager",
    "hf_naive",
)
# Fault injection for the kit's own test: the named step hangs, as a CUDA fault or a stuck
# collective would, so that its time box is what ends it (a real step's speed varies).
HANG_STEP_ENV = "MESHSERVE_KIT_HANG_STEP"


def run_step_here(name: str, ctx: StepContext) -> dict[str, Any]:
    """Runs one step in this process; its record with status ok / skipped / failed."""
    start = time.monotonic()
    if os.environ.get(HANG_STEP_ENV) == name:
        time.sleep(3600)
    try:
        _steps()[name](ctx)
        status: dict[str, Any] = {"status": "ok"}
    except Skip as exc:
        status = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # one step's failure must not end the kit
        status = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    return {**ctx.data, **status, "seconds": round(time.monotonic() - start, 2)}


def run_step_isolated(name: str, ctx: StepContext, log_dir: Path) -> dict[str, Any]:
    """Runs one step in a child process killed at ``ctx.deadline`` (a CUDA fault or a hang
    ends that step only); its record as the child left it, or timeout / failed."""
    part = ctx.work / "parts" / f"{name}.json"
    part.unlink(missing_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "bench.gpu.kit", "--profile", ctx.profile.name, "--work", str(ctx.work)]
    cmd += ["--step", name, "--part", str(part), "--deadline", str(ctx.deadline)]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(1.0, ctx.left_s() + 5))
            status: dict[str, Any] = {}
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the step's own process group: its children (the mesh) too
            proc.wait()
            status = {"status": "timeout", "error": f"killed at its time box ({ctx.profile.step_s[name]} s)"}
    record = json.loads(part.read_text()) if part.exists() else {}
    finished = record.get("status") not in (None, "running")
    if status and finished:  # it had its result but did not exit (a thread left running)
        status = {"note": "killed after writing its result: " + status["error"]}
    elif not status and not finished:
        status = {"status": "failed", "error": f"exit code {proc.returncode}, no result"}
    record.update(status)
    if record["status"] not in ("ok", "skipped"):
        record["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


def run_kit(
    profile: Profile, work: Path, out: Path, steps: Sequence[str] = STEPS, inline: bool = False
) -> dict[str, Any]:
    """Runs ``steps`` within the profile's budget, rewriting ``out`` after each."""
    begin = time.time()
    report: dict[str, Any] = {
        "kit_version": KIT_VERSION,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(begin)),
        "env": env_info.collect(),
        "profile": asdict(profile),
        "steps": {},
    }
    log_dir = out.parent / (out.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in steps:
        left = begin + profile.budget_s - time.time()
        box = min(profile.step_s[name], left)
        if box < min(20.0, profile.step_s[name]):
            report["steps"][name] = {"status": "skipped", "reason": f"kit budget spent ({left:.0f} s left)"}
        else:
            ctx = StepContext(profile, work, deadline=time.time() + box)
            record = run_step_here(name, ctx) if inline else run_step_isolated(name, ctx, log_dir)
            report["steps"][name] = record
        print(f"kit: {name}: {report['steps'][name]['status']}", flush=True)
        report["summary"] = summarize(report["steps"], profile)
        report["wall_s"] = round(time.time() - begin, 1)
        write_json(out, report)
    return report


def _ok(steps: dict[str, Any], name: str) -> dict[str, Any]:
    step = steps.get(name, {})
    return step if step.get("status") == "ok" else {}


def summarize(steps: dict[str, Any], profile: Profile) -> dict[str, Any]:
    """Headline figures from the steps that ran (absent where a step did not)."""
    out: dict[str, Any] = {}
    graphs, eager = _ok(steps, "engine_graphs"), _ok(steps, "engine_eager")
    best = graphs or eager
    corr = _ok(steps, "correctness")
    if corr:
        out["correctness_all_match"] = corr.get("all_match")
    roof = _ok(steps, "roofline")
    for label, run in (("graphs", graphs), ("eager", eager)):
        rows = {r["concurrency"]: r for r in run.get("rows", [])}
        if 1 in rows and roof and rows[1]["tpot_ms"]:
            out[f"c1_tpot_over_roofline_{label}"] = rows[1]["tpot_ms"]["p50"] / roof["decode_floor_ms"]
    if graphs:  # a failed capture leaves the engine eager: its rows are then no graph figures
        out["graphs_captured"] = "buckets" in graphs.get("cuda_graphs", {})
    sync = graphs.get("row_sync_scheduling")
    top = max(graphs.get("rows", []), key=lambda r: r["concurrency"], default=None)
    if sync and top and sync["output_tok_per_s"]:
        out["async_over_sync_scheduling_tok_s"] = top["output_tok_per_s"] / sync["output_tok_per_s"]
    if graphs and eager:
        g = {r["concurrency"]: r["output_tok_per_s"] for r in graphs.get("rows", [])}
        e = {r["concurrency"]: r["output_tok_per_s"] for r in eager.get("rows", [])}
        out["graphs_over_eager_tok_s"] = {c: g[c] / e[c] for c in g if e.get(c)}
    lora = _ok(steps, "lora_mix")
    base = {r["concurrency"]: r["output_tok_per_s"] for r in best.get("rows", [])}
    if lora.get("mix") and base.get(profile.mesh_concurrency):
        out["lora_mix_over_base_tok_s"] = lora["mix"]["output_tok_per_s"] / base[profile.mesh_concurrency]
        out["lora_mix_tokens_equal_eager"] = lora.get("mix_tokens_equal_eager")
    mesh = _ok(steps, "mesh")
    inproc = {r["concurrency"]: r for r in best.get("rows", [])}
    c = profile.mesh_concurrency
    if mesh and c in inproc and inproc[c]["output_tok_per_s"]:
        out["served_over_in_process_tok_s"] = mesh["row"]["output_tok_per_s"] / inproc[c]["output_tok_per_s"]
        out["served_ttft_ms"] = {k: mesh["row"]["ttft_ms"].get(k) for k in ("p50", "p99")}
        # A front-end process near 1.0 is the ceiling: one core's worth of Python per token.
        out["served_process_cores"] = mesh["row"].get("process_cores")
        more = mesh.get("row_more_gateways")
        if more:
            out["served_more_gateways_over_in_process_tok_s"] = (
                more["output_tok_per_s"] / inproc[c]["output_tok_per_s"]
            )
    top_p = graphs.get("top_p_rows", {})
    for path in ("device", "sort"):  # above 1: the path beats the candidates' synchronising check
        if path in top_p and "candidates" in top_p:
            out[f"top_p_{path}_over_candidates_tok_s"] = (
                top_p[path]["output_tok_per_s"] / top_p["candidates"]["output_tok_per_s"]
            )
    sampler = _ok(steps, "top_p_sampler").get("rows", {})
    if sampler:
        out["top_p_sampler_us"] = {
            c: {k: v for k, v in row.items() if k.endswith("_us")} for c, row in sampler.items()
        }
        for key in ("rows_differing_from_sort", "draws_outside_nucleus", "plain_draws_differing_from_torch"):
            out[f"top_p_sampler_{key}"] = sum(row.get(key, 0) for row in sampler.values())
    if graphs.get("c1_tokens") and eager.get("c1_tokens"):
        out["c1_tokens_graphs_equal_eager"] = graphs["c1_tokens"] == eager["c1_tokens"]
    naive = _ok(steps, "hf_naive")
    if naive.get("c1_tokens") and best.get("c1_tokens"):
        # Informational: random bf16 weights have near-tied logits, where kernels may part ways.
        out["c1_first_diff_vs_hf_naive"] = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
            for x, y in zip(best["c1_tokens"], naive["c1_tokens"], strict=False)
        ]
    anatomy = _ok(steps, "c1_anatomy")
    for label, variant in anatomy.get("variants", {}).items():
        for key in ("decode_step_ms_p50", "graph_replay_ms", "host_ms_per_step", "tokens_equal_default"):
            if variant.get(key) is not None:
                out.setdefault(f"c1_{label}", {})[key] = variant[key]
    parity = _ok(steps, "norm_parity")
    if "inductor_mean" in parity and "aten_mean" in parity:  # what bf16 parity costs at c=1
        out["c1_norm_parity"] = {
            "replay_ms_inductor_mean": parity["inductor_mean"]["graph_replay_ms"],
            "replay_ms_aten_mean": parity["aten_mean"]["graph_replay_ms"],
            "first_diff": parity.get("first_diff"),
        }
    skinny = _ok(steps, "skinny_gemm").get("shapes", {}).get("rows_1", {})
    if all(name in skinny for name in ("q_or_o", "k_or_v", "gate_or_up", "down")):
        # One layer's seven projections at c=1: q, k, v, o, gate, up, down.
        count = {"q_or_o": 2, "k_or_v": 2, "gate_or_up": 2, "down": 1}
        out["c1_layer_projections_us"] = {
            "cublas": sum(skinny[name]["cublas_us"] * n for name, n in count.items()),
            "best_of_both": sum(
                min(skinny[name]["cublas_us"], skinny[name].get("best_us", math.inf)) * n
                for name, n in count.items()
            ),
        }
        if "qkv_merged" in skinny and "gate_up_merged" in skinny:  # q/k/v and gate/up as one GEMM each
            out["c1_layer_projections_us"]["cublas_merged"] = sum(
                skinny[name]["cublas_us"] for name in ("qkv_merged", "q_or_o", "gate_up_merged", "down")
            )
    prefill = _ok(steps, "prefill_attention").get("rows", {})
    if prefill:  # above 1: the one launch is faster than an SDPA call per chunk
        out["prefill_attention_per_chunk_over_one_launch"] = {
            name: row["per_chunk_us"] / row["one_launch_us"] for name, row in prefill.items()
        }
    host = _ok(steps, "host_overhead")
    if host:
        out["host_ms_per_step"] = {k: v for k, v in host.items() if k.endswith("_host_ms_per_step")}
    if naive and 1 in inproc:
        out["c1_engine_over_hf_naive_tok_s"] = (
            inproc[1]["output_tok_per_s"] / naive["row"]["output_tok_per_s"]
        )
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    p.add_argument("--out", default="bench/results/gpu.json")
    p.add_argument("--work", default="", help="models and step files (default: a fresh temp dir)")
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset, in kit order")
    p.add_argument("--inline", action="store_true", help="run the steps in this process (no isolation)")
    # Internal: one step in a child process (run_step_isolated).
    p.add_argument("--step", default="", help=argparse.SUPPRESS)
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    profile = PROFILES[args.profile]
    work = Path(args.work or tempfile.mkdtemp(prefix="meshserve-gpu-kit-"))
    if args.step:
        ctx = StepContext(profile, work, args.deadline, Path(args.part))
        record = run_step_here(args.step, ctx)
        write_json(Path(args.part), record)
        if "traceback" in record:
            print(record["traceback"], file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Now, without waiting for threads a failed step may have left running (engine, mesh).
        os._exit(0 if record["status"] in ("ok", "skipped") else 1)
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        raise SystemExit(f"--steps: unknown {unknown}; known: {', '.join(STEPS)}")
    chosen = [s for s in STEPS if s in args.steps.split(",")]
    report = run_kit(profile, work, Path(args.out), chosen, args.inline)
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
