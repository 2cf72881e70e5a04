"""LLMEngine end to end on a tiny random Llama."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.worker_engine.conftest import EOS, VOCAB, hf_greedy, prompts, run_all, tokens
from worker_svc.engine import EngineStepError, KvEvent, LLMEngine, RequestSpec, SamplingParams, native

Factory = Callable[..., LLMEngine]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_greedy_matches_transformers_generate(
    make_engine: Factory, hf_model: LlamaForCausalLM, backend: str
) -> None:
    ps = prompts(3, 16, 29, 50, 77)
    engine = make_engine(attention_backend=backend)
    outs = run_all(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens(outs[f"r{i}"]) == hf_greedy(hf_model, p, GREEDY.max_tokens), f"prompt {i}"
    last = outs["r0"][-1]
    assert last.finished and last.finish_reason in ("stop", "length")
    assert sum(len(o.new_token_ids) for o in outs["r0"]) == last.num_output_tokens


def test_chunked_prefill_same_greedy_output(make_engine: Factory) -> None:
    ps = prompts(9, 40, 70)
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    ref = run_all(make_engine(), reqs)
    for budget in (5, 16):
        engine = make_engine(max_num_batched_tokens=budget)
        outs = run_all(engine, reqs)
        assert {k: tokens(v) for k, v in outs.items()} == {k: tokens(v) for k, v in ref.items()}
        assert engine.stats().num_steps > max(len(p) for p in ps) // budget


def test_prompt_that_fits_a_later_step_is_not_split(make_engine: Factory) -> None:
    """A prompt that does not fit the rest of this step's budget, but fits a step of the
    running decodes alone, waits a step and is prefilled whole; only a prompt longer than
    that is chunked."""
    engine = make_engine(max_num_batched_tokens=48)
    engine.add_request(RequestSpec("a", prompts(30, seed=11)[0], GREEDY))
    engine.add_request(RequestSpec("b", prompts(30, seed=12)[0], GREEDY))  # 18 tokens of budget left
    engine.step()
    assert engine.requests["a"].num_computed_tokens == 30
    assert engine.requests["b"].num_computed_tokens == 0  # waits: 30 <= 48 - 1 running
    engine.step()  # a's decode + b's whole prompt
    assert engine.requests["b"].num_computed_tokens == 30
    engine.add_request(RequestSpec("c", prompts(47, seed=13)[0], GREEDY))  # 47 > 48 - 2 running: chunked
    engine.step()
    assert engine.requests["c"].num_computed_tokens == 46  # the budget left by 2 decodes
    while engine.has_unfinished():
        engine.step()


def test_short_prompts_and_decodes_run_beside_a_long_prompts_chunks(make_engine: Factory) -> None:
    """A long prompt in chunked prefill neither stalls the decodes admitted after it nor
    keeps a short prompt next in line waiting until its last chunk: the short prompt
    starts in the next step and decodes in every step after, the long prompt's chunks
    taking what is left; every answer equals the engine's with each request alone."""
    engine = make_engine(max_num_batched_tokens=32)
    long_prompt, short_prompt = prompts(200, 7, seed=31)
    alone = {
        rid: tokens(run_all(make_engine(), [(rid, p, GREEDY)])[rid])
        for rid, p in (("long", long_prompt), ("short", short_prompt))
    }
    outs: dict[str, list[int]] = {"long": [], "short": []}

    def step() -> None:
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids

    engine.add_request(RequestSpec("long", long_prompt, GREEDY))
    step()
    assert engine.requests["long"].num_computed_tokens == 32
    engine.add_request(RequestSpec("short", short_prompt, GREEDY))
    step()  # the short prompt whole (7 <= 32 / 4), the long one's chunk what is left
    assert engine.requests["short"].num_computed_tokens == 7
    assert engine.requests["long"].num_computed_tokens == 32 + 25
    for _ in range(3):
        step()  # the short one's decode, then the long one's chunk
        assert engine.requests["long"].num_computed_tokens < 200
    assert len(outs["short"]) == 4
    while engine.has_unfinished():
        step()
    assert outs == alone


def test_a_prefill_worker_moves_its_short_streams_before_a_long_prefill(make_engine: Factory) -> None:
    """``moves_streams`` (a P/D prefill worker): when a long prompt arrives, the short
    requests that are decoding end as "moved" in a step that runs no forward, before the
    long prompt's first chunk, their blocks freed; a short request resumed from elsewhere
    and one with a longer prompt stay. Resumed on another engine with its output so far,
    the moved request's answer equals the one it gives alone."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chat, guest, mid, long_prompt = prompts(7, 7, 12, 200, seed=41)
    alone = {
        rid: tokens(run_all(make_engine(), [(rid, p, params)])[rid])
        for rid, p in (("chat", chat), ("guest", guest))
    }
    engine = make_engine(max_num_batched_tokens=32)  # short prompts: up to 32 / 4 tokens
    engine.moves_streams = True
    outs: dict[str, list[int]] = {"chat": [], "guest": [], "mid": [], "long": []}
    engine.add_request(RequestSpec("chat", chat, params))
    engine.add_request(RequestSpec("guest", guest, params, resumed_output=alone["guest"][:2]))
    engine.add_request(RequestSpec("mid", mid, params))
    for _ in range(2):
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    engine.add_request(RequestSpec("long", long_prompt, params))
    steps, used = engine.num_steps, engine.block_manager.num_used_blocks()
    ended = [(o.request_id, o.finish_reason, o.new_token_ids) for o in engine.step() if o.finished]
    assert ended == [("chat", "moved", [])]
    assert engine.num_steps == steps and engine.requests["long"].num_computed_tokens == 0
    assert engine.block_manager.num_used_blocks() < used and "chat" not in engine.requests
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "moved", out
            outs[out.request_id] += out.new_token_ids
    assert outs["guest"] == alone["guest"][2:]
    resumed = run_all_resumed(make_engine(), "chat", chat, params, outs["chat"])
    assert outs["chat"] + resumed == alone["chat"]


def run_all_resumed(
    engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, done: list[int]
) -> list[int]:
    """The tokens ``engine`` adds to a request resumed after ``done``."""
    engine.add_request(RequestSpec(rid, prompt, params, resumed_output=done))
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def test_prefix_reuse(make_engine: Factory) -> None:
    shared = prompts(40, seed=5)[0]
    first = [*shared, 7, 8, 9]
    second = [*shared, 10, 11]
    no_cache = make_engine(enable_prefix_caching=False)
    ref = run_all(no_cache, [("a", first, GREEDY), ("b", second, GREEDY)])
    engine = make_engine()
    out_a = run_all(engine, [("a", first, GREEDY)])["a"]
    assert out_a[0].num_cached_tokens == 0
    out_b = run_all(engine, [("b", second, GREEDY)])["b"]
    assert out_b[0].num_cached_tokens == 32  # two full 16-token blocks of the shared prefix
    out_a2 = run_all(engine, [("a2", first, GREEDY)])["a2"]
    assert out_a2[0].num_cached_tokens == 32
    assert tokens(out_a) == tokens(ref["a"]) == tokens(out_a2)
    assert tokens(out_b) == tokens(ref["b"])
    assert engine.stats().prefix_cache_hit_rate > 0


def test_preemption_with_tiny_block_budget(make_engine: Factory) -> None:
    ps = prompts(12, 20, 25, 30, 18, seed=7)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    ref = run_all(make_engine(block_size=4), reqs)
    for caching in (True, False):
        # 5 requests need up to 15 blocks each; 20 blocks force preemption and recompute.
        engine = make_engine(block_size=4, num_kv_blocks=20, enable_prefix_caching=caching)
        outs = run_all(engine, reqs)
        assert engine.stats().num_preemptions > 0
        for rid, out in outs.items():
            assert tokens(out) == tokens(ref[rid]), rid
            assert len(tokens(out)) == 30 and out[-1].finish_reason == "length"


def test_priority_preempts_low_priority_first(make_engine: Factory) -> None:
    engine = make_engine(block_size=4, num_kv_blocks=12)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    low, high = prompts(16, 16, seed=8)
    engine.add_request(RequestSpec("low", low, params, priority=0))
    engine.add_request(RequestSpec("high", high, params, priority=5))
    preempted: set[str] = set()
    while engine.has_unfinished():
        engine.step()
        preempted |= {r.request_id for r in engine.scheduler.waiting if r.num_preemptions}
    assert "low" in preempted and "high" not in preempted


@pytest.mark.parametrize("limit", ["max_num_seqs", "kv_blocks"])
def test_higher_priority_displaces_a_running_request(make_engine: Factory, limit: str) -> None:
    """A waiting request of higher priority, blocked by max_num_seqs or by free blocks,
    preempts the lowest-priority running request at once instead of waiting for one to
    finish; every answer equals the undisturbed engine's."""
    # kv_blocks: after 5 steps the two low requests hold 9 of 16 blocks; high needs 8.
    sizes = {"max_num_seqs": {"max_num_seqs": 2}, "kv_blocks": {"block_size": 4, "num_kv_blocks": 16}}
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ps = prompts(12, 14, 30, seed=21)
    reqs = [("low-a", ps[0], long, 0), ("low-b", ps[1], long, 1), ("high", ps[2], GREEDY, 5)]
    ref = run_all(make_engine(), [(rid, p, params) for rid, p, params, _ in reqs])
    engine = make_engine(**sizes[limit])
    outs: dict[str, list[int]] = {rid: [] for rid, *_ in reqs}

    def step() -> None:
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids

    for rid, p, params, priority in reqs[:2]:
        engine.add_request(RequestSpec(rid, p, params, priority=priority))
    for _ in range(5):
        step()
    assert {r.request_id for r in engine.scheduler.running} == {"low-a", "low-b"}
    engine.add_request(RequestSpec("high", ps[2], GREEDY, priority=5))
    step()
    assert outs["high"], "high waited for a running request to finish"
    assert engine.requests["low-a"].num_preemptions == 1  # the lowest priority
    assert engine.requests["low-b"].num_preemptions == 0
    assert engine.stats().num_priority_preemptions == 1 <= engine.stats().num_preemptions
    while engine.has_unfinished():
        step()
    assert outs == {rid: tokens(out) for rid, out in ref.items()}


def test_a_higher_priority_prompt_prefills_in_a_step_of_its_own(make_engine: Factory) -> None:
    """A prompt of higher priority than running requests is prefilled without their
    decodes (its first token costs its own prefill only); they resume the next step, and
    every answer equals the undisturbed engine's. Equal priorities share the step."""
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ps = prompts(10, 11, 12, 20, 21, seed=23)
    reqs = [
        ("low-a", ps[0], 0),
        ("low-b", ps[1], 0),
        ("low-c", ps[2], 0),
        ("high", ps[3], 5),
        ("peer", ps[4], 0),
    ]
    ref = run_all(make_engine(), [(rid, p, long) for rid, p, _ in reqs])
    engine = make_engine(priority_step_ratio=0)  # the step membership here is the floor's alone
    outs: dict[str, list[int]] = {rid: [] for rid, *_ in reqs}

    def step() -> set[str]:
        stepped = set()
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
            stepped.add(out.request_id)
        return stepped

    for rid, p, priority in reqs[:3]:
        engine.add_request(RequestSpec(rid, p, long, priority=priority))
    step()
    step()
    engine.add_request(RequestSpec("high", ps[3], long, priority=5))
    assert step() == {"high"}
    assert step() == {"low-a", "low-b", "low-c", "high"}
    engine.add_request(RequestSpec("peer", ps[4], long, priority=0))
    assert step() == {"low-a", "low-b", "low-c", "high", "peer"}  # no class above the others
    while engine.has_unfinished():
        step()
    assert outs == {rid: tokens(out) for rid, out in ref.items()}
    assert engine.stats().num_priority_preemptions == 0


def test_lower_priorities_take_a_capped_share_of_a_step_in_turn(make_engine: Factory) -> None:
    """Beside a running request of higher priority, lower-priority rows and prompts take
    only what the step cost allows (10 ms a step, 0.5 ms a row and a token, ratio 2: about
    10 decode rows beside the high one), those that sat out longest first: the high request
    runs every step, no running low one sits out more than two steps in a row (the high
    prompt's own step, then 16 rows sharing about 10 tokens), and every answer equals the
    undisturbed engine's. With the ratio 0 nothing is capped."""
    long = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ps = prompts(*([6] * 16), 9, 30, seed=31)
    lows = [(f"low-{i}", p) for i, p in enumerate(ps[:16])]
    ref = run_all(make_engine(), [*[(rid, p, long) for rid, p in lows], ("high", ps[16], long)])
    ref |= run_all(make_engine(), [("late", ps[17], long)])
    for ratio, cap in ((2.0, 11), (0.0, 512)):  # 512: the step's whole budget
        engine = make_engine(priority_step_ratio=ratio)
        if engine.step_cost is not None:  # fitted only with a ratio
            engine.step_cost.plane = lambda: (0.010, 0.0005, 0.0005)  # type: ignore[method-assign]
        else:
            assert ratio == 0.0
        outs: dict[str, list[int]] = {rid: [] for rid in ref}

        for rid, p in lows:
            engine.add_request(RequestSpec(rid, p, long, priority=0))
        _step_tokens(engine, outs)
        engine.add_request(RequestSpec("high", ps[16], long, priority=5))
        assert set(_step_tokens(engine, outs)) == {"high"}  # its prompt in a step of its own class
        engine.add_request(RequestSpec("late", ps[17], long, priority=0))
        while "high" in engine.requests:
            computed = _step_tokens(engine, outs)
            low_tokens = sum(n for rid, n in computed.items() if rid != "high")
            assert ("high" in computed or "high" not in engine.requests) and low_tokens <= cap
            running_lows = [r for r in engine.scheduler.running if r.priority == 0]
            assert all(engine.scheduler.num_steps - r.last_step <= (2 if ratio else 0) for r in running_lows)
        while engine.has_unfinished():
            _step_tokens(engine, outs)
        assert outs == {rid: tokens(out) for rid, out in ref.items()}


def test_the_share_stays_capped_a_while_after_the_higher_priority_leaves(make_engine: Factory) -> None:
    """After the last higher-priority request finishes, lower priorities stay within the
    share for PRIORITY_HOLD_STEPS steps (the next interactive request, arriving in between,
    waits for a short step, not a whole batch), then take whole steps again; every answer
    equals the undisturbed engine's."""
    from worker_svc.engine.scheduler import PRIORITY_HOLD_STEPS

    long = SamplingParams(temperature=0, max_tokens=PRIORITY_HOLD_STEPS + 12, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ps = prompts(*([6] * 16), 9, seed=37)
    lows = [(f"low-{i}", p) for i, p in enumerate(ps[:16])]
    ref = run_all(make_engine(), [(rid, p, long) for rid, p in lows])
    ref |= run_all(make_engine(), [("high", ps[16], short)])
    engine = make_engine(priority_step_ratio=2.0)
    assert engine.step_cost is not None
    engine.step_cost.plane = lambda: (0.010, 0.0005, 0.0005)  # type: ignore[method-assign]
    outs: dict[str, list[int]] = {rid: [] for rid in ref}
    for rid, p in lows:
        engine.add_request(RequestSpec(rid, p, long, priority=0))
    _step_tokens(engine, outs)
    engine.add_request(RequestSpec("high", ps[16], short, priority=5))
    while "high" in engine.requests:
        _step_tokens(engine, outs)
    held = [sum(_step_tokens(engine, outs).values()) for _ in range(PRIORITY_HOLD_STEPS)]
    assert max(held) <= 11  # within the share one high row would leave (10 ms + 0.5 ms a row)
    assert sum(_step_tokens(engine, outs).values()) == 16  # the hold is over: every row
    while engine.has_unfinished():
        _step_tokens(engine, outs)
    assert outs == {rid: tokens(out) for rid, out in ref.items()}


def _step_tokens(engine: LLMEngine, outs: dict[str, list[int]]) -> dict[str, int]:
    """One step, its tokens added to ``outs``; the tokens each request computed in it."""
    before = {rid: r.num_computed_tokens for rid, r in engine.requests.items()}
    for out in engine.step():
        outs[out.request_id] += out.new_token_ids
    done = engine.scheduler.num_steps
    return {
        rid: r.num_computed_tokens - before[rid]
        for rid, r in engine.requests.items()
        if r.last_step == done and rid in before
    }


def test_equal_priority_and_displaced_twice_are_not_displaced(make_engine: Factory) -> None:
    """No displacement between equal priorities, nor of a request already preempted
    MAX_DISPLACEMENTS times: the newcomer waits."""
    from worker_svc.engine.scheduler import MAX_DISPLACEMENTS

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = make_engine(max_num_seqs=1)
    ps = prompts(8, 8, 8, seed=22)
    engine.add_request(RequestSpec("a", ps[0], long, priority=3))
    engine.step()
    engine.add_request(RequestSpec("b", ps[1], GREEDY, priority=3))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    engine.requests["a"].num_preemptions = MAX_DISPLACEMENTS
    engine.add_request(RequestSpec("c", ps[2], GREEDY, priority=9))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == [
        "a"
    ] and engine.stats().num_priority_preemptions == 0
    while engine.has_unfinished():
        engine.step()


def test_abort_frees_blocks_immediately(make_engine: Factory) -> None:
    engine = make_engine()
    ps = prompts(30, 30, seed=9)
    engine.add_request(RequestSpec("a", ps[0], SamplingParams(temperature=0, max_tokens=50)))
    engine.add_request(RequestSpec("b", ps[1], SamplingParams(temperature=0, max_tokens=5)))
    engine.step()
    engine.step()
    used = engine.block_manager.num_used_blocks()
    assert engine.abort_request("a")
    assert engine.block_manager.num_used_blocks() < used
    assert not engine.abort_request("a") and not engine.abort_request("nope")
    seen = []
    while engine.has_unfinished():
        seen.extend(engine.step())
    notices = [(o.finished, o.finish_reason, o.new_token_ids) for o in seen if o.request_id == "a"]
    assert notices == [(True, "abort", [])]
    assert [o for o in seen if o.request_id == "b"][-1].finish_reason in ("stop", "length")
    assert engine.stats().num_aborted == 1
    # A request aborted while still waiting never holds blocks.
    engine.add_request(RequestSpec("w", ps[0], GREEDY))
    assert engine.abort_request("w")
    assert engine.block_manager.num_used_blocks() == 0
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("w", "abort")]
    assert not engine.has_unfinished()


def test_seeded_sampling_is_batch_independent(make_engine: Factory) -> None:
    p = prompts(20, seed=11)[0]
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = tokens(run_all(make_engine(), [("s", p, params)])["s"])
    others = prompts(5, 33, 60, seed=12)
    mix = [("s", p, params)] + [
        (f"o{i}", q, SamplingParams(temperature=0.8, max_tokens=10 + i)) for i, q in enumerate(others)
    ]
    mixed = tokens(run_all(make_engine(max_num_batched_tokens=24), mix)["s"])
    assert mixed == alone
    again = tokens(run_all(make_engine(), [("s", p, params)])["s"])
    assert again == alone
    other = SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True)
    assert tokens(run_all(make_engine(), [("s", p, other)])["s"]) != alone


def test_sampling_knobs_on_model(make_engine: Factory) -> None:
    engine = make_engine()
    p = prompts(12, seed=13)[0]
    greedy = tokens(run_all(engine, [("g", p, SamplingParams(temperature=0, max_tokens=8))])["g"])
    top1 = tokens(run_all(engine, [("k", p, SamplingParams(top_k=1, max_tokens=8, seed=1))])["k"])
    assert top1 == greedy
    rep = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=10.0, ignore_eos=True)
    out = tokens(run_all(engine, [("r", p, rep)])["r"])
    assert len(set(out)) == len(out)  # heavy repetition penalty: no token twice
    stop_tok = greedy[3]
    stopped = run_all(
        engine, [("s", p, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_tok,)))]
    )
    assert tokens(stopped["s"]) == greedy[: greedy.index(stop_tok) + 1]
    assert stopped["s"][-1].finish_reason == "stop" and stopped["s"][-1].stop_token_id == stop_tok


def test_eos_stop_and_min_tokens(make_engine: Factory) -> None:
    engine = make_engine()
    q = prompts(6, seed=100)[0]
    free_run = tokens(
        run_all(engine, [("x", q, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))])["x"]
    )
    # The random model rarely emits its real EOS; declare the 4th greedy token the EOS.
    eos = free_run[3]
    k = free_run.index(eos) + 1
    engine._eos = frozenset({eos})
    engine.sampler.eos_token_ids = (eos,)
    natural = run_all(engine, [("e", q, SamplingParams(temperature=0, max_tokens=20))])["e"]
    assert tokens(natural) == free_run[:k]
    assert natural[-1].finish_reason == "stop" and natural[-1].stop_token_id == eos
    delayed = run_all(engine, [("m", q, SamplingParams(temperature=0, max_tokens=20, min_tokens=k + 2))])["m"]
    assert eos not in tokens(delayed)[: k + 2]
    ignored = run_all(engine, [("i", q, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))])["i"]
    assert tokens(ignored) == free_run and ignored[-1].finish_reason == "length"


def test_logprobs_and_prompt_logprobs(make_engine: Factory, hf_model: LlamaForCausalLM) -> None:
    engine = make_engine(max_num_batched_tokens=7)  # prompt logprobs across chunks
    p = prompts(20, seed=14)[0]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    outs = run_all(engine, [("l", p, params)])["l"]
    plp = outs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(p) - 1
    assert all(o.prompt_logprobs is None for o in outs[1:])
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
    for j, (tok, lp, top, _rank) in enumerate(plp):
        assert tok == p[j + 1]
        assert math.isclose(lp, ref[j, tok].item(), abs_tol=1e-4)
        assert len(top) == 2 and top[0][0] == ref[j].argmax().item()
    for o in outs:
        assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids) == 1
        tok, lp, top, rank = o.new_logprobs[0]
        assert tok == o.new_token_ids[0] and len(top) == 3 and rank == 1
        assert top[0][0] == tok and math.isclose(top[0][1], lp)  # greedy: chosen is the argmax
        assert lp <= 0


def test_add_request_validation(make_engine: Factory) -> None:
    engine = make_engine(max_model_len=64)
    assert engine.model_info.max_model_len == 64
    assert engine.model_info.vocab_size == VOCAB and EOS in engine.model_info.eos_token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(RequestSpec("x", [5] * 60, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(RequestSpec("x", [], SamplingParams()))
    for bad in ([VOCAB], [5, -1], [5, True], [5, 2.0], [5, "7"]):
        with pytest.raises(ValueError, match="prompt_token_ids contains"):
            engine.add_request(RequestSpec("x", bad, SamplingParams()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(RequestSpec("x", [5], SamplingParams(temperature=math.nan)))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(RequestSpec("", [5], SamplingParams()))
    with pytest.raises(ValueError, match="extra_keys"):
        engine.add_request(RequestSpec("x", [5], SamplingParams(), extra_keys=["a"]))  # type: ignore[arg-type]
    engine.add_request(RequestSpec("x", [5, VOCAB - 1], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(RequestSpec("x", [5], SamplingParams()))
    assert [o.finished for o in engine.step()] == [True]
    small = make_engine(block_size=4, num_kv_blocks=3)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        small.add_request(RequestSpec("big", [5] * 10, SamplingParams(max_tokens=5)))


def test_generation_capped_by_max_model_len(make_engine: Factory) -> None:
    engine = make_engine(max_model_len=32)
    out = run_all(engine, [("c", [5] * 20, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])[
        "c"
    ]
    assert len(tokens(out)) == 12 and out[-1].finish_reason == "length"


def test_kv_events_flow(make_engine: Factory, engine_model_dir: str) -> None:
    events: list[KvEvent] = []
    from worker_svc.engine import EngineConfig

    engine = LLMEngine(
        EngineConfig(model_dir=engine_model_dir, num_kv_blocks=6, compile_model=False),
        on_kv_events=events.extend,
    )
    p = prompts(40, seed=15)[0]
    run_all(engine, [("a", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
    from services.kv_hash import block_hashes

    assert stored[:2] == block_hashes(p, 16)[:2]
    run_all(engine, [("b", prompts(80, seed=16)[0], SamplingParams(temperature=0, max_tokens=4))])
    assert any(e.kind == "removed" for e in events)
    assert engine.block_manager.num_used_blocks() == 0
    assert engine.reset_prefix_cache() and events[-1].kind == "cleared"


def test_step_failure_aborts_batch_and_engine_survives(make_engine: Factory) -> None:
    engine = make_engine()
    p = prompts(10, seed=17)[0]
    engine.add_request(RequestSpec("a", p, GREEDY))
    engine.step()
    original = engine.runner.execute

    def boom(*args: object, **kwargs: object) -> object:
        raise RuntimeError("kernel exploded")

    engine.runner.execute = boom  # type: ignore[method-assign]
    with pytest.raises(EngineStepError) as info:
        engine.step()
    assert info.value.request_ids == ["a"]
    assert engine.block_manager.num_used_blocks() == 0 and not engine.has_unfinished()
    engine.runner.execute = original  # type: ignore[method-assign]
    out = run_all(engine, [("b", p, GREEDY)])["b"]
    assert out[-1].finished


def test_attention_backend_resolution_on_cpu(make_engine: Factory, engine_model_dir: str) -> None:
    from worker_svc.engine import EngineConfig, cpu_attention, triton_attention

    native = cpu_attention.load() is not None
    assert make_engine(attention_backend="auto").model_info.attention_backend == (
        "cpu" if native else "torch"
    )
    # float16 has no native kernel: auto falls back to the torch path, an explicit "cpu" is refused.
    assert make_engine(attention_backend="auto", dtype="float16").model_info.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        make_engine(attention_backend="cpu", dtype="float16")
    assert not triton_attention.backend_supported(torch.device("cpu"), 16)
    with pytest.raises(ValueError, match="attention_backend"):
        LLMEngine(
            EngineConfig(
                model_dir=engine_model_dir, num_kv_blocks=8, attention_backend="triton", compile_model=False
            )
        )


def test_start_up_line_names_the_effective_configuration(make_engine: Factory) -> None:
    engine = make_engine(max_num_seqs=7, max_num_batched_tokens=96, enable_prefix_caching=False)
    line = engine.describe()
    for part in (
        "dtype float32",
        f"attention {engine.model_info.attention_backend}",
        "compiled no",
        f"native CPU kernels {'yes' if native.library() is not None else 'no'}",
        f"{torch.get_num_threads()} threads",
        "0 merged projection groups",  # merge_projections auto: off on CPU
        "128 KV blocks of 16 tokens",
        "max_num_seqs 7",
        "96 tokens per step",
        "prefix caching False",
    ):
        assert part in line, (part, line)
