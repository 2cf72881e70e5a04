"""Block hashes of a request with images: the scheduler's (`routing_request` on the
GenerateRequest) equal those the decoder's engine publishes as KV events when it runs the
request the way the worker servicer hands it over (`request_extra_keys(cache_salt)` plus
the images as `MultiModalInput` in request order) -- with the items out of offset order
and the same image twice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshserve.v1 import common_pb2
from scheduler_svc.route import routing_request
from services.kv_contract import request_extra_keys
from services.kv_hash import block_hashes
from worker_svc.engine import EngineConfig, KvEvent, LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.multimodal import MultiModalInput

BLOCK = 8
IMAGE = 8  # placeholder tokens per image
# (identifier, offset) as the request lists them: not in prompt order, img-b twice.
ITEMS = (("img-b", 30), ("img-a", 5), ("img-b", 50))
PROMPT = [(7 * i) % 90 + 3 for i in range(8 * BLOCK + 3)]  # 8 full blocks + 3 tokens


def engine_hashes(
    engine: LLMEngine, events: list[KvEvent], request_id: str, salt: str, mm: list[MultiModalInput]
) -> list[int]:
    """The blocks the engine publishes as stored when it runs the request."""
    events.clear()
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request(
        RequestSpec(request_id, PROMPT, params, extra_keys=request_extra_keys(salt), mm_inputs=mm)
    )
    while engine.has_unfinished():
        engine.step()
    assert {e.kind for e in events} == {"stored"}
    return [h for e in events for h in e.block_hashes]


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_scheduler_and_engine_hash_images_alike(vlm_dir: Path, salt: str) -> None:
    torch.set_num_threads(1)
    events: list[KvEvent] = []
    engine = LLMEngine(
        EngineConfig(model_dir=str(vlm_dir), num_kv_blocks=64, block_size=BLOCK, compile_model=False),
        events.extend,
    )
    hidden = engine.model_info.hidden_size
    embeddings = {name: torch.randn(IMAGE, hidden) for name in ("img-a", "img-b")}
    request = common_pb2.GenerateRequest(
        model="m",
        prompt_token_ids=PROMPT,
        cache_salt=salt,
        mm_items=[
            common_pb2.MultiModalItem(identifier=name, modality="image", offset=offset, length=IMAGE)
            for name, offset in ITEMS
        ],
    )
    keys = routing_request(request).extra_keys
    assert keys == (*((f"salt:{salt}",) if salt else ()), "mm:img-a", "mm:img-b")
    expected = block_hashes(PROMPT, BLOCK, keys)
    assert len(expected) == 8
    mm = [MultiModalInput(name, offset, IMAGE, embeddings[name]) for name, offset in ITEMS]
    assert engine_hashes(engine, events, "r1", salt, mm) == expected
    # The images matter: the same tokens without them hash differently.
    text = common_pb2.GenerateRequest(model="m", prompt_token_ids=PROMPT, cache_salt=salt)
    assert not set(block_hashes(PROMPT, BLOCK, routing_request(text).extra_keys)) & set(expected)
    # The items in prompt order (and the repeated image named once) key the blocks alike:
    # the engine finds the whole prefix cached instead of storing new blocks.
    reordered = sorted(mm, key=lambda m: m.offset)
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request(
        RequestSpec("r2", PROMPT, params, extra_keys=request_extra_keys(salt), mm_inputs=reordered)
    )
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 8 * BLOCK
    assert engine.block_manager.num_used_blocks() == 0
