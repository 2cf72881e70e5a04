"""echo with logprobs and max_tokens 0, and vLLM's prompt_logprobs, through the gateway
(fake worker: every prompt token after the first scored -0.5, rank 1): choice indices of
several prompts x n, streamed and not, the answer's shape and usage."""

from __future__ import annotations

from typing import Any

import openai
from gateway_fakes import MODEL, decode

PROMPTS = [[104, 105, 106], [107, 108]]


def test_echo_only_returns_each_prompt_with_its_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, echo=True, logprobs=1, max_tokens=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        ids = PROMPTS[choice.index // 2]
        assert choice.text == decode(ids, False) and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and lp.tokens == [decode([t], False) for t in ids]
        assert lp.token_logprobs == [None] + [-0.5] * (len(ids) - 1)
        assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_only_streamed(client: openai.OpenAI) -> None:
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, Any] = {}
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, echo=True, logprobs=0, max_tokens=0, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    for index in range(4):
        ids = PROMPTS[index // 2]
        assert texts[index] == decode(ids, False)
        assert tokens[index] == [decode([t], False) for t in ids]
        assert finish[index] == "length"


def test_echo_without_logprobs_streams_the_prompt_then_the_output(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, max_tokens=0)
    assert reply.choices[0].text == decode(PROMPTS[0], False) and reply.choices[0].logprobs is None
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, max_tokens=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == decode(PROMPTS[0], False)


def test_vllm_prompt_logprobs_on_completions_and_chat(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    plp = reply.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert plp[0] is None and len(plp) == len(PROMPTS[0])
    for token, entry in zip(PROMPTS[0][1:], plp[1:], strict=True):
        assert entry == {str(token): {"logprob": -0.5, "rank": 1, "decoded_token": decode([token], False)}}
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None  # type: ignore[index]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_plp = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(chat_plp) == chat.usage.prompt_tokens and chat_plp[0] is None
