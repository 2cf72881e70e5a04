"""Async scheduling (``EngineConfig.async_scheduling``): a step whose tokens are drawn on
the device stays in flight while the next one is scheduled and launched, that step's rows
taking their input tokens from the device. On CPU the forward runs on the caller's thread,
so nothing overlaps, but every rule of running ahead runs as it does on CUDA: these tests
turn it on and hold its streams to the synchronous engine's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.worker_engine.conftest import prompts, run_all, tokens
from tests.worker_engine.test_cuda_graphs import call_again
from worker_svc.engine import EngineConfig, EngineStepError, LLMEngine, RequestSpec, SamplingParams
from worker_svc.engine.cuda_graphs import attach

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _watch_rows(engine: LLMEngine) -> dict[str, Any]:
    """Counts the steps launched with another in flight and the rows whose input came from
    it, and records every scheduled chunk's (request id, end)."""
    seen: dict[str, Any] = {"ahead_steps": 0, "late_rows": 0, "ends": []}
    runner, execute = engine.runner, engine.runner.execute

    def watched(batch: Any, ahead: Any = None) -> Any:
        if ahead is not None:
            seen["ahead_steps"] += 1
            seen["late_rows"] += sum(1 for item in batch if item.request in ahead.rows)
        seen["ends"] += [(item.request.request_id, item.end) for item in batch]
        return execute(batch, ahead)

    runner.execute = watched  # type: ignore[method-assign]
    return seen


def _mixed_requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Plain greedy rows beside rows whose sampling reads the host (seeded draws,
    logprobs, a penalty, min_tokens), a long prompt chunked over steps, and one that ends
    exactly at max_model_len."""
    ps = prompts(5, 17, 3, 90, 9, 12, 240, seed=3)
    return [
        ("plain", ps[0], GREEDY),
        ("short", ps[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        ("long", ps[3], GREEDY),
        ("seeded", ps[1], SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)),
        ("logprobs", ps[4], SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)),
        ("penalty", ps[5], SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3)),
        ("to_the_end", ps[6], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
    ]


def _assert_streams_equal(got: dict[str, list[Any]], expected: dict[str, list[Any]]) -> None:
    """Each request's tokens and logprobs as the synchronous engine's, one final output."""
    for rid, outs in expected.items():
        assert tokens(got[rid]) == tokens(outs), rid
        assert [o.new_logprobs for o in got[rid]] == [o.new_logprobs for o in outs], rid
        assert got[rid][-1].finished and not any(o.finished for o in got[rid][:-1]), rid
        assert got[rid][-1].num_output_tokens == len(tokens(outs)), rid


def _engine_pair(make_engine: Factory, **overrides: Any) -> tuple[LLMEngine, LLMEngine]:
    base = {"max_num_batched_tokens": 32, "max_model_len": 256, **overrides}
    return make_engine(async_scheduling="off", **base), make_engine(async_scheduling="on", **base)


def test_auto_runs_ahead_where_the_forward_runs_on_its_own(make_engine: Factory) -> None:
    assert not make_engine().runs_ahead  # auto, and the CPU forward runs on the caller's thread
    assert make_engine(async_scheduling="on").runs_ahead
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model_dir="m", async_scheduling="yes")


def test_streams_equal_the_synchronous_engines(make_engine: Factory) -> None:
    sync, ahead = _engine_pair(make_engine)
    requests = _mixed_requests()
    expected = run_all(sync, requests)
    seen = _watch_rows(ahead)
    got = run_all(ahead, requests)
    _assert_streams_equal(got, expected)
    assert seen["ahead_steps"] > 5 and seen["late_rows"] > 10, seen
    # No row past a request's last token: the token in flight that ends it gets no successor.
    last_input = {rid: len(p) + params.max_tokens - 1 for rid, p, params in requests}
    assert all(end <= last_input[rid] for rid, end in seen["ends"]), "a row past max_tokens ran"
    assert ahead.num_generated_tokens == sync.num_generated_tokens


def test_logprobs_seeded_draws_min_tokens_and_static_rules_run_ahead(make_engine: Factory) -> None:
    """Rows whose draw reads no output token values go on running ahead: their logprobs
    come back with the tokens, seeded draws and min_tokens count the tokens in flight."""
    sync, ahead = _engine_pair(make_engine)
    ps = prompts(6, 13, 4, 9, seed=8)
    requests = [
        ("logprobs", ps[0], SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)),
        ("seeded", ps[1], SamplingParams(temperature=1.0, seed=11, max_tokens=10, logprobs=1)),
        ("min_tokens", ps[2], SamplingParams(temperature=0.7, seed=3, max_tokens=10, min_tokens=6)),
        (
            "rules",
            ps[3],
            SamplingParams(
                temperature=0, max_tokens=10, logit_bias=((7, 5.0),), allowed_token_ids=(7, 9, 11)
            ),
        ),
    ]
    expected = run_all(sync, requests)
    seen = _watch_rows(ahead)
    got = run_all(ahead, requests)
    _assert_streams_equal(got, expected)
    assert seen["ahead_steps"] >= 8 and seen["late_rows"] >= 30, seen


def test_penalized_rows_run_ahead(make_engine: Factory) -> None:
    """Penalties count a row's token in flight on the device: penalized rows go on running
    ahead (greedy and seeded), their streams the synchronous engine's. Two tokens favoured
    by a bias make the penalties decide between them at every step, so a count off by the
    token in flight shows in the stream."""
    sync, ahead = _engine_pair(make_engine)
    ps = prompts(6, 13, 4, seed=9)
    first, second, *_ = (t for t in range(3, 512) if not any(t in p for p in ps))  # in no prompt
    bias = {"logit_bias": ((first, 6.0), (second, 5.0)), "max_tokens": 12, "ignore_eos": True}
    requests = [
        ("repetition", ps[0], SamplingParams(temperature=0, repetition_penalty=1.4, **bias)),  # type: ignore[arg-type]
        (
            "frequency",
            ps[1],
            SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.5, **bias),
        ),  # type: ignore[arg-type]
        ("seeded", ps[2], SamplingParams(temperature=0.5, seed=4, frequency_penalty=0.4, **bias)),  # type: ignore[arg-type]
    ]
    expected = run_all(sync, requests)
    assert all(len(set(tokens(expected[rid]))) > 1 for rid, _, _ in requests), "the penalties decided nothing"
    seen = _watch_rows(ahead)
    got = run_all(ahead, requests)
    _assert_streams_equal(got, expected)
    assert seen["ahead_steps"] >= 8 and seen["late_rows"] >= 25, seen


def test_a_stop_token_ends_the_stream_though_the_next_row_ran(make_engine: Factory) -> None:
    sync, ahead = _engine_pair(make_engine)
    prompt = prompts(11, seed=5)[0]
    free = tokens(run_all(sync, [("free", prompt, GREEDY)])["free"])
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(free[4],))
    expected = run_all(sync, [("s", prompt, stop)])["s"]
    seen = _watch_rows(ahead)
    got = run_all(ahead, [("s", prompt, stop)])["s"]
    assert tokens(got) == tokens(expected) == free[: free.index(free[4]) + 1]
    assert got[-1].finish_reason == "stop" and got[-1].stop_token_id == free[4]
    # The row launched before the stop token was read back ran, and was dropped.
    assert max(end for _, end in seen["ends"]) == len(prompt) + len(tokens(got))


def test_preempted_and_aborted_requests_while_a_step_is_in_flight(make_engine: Factory) -> None:
    """A cache too small for every request preempts some of them, and one is aborted mid
    stream: the others' streams stay the synchronous engine's, and every block comes back
    (the tests' fixture checks)."""
    sync, ahead = _engine_pair(make_engine, num_kv_blocks=10, block_size=4)
    ps = prompts(9, 6, 7, 5, seed=11)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    expected = run_all(sync, requests)
    for rid, prompt, params in requests:
        ahead.add_request(RequestSpec(rid, prompt, params))
    got: dict[str, list[Any]] = {rid: [] for rid, _, _ in requests}
    while ahead.has_unfinished():
        for out in ahead.step():
            got[out.request_id].append(out)
        if len(got["r1"]) == 3 and ahead.step_in_flight:
            assert ahead.abort_request("r1")
    assert ahead.scheduler.num_preemptions > 0
    assert got["r1"][-1].finish_reason == "abort" and sum(o.finished for o in got["r1"]) == 1
    assert tokens(got["r1"]) == tokens(expected["r1"])[: len(tokens(got["r1"]))]
    for rid in ("r0", "r2", "r3"):
        assert tokens(got[rid]) == tokens(expected[rid]), rid


def test_replayed_decode_steps_take_their_inputs_from_the_step_in_flight(make_engine: Factory) -> None:
    """Decode steps through the graphs' static buffers: the rows whose tokens are in flight
    get them in the graph's input ids (the one host-to-device transfer carries where)."""
    config = {"attention_backend": "cpu", "max_num_seqs": 6, "block_size": 4, "max_num_batched_tokens": 16}
    sync, ahead = _engine_pair(make_engine, **config)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(5, 17, 3, 30, 9, seed=2))]
    expected = run_all(sync, requests)
    graphs = attach(ahead.runner, call_again)
    seen = _watch_rows(ahead)
    got = run_all(ahead, requests)
    assert {rid: tokens(o) for rid, o in got.items()} == {rid: tokens(o) for rid, o in expected.items()}
    assert graphs.replays > 5 and seen["late_rows"] > 10


def test_a_failed_launch_or_read_back_ends_only_the_requests_it_held(make_engine: Factory) -> None:
    """A launch that fails while a step is in flight reads that step back first (its tokens
    are delivered) and fails the launched step's requests; a read-back that fails fails its
    step's requests and those of the step launched on its tokens. Nothing leaks (the
    fixture checks the blocks) and the engine serves on."""
    engine = make_engine(async_scheduling="on")
    runner = engine.runner
    execute, start_readback = runner.execute, runner.start_readback
    p = prompts(7, seed=13)[0]
    engine.add_request(RequestSpec("a", p, GREEDY))
    engine.step()  # a's prefill in flight
    assert engine.step_in_flight

    def broken_launch(*args: Any) -> Any:
        raise RuntimeError("launch failed")

    runner.execute = broken_launch  # type: ignore[method-assign]
    with pytest.raises(EngineStepError) as info:
        engine.step()
    assert info.value.request_ids == ["a"]
    runner.execute = execute  # type: ignore[method-assign]
    delivered = engine.step()  # a's first token, read back before the launch failed
    assert [(o.request_id, len(o.new_token_ids), o.finished) for o in delivered] == [("a", 1, False)]
    assert not engine.has_unfinished()

    engine.add_request(RequestSpec("b", p, GREEDY))

    def failing_read(tensors: Any) -> Any:
        def read() -> Any:
            raise RuntimeError("read back failed")

        return read

    runner.start_readback = failing_read  # type: ignore[method-assign]
    engine.step()  # b's prefill in flight; its read back will fail
    runner.start_readback = start_readback  # type: ignore[method-assign]
    engine.add_request(RequestSpec("c", prompts(5, seed=14)[0], GREEDY))
    with pytest.raises(EngineStepError) as info:
        engine.step()  # launches b's decode and c's prefill, then b's prefill fails to read back
    assert sorted(info.value.request_ids) == ["b", "c"]
    assert not engine.has_unfinished()
    out = run_all(engine, [("d", p, GREEDY)])["d"]
    assert out[-1].finished and len(tokens(out)) == GREEDY.max_tokens
