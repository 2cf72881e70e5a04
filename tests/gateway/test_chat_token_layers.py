"""How many async layers a chat token passes in the gateway: the worker stream's reader
queues it in its GenerationRun, whose own event generator is what the chat streamer
iterates (no fan-in or buffering generator between them), and the SSE writer iterates
the streamer. The event `peek` took before the response started comes out first."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from gateway_fakes import MODEL

from gateway.generation import ChoiceEvent
from gateway.multi_run import MultiRun


@pytest.mark.parametrize("n", [1, 2])
def test_a_chat_streams_from_the_runs_own_generator(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    sources: list[str] = []
    events = MultiRun.events

    def recording(self: MultiRun) -> AsyncIterator[ChoiceEvent]:
        source = events(self)
        sources.append(source.ag_code.co_qualname)
        return source

    monkeypatch.setattr(MultiRun, "events", recording)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": n}
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    texts = [
        "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i
        )
        for i in range(n)
    ]
    assert sources == ["GenerationRun.events"]
    # Every choice's whole text, its first token (the one `peek` held) included.
    assert all(text.startswith("Hello from choice") for text in texts), texts
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]].count(
        "stop"
    ) == n
