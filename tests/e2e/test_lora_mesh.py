"""Multi-LoRA end to end: real processes (2 decoders with 2 adapter slots each, scheduler,
tokenizer, gateway), real Redis, the official `openai` client. Adapters are named as the
request's `model` (vLLM's convention); their greedy output, with base and adapter requests
mixed in the same engine steps, equals PEFT's `generate` token for token. Admin-only
load/unload endpoints; errors in OpenAI's shape."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from launcher.mesh import Mesh
from services.ports import free_port
from services.redis_client import RedisServer
from tests.lora_kit import base_model, build_adapters, greedy, peft_greedy
from tests.mesh import metric_value, running_mesh

pytestmark = pytest.mark.timeout(600)

ADMIN, USER = "admin-key", "user-key"
MAX_TOKENS = 8
PROMPTS = [[(31 * i + 7 * j) % 900 + 20 for j in range(6 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def peaked_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model's shape and tokenizer with wider random weights (initializer_range
    0.1): peaked logits, so no greedy near-tie flips between batch shapes."""
    out = tmp_path_factory.mktemp("peaked") / "peaked-llama"
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def adapters(peaked_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_adapters(peaked_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lora_mesh(
    peaked_model: Path,
    adapters: dict[str, str],
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    with running_mesh(
        tmp_path_factory.mktemp("mesh"),
        timeout=240,
        model_dir=str(peaked_model),
        num_decoders=2,
        redis_url=redis_server.url,
        kv_cache_memory_mb=32,
        embedding_model_dir="",
        api_keys=USER,
        admin_api_keys=ADMIN,
        lora_modules=f"ad-all={adapters['ad-all']},ad-attn={adapters['ad-attn']}",
        max_loras=2,
        enable_lora_updating=True,
        metrics_ports=(("scheduler", free_port()),),
    ) as started:
        yield started


def _client(lora_mesh: Mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_mesh.gateway_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[str]:
    """The completion's tokens, as strings (logprobs)."""
    reply = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return logprobs.tokens


def _post(lora_mesh: Mesh, path: str, key: str, body: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{lora_mesh.gateway_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def test_adapters_served_like_peft_in_mixed_batches(
    lora_mesh: Mesh, peaked_model: Path, adapters: dict[str, str], tmp_path: Path
) -> None:
    client, base = _client(lora_mesh, USER), peaked_model.name
    cards = {m.id: m for m in client.models.list().data}
    assert {"ad-all", "ad-attn"} <= set(cards)
    assert getattr(cards["ad-all"], "parent", None) == base and getattr(cards[base], "parent", None) is None

    # The third adapter: admin only; a broken directory is refused naming it, nothing changes.
    body = {"lora_name": "ad-mlp", "lora_path": adapters["ad-mlp"]}
    assert _post(lora_mesh, "/v1/load_lora_adapter", USER, body).status_code == 403
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    refused = _post(lora_mesh, "/v1/load_lora_adapter", ADMIN, {"lora_name": "bad", "lora_path": str(broken)})
    assert refused.status_code == 400 and "'bad'" in refused.json()["error"]["message"], refused.text
    assert "bad" not in {m.id for m in client.models.list().data}
    loaded = _post(lora_mesh, "/v1/load_lora_adapter", ADMIN, body)
    assert loaded.status_code == 200, loaded.text

    with pytest.raises(openai.NotFoundError, match="nope"):
        _complete(client, "nope", PROMPTS[0])

    names = [base, "ad-all", "ad-attn", "ad-mlp", base, "ad-all"]
    jobs = [(name, prompt) for name, prompt in zip(names, PROMPTS, strict=True)] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(client, *job), jobs))
    reference = base_model(peaked_model)
    tokenizer = AutoTokenizer.from_pretrained(peaked_model)
    for (name, prompt), tokens in zip(jobs, got, strict=True):
        if name == base:
            want = greedy(reference, prompt, MAX_TOKENS)
        else:
            want = peft_greedy(peaked_model, adapters[name], prompt, MAX_TOKENS)
            assert want != greedy(reference, prompt, MAX_TOKENS)
        assert tokens == [tokenizer.decode([t]) for t in want], name
    port = dict(lora_mesh.config.metrics_ports)["scheduler"]
    assert (
        metric_value(port, "meshserve_scheduler_adapter_routes_total", adapter="ad-mlp", resident="true") > 0
    )

    unloaded = _post(lora_mesh, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "ad-mlp"})
    assert unloaded.status_code == 200, unloaded.text
    gone = _post(lora_mesh, "/v1/unload_lora_adapter", ADMIN, {"lora_name": "ad-mlp"})
    assert gone.status_code == 404 and "ad-mlp" in gone.json()["error"]["message"]
