"""Multi-LoRA in the engine: PEFT adapters built at test time (non-zero, random), served
batched -- base and adapter requests in the same steps -- token for token like PEFT's own
``generate`` (adapter applied, not merged); slots, CPU LRU and refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.lora_kit import build_adapters, peft_greedy
from tests.worker_engine.conftest import hf_greedy, prompts, tokens
from worker_svc.engine import EngineConfig, LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.lora import LoraError, UnknownLoraError

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(engine_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_adapters(engine_model_dir, tmp_path_factory.mktemp("loras"))


def _run(engine: LLMEngine, reqs: list[tuple[str, list[int], str]]) -> dict[str, list[int]]:
    for rid, prompt, lora in reqs:
        engine.add_request(RequestSpec(rid, prompt, GREEDY, lora_name=lora))
    outs: dict[str, list[Any]] = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {rid: tokens(o) for rid, o in outs.items()}


# The CPU default (separate projections) and CUDA's (merged: adapters on the merged parts).
MERGE = pytest.mark.parametrize("merge", ["auto", "on"], ids=["cpu-default", "merged"])


@MERGE
def test_mixed_batch_matches_peft_generate(
    make_engine: Factory,
    engine_model_dir: str,
    adapter_dirs: dict[str, str],
    hf_model: LlamaForCausalLM,
    merge: str,
) -> None:
    engine = make_engine(
        max_loras=3, lora_modules=tuple(f"{n}={p}" for n, p in adapter_dirs.items()), merge_projections=merge
    )
    assert bool(engine.runner.merged) == (merge == "on")
    ps = prompts(7, 19, 33, 12, 26)
    names = ["", *adapter_dirs, "ad-all"]
    reqs = [(f"r{i}", p, name) for i, (p, name) in enumerate(zip(ps, names, strict=True))]
    got = _run(engine, reqs)
    assert engine.stats().num_steps <= GREEDY.max_tokens + 1  # all five ran in the same steps
    for rid, prompt, name in reqs:
        want = hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        if name:
            base = want
            want = peft_greedy(engine_model_dir, adapter_dirs[name], prompt, GREEDY.max_tokens)
            assert want != base, f"adapter {name} does not change {rid}'s output: the test proves nothing"
        assert got[rid] == want, f"{rid} under {name or 'the base model'}"


def test_padded_bf16_steps_match_unpadded(make_engine: Factory, adapter_dirs: dict[str, str]) -> None:
    """CPU bf16 steps are padded to step sizes (test_step_sizes): padding rows run under no
    adapter, and base and adapter requests batched together answer as unpadded."""
    modules = tuple(f"{n}={p}" for n, p in adapter_dirs.items())
    ps = prompts(7, 19, 33, 12, seed=9)
    reqs = [(f"r{i}", p, name) for i, (p, name) in enumerate(zip(ps, ["", *adapter_dirs], strict=True))]
    padded = make_engine(dtype="bfloat16", max_loras=3, lora_modules=modules)
    plain = make_engine(dtype="bfloat16", max_loras=3, lora_modules=modules)
    plain.runner.step_sizes = ()
    assert padded.runner.step_sizes, "bf16 on CPU pads its steps"
    assert _run(padded, reqs) == _run(plain, reqs)


def test_slots_evict_and_cpu_lru_reloads(make_engine: Factory, adapter_dirs: dict[str, str]) -> None:
    """One slot, a CPU LRU of one: three adapters take turns (requests of an adapter
    without a slot wait), are evicted and read again, and still answer as alone."""
    solo = make_engine(max_loras=3, lora_modules=tuple(f"{n}={p}" for n, p in adapter_dirs.items()))
    ps = prompts(9, 14, 21, seed=5)
    reqs = [(f"r{i}", p, name) for i, (p, name) in enumerate(zip(ps, adapter_dirs, strict=True))]
    want = _run(solo, reqs)
    engine = make_engine(max_loras=1, max_cpu_loras=1)
    for name, path in adapter_dirs.items():
        engine.load_lora(name, path)
    lora = engine.lora
    assert lora is not None and lora.cpu_cached() == ["ad-mlp"]
    assert _run(engine, reqs) == want
    assert lora.num_loads == 3 and lora.num_evictions == 2
    assert lora.resident() == ["ad-mlp"]


def test_adapter_isolated_in_prefix_cache(make_engine: Factory, adapter_dirs: dict[str, str]) -> None:
    engine = make_engine(
        max_loras=2, lora_modules=(f"a={adapter_dirs['ad-all']}", f"b={adapter_dirs['ad-mlp']}")
    )
    prompt = prompts(40, seed=7)[0]
    _run(engine, [("base", prompt, "")])
    # The same prompt under an adapter finds none of the base's (or another adapter's)
    # blocks, then its own.
    for rid, lora, cached in (("a1", "a", 0), ("b1", "b", 0), ("a2", "a", 32), ("b2", "b", 32)):
        engine.add_request(RequestSpec(rid, prompt, GREEDY, lora_name=lora))
        engine.step()
        assert engine.requests[rid].num_cached_tokens == cached, rid
        while engine.has_unfinished():
            engine.step()


def test_unknown_and_unfit_adapters_refused(
    make_engine: Factory, adapter_dirs: dict[str, str], tmp_path: Path
) -> None:
    engine = make_engine(max_loras=1, max_lora_rank=4)
    with pytest.raises(UnknownLoraError, match="nope"):
        engine.add_request(RequestSpec("x", [5, 6, 7], GREEDY, lora_name="nope"))
    with pytest.raises(LoraError, match=r"'big'.*rank 8 exceeds max_lora_rank=4"):
        engine.load_lora("big", adapter_dirs["ad-attn"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match=r"'bad'.*not valid JSON"):
        engine.load_lora("bad", str(bad))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    cfg = json.loads((Path(adapter_dirs["ad-all"]) / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    src = Path(adapter_dirs["ad-all"]) / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] * 2, tensors[key].shape[1])
    save_file(tensors, wrong / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"'wrong'.*q_proj has A"):
        engine.load_lora("wrong", str(wrong))
    (wrong / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoraError, match="'wrong': cannot read"):
        engine.load_lora("wrong", str(wrong))
    assert engine.lora is not None and engine.lora.cpu_cached() == []
    engine.load_lora("ok", adapter_dirs["ad-all"])
    with pytest.raises(LoraError, match="'ok' is already loaded"):
        engine.load_lora("ok", adapter_dirs["ad-mlp"])
    engine.add_request(RequestSpec("y", [5, 6, 7], GREEDY, lora_name="ok"))
    with pytest.raises(LoraError, match="in use"):
        engine.unload_lora("ok")
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("ok")
    with pytest.raises(UnknownLoraError):
        engine.unload_lora("ok")


def test_lora_config_checked(engine_model_dir: str) -> None:
    with pytest.raises(ValueError, match="needs max_loras"):
        EngineConfig(model_dir=engine_model_dir, lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="not 'name=path'"):
        EngineConfig(model_dir=engine_model_dir, max_loras=1, lora_modules=("a",))
    assert EngineConfig(model_dir=engine_model_dir, max_loras=1, compile_model=True).compiles


@MERGE
def test_compiled_forward_serves_adapters_in_one_graph(
    make_engine: Factory,
    engine_model_dir: str,
    adapter_dirs: dict[str, str],
    hf_model: LlamaForCausalLM,
    merge: str,
) -> None:
    """LoRA on keeps the forward compiled: steps of base rows only, of one adapter and of
    a mix, and an adapter evicted from its slot and loaded again, all run the graph the
    warm-up compiled, token for token like PEFT."""
    from torch._dynamo.utils import counters

    a, b, c = adapter_dirs
    engine = make_engine(
        compile_model=True,
        max_loras=2,
        max_num_batched_tokens=64,
        lora_modules=tuple(f"{n}={p}" for n, p in adapter_dirs.items()),
        merge_projections=merge,
    )
    assert engine.runner.lora is not None and engine.runner.lora.static
    engine.warm_up()
    assert not engine.runner.compile_failed
    graphs = counters["stats"]["unique_graphs"]
    ps = prompts(7, 19, 12, 9, seed=5)
    rounds = [[("", ps[0])], [(a, ps[1])], [("", ps[2]), (b, ps[3]), (a, ps[0])], [(c, ps[1]), (a, ps[2])]]
    for i, batch in enumerate(rounds):  # c's round evicts b: two slots, three adapters
        reqs = [(f"r{i}-{j}", p, name) for j, (name, p) in enumerate(batch)]
        got = _run(engine, reqs)
        for rid, prompt, name in reqs:
            want = (
                peft_greedy(engine_model_dir, adapter_dirs[name], prompt, GREEDY.max_tokens)
                if name
                else hf_greedy(hf_model, prompt, GREEDY.max_tokens)
            )
            assert got[rid] == want, f"{rid} under {name or 'the base model'}"
    assert engine.lora is not None and engine.lora.num_evictions >= 1
    assert counters["stats"]["unique_graphs"] == graphs, "a LoRA step compiled another graph"


async def test_async_engine_changes_adapters_between_steps(
    engine_model_dir: str, adapter_dirs: dict[str, str]
) -> None:
    """`AsyncLLMEngine.call` runs on the engine thread; its exception reaches the caller;
    a call left when the engine stops fails instead of hanging."""
    from worker_svc.engine import AsyncLLMEngine
    from worker_svc.engine.async_engine import EngineShutdownError

    engine = AsyncLLMEngine(
        EngineConfig(model_dir=engine_model_dir, num_kv_blocks=64, dtype="float32", max_loras=1)
    )
    try:
        await engine.call(lambda e: e.load_lora("a", adapter_dirs["ad-mlp"]))
        with pytest.raises(UnknownLoraError, match="'b'"):
            await engine.call(lambda e: e.unload_lora("b"))
        outs = [o async for o in engine.generate(RequestSpec("r", [5, 6, 7, 8], GREEDY, lora_name="a"))]
        assert outs[-1].finished and outs[-1].num_output_tokens == GREEDY.max_tokens
        snapshot = await engine.call(lambda e: e.stats().lora)
        assert snapshot.loaded == ("a",) and snapshot.resident == ("a",) and snapshot.num_loads == 1
    finally:
        await engine.shutdown()
    with pytest.raises(EngineShutdownError):
        await engine.call(lambda e: None)


def test_waiting_adapter_not_starved_by_a_busy_one(
    make_engine: Factory, adapter_dirs: dict[str, str]
) -> None:
    """One slot, a new request for adapter a every step: a request for b still gets the
    slot (a drains), instead of waiting as long as a's stream goes on."""
    a, b = list(adapter_dirs)[:2]
    engine = make_engine(max_loras=1, lora_modules=(f"{a}={adapter_dirs[a]}", f"{b}={adapter_dirs[b]}"))
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ps = prompts(*([6] * 40), seed=11)
    engine.add_request(RequestSpec("a-0", ps[0], short, lora_name=a))
    engine.step()
    engine.add_request(RequestSpec("b", ps[1], short, lora_name=b))
    for i in range(2, 40):
        engine.add_request(RequestSpec(f"a-{i}", ps[i], short, lora_name=a))
        if any(out.request_id == "b" and out.finished for out in engine.step()):
            break
    else:
        pytest.fail("the request for adapter b never ran while adapter a kept getting requests")
    assert i < 15, f"b waited {i} steps"
    while engine.has_unfinished():
        engine.step()
    lora = engine.lora
    assert lora is not None and lora.num_loads >= 3  # a, then b, then a again


def test_each_row_gets_its_own_adapters_delta() -> None:
    """One projection, rows of two adapters (ranks 2 and 4) and the base model in any
    order: each row gets base + B(A x) * scaling of its own adapter, none for the base rows."""
    from torch import nn

    from worker_svc.engine.lora import LoraAdapter, LoraManager

    torch.manual_seed(0)
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(8, 6, bias=False)
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    base = layer.self_attn.q_proj
    manager = LoraManager(model, max_loras=2, max_rank=4, max_cpu_loras=2)
    adapters = {}
    for name, rank, scaling in (("a", 2, 0.5), ("b", 4, 2.0)):
        weights = {(0, "q_proj"): (torch.randn(rank, 8), torch.randn(6, rank))}
        adapters[name] = LoraAdapter(name, "", rank, scaling, weights)
        manager.paths[name] = ""
        manager.cpu[name] = adapters[name]
    x = torch.randn(1, 7, 8)
    names = ["a", "", "b", "a", "b", "", "a"]

    def expected(row: int) -> torch.Tensor:
        y = base(x[0, row])
        if not names[row]:
            return y
        adapter = adapters[names[row]]
        a, b = adapter.weights[(0, "q_proj")]
        return y + b @ (a @ x[0, row]) * adapter.scaling

    want = torch.stack([expected(i) for i in range(7)])
    with torch.no_grad(), manager.step([(n, 1) for n in names], torch.device("cpu")):
        scattered = layer.self_attn.q_proj(x)[0]
    torch.testing.assert_close(scattered, want)
    order = sorted(range(7), key=lambda i: names[i])
    with torch.no_grad(), manager.step([(names[i], 1) for i in order], torch.device("cpu")):
        grouped = layer.self_attn.q_proj(x[:, order])[0]
    torch.testing.assert_close(grouped, want[order])
    only_a = [i for i in range(7) if names[i] != "b"]
    # A step of slot 1's adapter alone still spans both slots: its products have the shape
    # a compiled forward's have, so eager and compiled steps sum them alike.
    mask = manager.step_rows([(names[i], 1) for i in only_a])
    assert mask is not None and tuple(mask.shape) == (len(only_a), 2 * 4)
    with torch.no_grad(), manager.step([(names[i], 1) for i in only_a], torch.device("cpu")):
        torch.testing.assert_close(layer.self_attn.q_proj(x[:, only_a])[0], want[only_a])
    with torch.no_grad(), manager.step([("", 7)], torch.device("cpu")):
        torch.testing.assert_close(layer.self_attn.q_proj(x)[0], base(x[0]))
