"""Prompt logprobs through the whole mesh with the official `openai` client: `echo` with
`logprobs` (and `max_tokens: 0`, lm-evaluation-harness's loglikelihood request) and vLLM's
`prompt_logprobs`, against transformers' log-softmax of the prompt (fp32). The decoder
prefills at most 16 tokens per step, so every prompt here spans several chunks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.mesh import E2E_CHUNK, RunningMesh

CHUNK = E2E_CHUNK  # prompts longer than two chunks are scored across chunks
TOL = 1e-4


@pytest.fixture(scope="module")
def client(e2e_mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=e2e_mesh.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(model_dir: Path) -> str:
    return model_dir.name


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """transformers' fp32 log-softmax of every position of a prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return log_softmax


def _prompt(tokenizer: Any, repeats: int = 5) -> list[int]:
    ids: list[int] = tokenizer("The quick brown fox jumps over the lazy dog. " * repeats).input_ids
    assert len(ids) > 2 * CHUNK
    return ids


def _check_echo(
    choice: Any, ids: list[int], ref: torch.Tensor, tokenizer: Any, top: int, generated: int
) -> None:
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + generated
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for j in range(1, len(ids)):
        row = ref[j - 1]
        assert math.isclose(lp.token_logprobs[j], row[ids[j]].item(), abs_tol=TOL), f"token {j}"
        expected = {tokenizer.decode([t]) for t in row.topk(top).indices.tolist()} | {lp.tokens[j]}
        assert set(lp.top_logprobs[j]) == expected, f"top-{top} of token {j}"
        assert math.isclose(max(lp.top_logprobs[j].values()), row.max().item(), abs_tol=TOL)


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(
    client: openai.OpenAI, model_name: str, tokenizer: Any, reference: Any
) -> None:
    """lm-evaluation-harness's loglikelihood request, cold and after a prefix-cache hit."""
    ids = _prompt(tokenizer)
    ref = reference(ids)
    warm = client.completions.create(model=model_name, prompt=ids, max_tokens=1)  # caches the prefix
    assert warm.usage is not None
    for _ in range(2):
        reply = client.completions.create(model=model_name, prompt=ids, echo=True, logprobs=5, max_tokens=0)
        choice = reply.choices[0]
        assert choice.text == tokenizer.decode(ids)
        assert choice.finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 0
        assert reply.usage.prompt_tokens == len(ids)
        _check_echo(choice, ids, ref, tokenizer, 5, 0)
    again = client.completions.create(model=model_name, prompt=ids, max_tokens=1)
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and (details.cached_tokens or 0) > 0  # the cache was there to hit


def test_echo_logprobs_then_generated_tokens(
    client: openai.OpenAI, model_name: str, tokenizer: Any, reference: Any
) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ids = tokenizer(text).input_ids
    reply = client.completions.create(
        model=model_name,
        prompt=text,
        echo=True,
        logprobs=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.text.startswith(text) and len(choice.text) > len(text)
    _check_echo(choice, ids, reference(ids), tokenizer, 2, 3)
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_echo_logprobs_streamed(
    client: openai.OpenAI, model_name: str, tokenizer: Any, reference: Any
) -> None:
    ids = _prompt(tokenizer, 3)
    stream = client.completions.create(
        model=model_name,
        prompt=ids,
        echo=True,
        logprobs=1,
        max_tokens=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens: list[str] = []
    values: list[float | None] = []
    text = ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens.extend(choice.logprobs.tokens)
                values.extend(choice.logprobs.token_logprobs or [])
    assert text.startswith(tokenizer.decode(ids))
    assert len(tokens) == len(values) == len(ids) + 2
    ref = reference(ids)
    assert values[0] is None
    for j in range(1, len(ids)):
        assert math.isclose(values[j] or 0.0, ref[j - 1, ids[j]].item(), abs_tol=TOL)


def _check_vllm(plp: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        row, token = ref[j - 1], ids[j]
        scored = {int(t): v for t, v in plp[j].items()}
        assert math.isclose(scored[token]["logprob"], row[token].item(), abs_tol=TOL)
        assert scored[token]["rank"] == int((row > row[token]).sum()) + 1
        for rank, t in enumerate(row.topk(k).indices.tolist(), start=1):
            assert scored[t]["rank"] == rank or t == token
            assert math.isclose(scored[t]["logprob"], row[t].item(), abs_tol=TOL)
        assert set(scored) == {token, *row.topk(k).indices.tolist()}


def test_vllm_prompt_logprobs_completions_and_chat(
    client: openai.OpenAI, model_name: str, tokenizer: Any, reference: Any
) -> None:
    ids = _prompt(tokenizer, 4)
    reply = client.completions.create(
        model=model_name, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    choice = reply.choices[0]
    assert choice.logprobs is None
    _check_vllm(choice.model_extra["prompt_logprobs"], ids, reference(ids), 3)

    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3}]
    chat = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=1,
        extra_body={"prompt_logprobs": 2},  # type: ignore[arg-type]
    )
    chat_ids: list[int] = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
    _check_vllm(chat.model_extra["prompt_logprobs"], chat_ids, reference(chat_ids), 2)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 99},
            "prompt_logprobs",
        ),
    ],
)
def test_bad_prompt_logprobs_requests_name_the_field(
    e2e_mesh: RunningMesh, model_name: str, path: str, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(e2e_mesh.gateway_url + path, json={"model": model_name, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
