"""Seeded dataset generators of `bench.datasets` and payload building."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import pytest

from bench.datasets import DATASETS, DatasetConfig, Session, Turn, build_dataset, make_png
from bench.serve import RunConfig, build_payload, messages_to_prompt

BASE = DatasetConfig(num_prompts=24, input_len=40, output_len=8, seed=7)


@pytest.mark.parametrize("name", DATASETS)
def test_deterministic_per_seed(name: str) -> None:
    """Same seed → identical sessions; another seed → different ones."""
    cfg = replace(BASE, name=name)
    assert build_dataset(cfg) == build_dataset(cfg)
    assert build_dataset(cfg) != build_dataset(replace(cfg, seed=8))
    assert len(build_dataset(cfg)) == 24


def test_random_lengths() -> None:
    """Word counts equal input_len, or stay within the range ratio."""
    for s in build_dataset(BASE):
        turn = s.turns[0]
        assert isinstance(turn.content, str) and len(turn.content.split()) == 40 == turn.input_len
        assert s.output_len == 8 and s.system is None
    for s in build_dataset(replace(BASE, range_ratio=0.5)):
        assert 20 <= s.turns[0].input_len <= 60 and 4 <= s.output_len <= 12


def test_shared_prefix() -> None:
    """K distinct system prompts shared round-robin, unique suffixes."""
    sessions = build_dataset(replace(BASE, name="shared-prefix", num_prefixes=3, prefix_len=30))
    systems = [s.system for s in sessions]
    assert len(set(systems)) == 3 and all(systems.count(p) == 8 for p in set(systems))
    assert all(p is not None and len(p.split()) == 30 for p in systems)
    assert len({s.turns[0].content for s in sessions}) == 24
    assert all(s.turns[0].input_len == 40 for s in sessions)


def test_multi_turn_shape() -> None:
    """num_turns user turns per conversation."""
    sessions = build_dataset(replace(BASE, name="multi-turn", num_turns=4))
    assert all(len(s.turns) == 4 for s in sessions)


def test_images_repeat_from_a_valid_pool() -> None:
    """Images are valid PNGs from a fixed pool, so they repeat across requests."""
    from PIL import Image

    sessions = build_dataset(replace(BASE, name="images", image_pool=3, image_size=32))
    urls = [s.turns[0].content[1]["image_url"]["url"] for s in sessions]  # type: ignore[index]
    assert 1 < len(set(urls)) <= 3
    png = base64.b64decode(urls[0].split(",", 1)[1])
    with Image.open(io.BytesIO(png)) as img:
        assert img.size == (32, 32) and img.mode == "RGB"
    assert make_png(8, 8, 1) == make_png(8, 8, 1) != make_png(8, 8, 2)


def test_payloads() -> None:
    """Chat keeps messages; completions flattens them; vLLM extensions are set."""
    session = Session(turns=(Turn("hello there", 2),), output_len=5, system="be brief")
    chat = build_payload(
        "m", RunConfig(temperature=0.0, extra_body={"top_k": 1}), session, [], session.turns[0]
    )
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    assert (chat["max_tokens"], chat["ignore_eos"], chat["temperature"], chat["top_k"]) == (5, True, 0.0, 1)
    comp = build_payload("m", RunConfig(endpoint="completions"), session, [], session.turns[0])
    assert comp["prompt"] == "be brief\n\nhello there" and "messages" not in comp
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert (
        messages_to_prompt([*history, {"role": "user", "content": "q2"}])
        == "User: q1\nAssistant: a1\nUser: q2\nAssistant:"
    )
    with pytest.raises(ValueError):
        messages_to_prompt([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
