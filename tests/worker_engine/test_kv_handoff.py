"""P/D hand-off at engine level: a prefill-only request on one engine, its KV exported,
imported into a second engine as prefix-cache blocks, decoded there; equal to one engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fake_clock import FakeClock
from tests.worker_engine.conftest import hf_greedy, prompts, run_all, tokens
from worker_svc.engine import LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.kv_transfer import KvBlockPayload, KvTransferError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prefill(engine: LLMEngine, transfer_id: str, prompt: list[int]) -> list[int]:
    """Run a prefill-only request to its end; returns its (one) token."""
    engine.add_request(RequestSpec(f"p-{transfer_id}", prompt, PREFILL, transfer_id=transfer_id))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def export(engine: LLMEngine, transfer_id: str, chunk: int = 3) -> list[KvBlockPayload]:
    """Pull a held transfer to its end, a few blocks at a time (releases it)."""
    manifest = engine.kv.begin_export(transfer_id)
    payloads: list[KvBlockPayload] = []
    for start in range(0, len(manifest.block_ids), chunk):
        payloads.extend(engine.kv.read_blocks(manifest, start, chunk))
    engine.kv.end_export(transfer_id, complete=True)
    return payloads


@pytest.mark.parametrize("length", [40, 48, 150])
def test_prefill_export_import_decode_equals_one_engine(
    make_engine: Callable[..., LLMEngine], length: int
) -> None:
    """150 tokens > max_num_batched_tokens=64: the prefill is chunked on P; 48 = 3 full blocks."""
    (prompt,) = prompts(length)
    reference = tokens(run_all(make_engine(), [("r", prompt, GREEDY)])["r"])
    p = make_engine(max_num_batched_tokens=64)
    d = make_engine()
    first = prefill(p, "t1", prompt)
    assert first == reference[:1]
    assert p.block_manager.num_used_blocks() == -(-length // 16), "the prompt's blocks stay pinned"
    payloads = export(p, "t1")
    assert len(payloads) == (length - 1) // 16
    assert p.block_manager.num_used_blocks() == 0, "pull-complete releases the transfer"
    layout = d.kv.layout
    d.kv.import_blocks("imp", layout, prompt, (), payloads)
    assert d.block_manager.num_used_blocks() == len(payloads)
    out, cached = decode_import(d, prompt)
    assert out == reference
    assert cached == len(payloads) * 16, "the imported blocks were prefix-cache hits"
    assert d.block_manager.num_used_blocks() == 0
    assert not d.kv.imports and not p.kv.held


def decode_import(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(RequestSpec("d", prompt, GREEDY, kv_import_id="imp"))
    out: list[int] = []
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
            cached = o.num_cached_tokens
    return out, cached


def test_prefill_side_prefix_hit_exports_the_same_kv(make_engine: Callable[..., LLMEngine]) -> None:
    """A prefill that hits P's own prefix cache exports blocks equal to a cold prefill's."""
    (prompt,) = prompts(70)
    p = make_engine()
    prefill(p, "cold", prompt)
    cold = export(p, "cold")
    prefill(p, "warm", prompt)
    warm = export(p, "warm")
    assert [b.data for b in warm] == [b.data for b in cold]
    assert p.block_manager.num_used_blocks() == 0


def test_layout_mismatch_refused(make_engine: Callable[..., LLMEngine]) -> None:
    (prompt,) = prompts(40)
    p, d = make_engine(), make_engine()
    prefill(p, "t", prompt)
    payloads = export(p, "t")
    for change in ({"dtype": "bfloat16"}, {"block_size": 32}, {"model": "other"}, {"num_layers": 3}):
        layout = dataclasses.replace(d.kv.layout, **change)
        with pytest.raises(KvTransferError) as err:
            d.kv.import_blocks("imp", layout, prompt, (), payloads)
        assert err.value.reason == "layout"
        assert next(iter(change)) in str(err.value)
    d.kv.release_import("imp")
    assert d.block_manager.num_used_blocks() == 0


def test_checksum_and_hash_mismatch_refused(make_engine: Callable[..., LLMEngine]) -> None:
    (prompt,) = prompts(40)
    p, d = make_engine(), make_engine()
    prefill(p, "t", prompt)
    payloads = export(p, "t")
    layout = d.kv.layout
    bad = bytearray(payloads[1].data)
    bad[7] ^= 0x40
    corrupted = [payloads[0], dataclasses.replace(payloads[1], data=bytes(bad))]
    with pytest.raises(KvTransferError) as err:
        d.kv.import_blocks("imp", layout, prompt, (), corrupted)
    assert err.value.reason == "checksum"
    other = [prompt[0] + 1, *prompt[1:]]
    with pytest.raises(KvTransferError) as err:
        d.kv.import_blocks("imp", layout, other, (), payloads)
    assert err.value.reason == "hash"
    with pytest.raises(KvTransferError) as err:
        d.kv.import_blocks("imp", layout, prompt, ("salt",), payloads)
    assert err.value.reason == "hash"
    d.kv.release_import("imp")
    assert d.block_manager.num_used_blocks() == 0 and d.block_manager.num_cached_blocks() == 0


def test_release_during_read_is_deferred_and_ttl_releases(make_engine: Callable[..., LLMEngine]) -> None:
    """No block of a transfer is freed while a pull reads it; an unpulled one expires."""
    (prompt,) = prompts(40)
    p = make_engine(kv_transfer_ttl_s=5.0)
    prefill(p, "t", prompt)
    manifest = p.kv.begin_export("t")
    assert p.kv.release("t")
    assert p.block_manager.num_used_blocks() == 3, "deferred while a reader is active"
    with pytest.raises(KeyError):
        p.kv.begin_export("t")
    p.kv.read_blocks(manifest, 0, 2)
    p.kv.end_export("t", complete=False)
    assert p.block_manager.num_used_blocks() == 0
    p.kv.clock = clock = FakeClock()
    prefill(p, "late", prompt)
    clock.advance(4.9)
    assert p.kv.expire() == 0 and p.block_manager.num_used_blocks() == 3
    clock.advance(0.1)
    assert p.kv.expire() == 1
    assert p.block_manager.num_used_blocks() == 0


def test_aborted_import_and_prefill_free_everything(make_engine: Callable[..., LLMEngine]) -> None:
    (prompt,) = prompts(40)
    p, d = make_engine(), make_engine()
    p.add_request(RequestSpec("p", prompt, PREFILL, transfer_id="t"))
    p.abort_request("p")
    p.step()
    assert not p.kv.held and p.block_manager.num_used_blocks() == 0
    prefill(p, "t2", prompt)
    payloads = export(p, "t2")
    d.kv.import_blocks("imp", d.kv.layout, prompt, (), payloads)
    d.add_request(RequestSpec("d", prompt, GREEDY, kv_import_id="imp"))
    d.abort_request("d")
    d.step()
    assert d.block_manager.num_used_blocks() == 0


def test_prefill_only_request_is_validated(make_engine: Callable[..., LLMEngine]) -> None:
    (prompt,) = prompts(20)
    engine = make_engine()
    with pytest.raises(ValueError, match="max_tokens=1"):
        engine.add_request(RequestSpec("x", prompt, GREEDY, transfer_id="t"))
    prefill(engine, "t", prompt)
    with pytest.raises(ValueError, match="already held"):
        engine.add_request(RequestSpec("y", prompt, PREFILL, transfer_id="t"))
    engine.kv.release("t")


def test_blocks_released_during_a_read_are_not_reused_before_it_ends(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """4 blocks: the held prompt takes 3; another prompt can run only on them. Released while
    a reader is between two blocks, they must not be reused (and overwritten) before the
    read ends: the bytes read equal those of a reference transfer of the same blocks."""
    (prompt, other) = prompts(40, 40)
    engine = make_engine(num_kv_blocks=4)
    prefill(engine, "t", prompt)
    prefill(engine, "ref", prompt)  # shares t's full blocks (prefix hits) + its own tail block
    reference = export(engine, "ref")
    manifest = engine.kv.begin_export("t")
    first = engine.kv.read_blocks(manifest, 0, 1)
    assert engine.kv.release("t")
    engine.add_request(RequestSpec("x", other, PREFILL, transfer_id="x"))
    for _ in range(5):
        engine.step()  # x cannot get blocks while t's are held
    rest = engine.kv.read_blocks(manifest, 1, 10)
    assert [b.data for b in first + rest] == [b.data for b in reference]
    engine.kv.end_export("t", complete=False)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.release("x")


@pytest.mark.parametrize("name", ["Mistral", "Gemma 2"])
def test_sliding_window_model_hand_off_equals_transformers(name: str, tmp_path: Path) -> None:
    """A prompt longer than the sliding window, prefilled in chunks on P, decoded on D from
    the imported blocks: greedy tokens equal transformers' generate."""
    from devtools.arch_matrix import CASES, WINDOW
    from tests.worker_engine.test_arch_matrix import _engine, _save

    case = next(c for c in CASES if c.name == name)
    ref = _save(case, tmp_path)
    (prompt,) = prompts(3 * WINDOW + 5)
    prompt = [t % int(ref.config.vocab_size) for t in prompt]
    p, d = _engine(tmp_path, max_num_batched_tokens=8), _engine(tmp_path)
    prefill(p, "t", prompt)
    payloads = export(p, "t")
    d.kv.import_blocks("imp", d.kv.layout, prompt, (), payloads)
    out, cached = decode_import(d, prompt)
    assert cached == len(payloads) * 4 > WINDOW
    assert out == hf_greedy(ref, prompt, GREEDY.max_tokens)


def test_reserved_import_has_its_room_before_the_prefill_runs(make_engine: Callable[..., LLMEngine]) -> None:
    """A decode engine reserves the prompt's blocks first (its cached ones pinned, empty
    ones for the rest); without the room it refuses ("import") before any prefill runs
    elsewhere, holding nothing. Reserved, the import fills them and decodes as one engine."""
    (prompt, other) = prompts(70, 40)
    reference = tokens(run_all(make_engine(), [("r", prompt, GREEDY)])["r"])
    d = make_engine(num_kv_blocks=6)
    prefill(d, "mine", other)  # 3 blocks held (pinned) for a transfer of another prompt
    with pytest.raises(KvTransferError) as err:
        d.kv.reserve_import("imp", prompt, ())  # 4 full blocks needed, 3 free
    assert err.value.reason == "import"
    assert d.block_manager.num_used_blocks() == 3 and "imp" not in d.kv.imports
    d.kv.release("mine")
    assert d.kv.reserve_import("imp", prompt, ()) == 4
    assert d.block_manager.num_used_blocks() == 4, "the room is taken before any KV arrived"
    p = make_engine()
    prefill(p, "t", prompt)
    d.kv.import_blocks("imp", d.kv.layout, prompt, (), export(p, "t"))
    assert d.block_manager.num_used_blocks() == 4, "the KV went into the reserved blocks"
    out, cached = decode_import(d, prompt)
    assert out == reference and cached == 64
    assert d.block_manager.num_used_blocks() == 0 and not d.kv.imports


def test_a_reservation_reuses_cached_blocks_and_releases_whole(make_engine: Callable[..., LLMEngine]) -> None:
    (prompt,) = prompts(70)
    d = make_engine()
    run_all(d, [("warm", prompt[:40], SamplingParams(max_tokens=1))])  # 2 blocks of the prompt cached
    free = d.block_manager.num_free_blocks()
    assert d.kv.reserve_import("imp", prompt, ()) == 4
    entry = d.kv.imports["imp"]
    assert sorted(entry.cached) == [0, 1] and len(entry.empty) == 2
    assert d.block_manager.num_free_blocks() == free - 4
    d.kv.release_import("imp")  # abandoned before its KV came
    assert d.block_manager.num_free_blocks() == free and d.block_manager.num_used_blocks() == 0
    assert d.block_manager.num_cached_blocks() == 2, "the cached blocks stay findable"


def test_engine_reports_its_prompt_queue_and_prefill_rate(make_engine: Callable[..., LLMEngine]) -> None:
    (first, second) = prompts(150, 40)
    engine = make_engine(max_num_batched_tokens=64)
    assert engine.stats().prefill_tokens_per_s == 0.0
    engine.add_request(RequestSpec("a", first, GREEDY))
    engine.add_request(RequestSpec("b", second, GREEDY))
    assert engine.stats().queued_prompt_tokens == 190, "both prompts wait"
    engine.step()  # 64 of the first prompt
    assert engine.stats().queued_prompt_tokens == 190 - 64
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.queued_prompt_tokens == 0 and stats.prefill_tokens_per_s > 0.0


def test_the_prefill_rate_is_measured_on_long_prompts_only(make_engine: Callable[..., LLMEngine]) -> None:
    """Short prompts (a quarter of the step budget at most) leave the prefill rate
    unmeasured: it prices long prompts, which attend over more context."""
    from worker_svc.engine.scheduler import SHORT_PROMPT_SHARE

    engine = make_engine(max_num_batched_tokens=64)
    short, long = prompts(64 // SHORT_PROMPT_SHARE, 64 // SHORT_PROMPT_SHARE + 1, seed=41)
    engine.add_request(RequestSpec("short", short, GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().prefill_tokens_per_s == 0.0
    engine.add_request(RequestSpec("long", long, GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().prefill_tokens_per_s > 0.0
