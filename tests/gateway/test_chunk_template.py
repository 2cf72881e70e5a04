"""The text-chunk template of the streaming hot path renders exactly the bytes the chunk
model would (`sse_event`), for texts that exercise JSON escaping."""

from __future__ import annotations

import json

import pytest

from gateway.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
)
from gateway.sse import TextChunkTemplate, sse_event

TEXTS = [
    " hello",
    'quote " and \\ backslash',
    "new\nline\ttab\r",
    "ünïcödé 漢字 🙂",
    "\x00\x1f\x7f",
    "</script>",
    "next\x85line \u2028sep\u2029para",
    "",
]


def _chat(text: str) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=1, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None)
    return ChatCompletionChunk(id="chatcmpl-x", created=7, model="m/\u00e9", choices=[choice])


def _completion(text: str) -> CompletionChunk:
    choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=None)
    return CompletionChunk(id="cmpl-x", created=7, model="m", choices=[choice])


@pytest.mark.parametrize("make", [_chat, _completion])
def test_template_renders_the_model_bytes(make: object) -> None:
    template = TextChunkTemplate(make)  # type: ignore[arg-type]
    for text in TEXTS:
        rendered = template.render(text)
        assert rendered == sse_event(make(text))  # type: ignore[operator]
        assert rendered.startswith(b"data: ") and rendered.endswith(b"\n\n")
        payload = json.loads(rendered[6:])
        assert payload["object"] in ("chat.completion.chunk", "text_completion")
        choice = payload["choices"][0]
        assert choice.get("text", choice.get("delta", {}).get("content")) == text


def test_a_chunk_without_the_text_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextChunkTemplate(lambda text: _completion("constant"))


@pytest.mark.parametrize("make", [_chat, _completion])
def test_every_event_is_one_line_for_a_splitlines_reader(make: object) -> None:
    """U+0085, U+2028 and U+2029 are legal unescaped in JSON but are line ends to
    str.splitlines readers (httpx's aiter_lines): the event escapes them, whichever
    path builds it, and the client still reads the same text."""
    template = TextChunkTemplate(make)  # type: ignore[arg-type]
    for text in ("\x85", "a\u2028b", "\u2029z", "x\x85\u2028\u2029y"):
        for event in (template.render(text), sse_event(make(text))):  # type: ignore[operator]
            assert event.endswith(b"\n\n"), event
            lines = event[:-2].decode().splitlines()
            assert len(lines) == 1 and lines[0].startswith("data: "), event
            choice = json.loads(lines[0][6:])["choices"][0]
            assert choice.get("text", choice.get("delta", {}).get("content")) == text
