"""Structured outputs and token rules in the engine, on the real tiny model with its
tokenizer (`model_dir`): grammar-constrained outputs always parse, the matcher follows
every accepted token (resumed output replayed), grammars compile once, bad specs are
refused naming the field; logit_bias, allowed_token_ids and bad_words act on sampling."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.grammar import StructuredSpec
from tests.worker_engine.conftest import prompts, run_all, tokens
from worker_svc.engine import LLMEngine, RequestSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"vip": {"type": "boolean"}},
            "required": ["vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture
def engine(make_engine: Callable[..., LLMEngine], model_dir: Path) -> LLMEngine:
    return make_engine(model_dir=str(model_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


def _json(temperature: float = 0.0, seed: int | None = None, **extra: object) -> SamplingParams:
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=120, structured=spec, **extra)  # type: ignore[arg-type]


def _check(value: dict) -> None:
    assert set(value) == {"name", "kind", "tags", "owner"}
    assert value["kind"] in ("cat", "dog", "fish") and len(value["name"]) <= 8
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert set(value["owner"]) == {"vip"} and isinstance(value["owner"]["vip"], bool)


def test_constrained_outputs_parse_in_a_mixed_batch(engine: LLMEngine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(5, 9, 7, 6)
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = tokens(run_all(engine, [("plain", ps[0], plain)])["plain"])
    outs = run_all(
        engine,
        [
            ("plain", ps[0], plain),
            ("greedy", ps[1], _json()),
            *[(f"seeded{i}", ps[2], _json(1.0, seed=i)) for i in range(3)],
            ("random", ps[3], _json(1.2)),
        ],
    )
    # The unconstrained row is untouched by its constrained neighbours.
    assert tokens(outs["plain"]) == alone
    texts = set()
    for rid in ("greedy", "seeded0", "seeded1", "seeded2", "random"):
        assert outs[rid][-1].finish_reason == "stop", rid
        text = tokenizer.decode(tokens(outs[rid]), skip_special_tokens=True)
        _check(json.loads(text))
        texts.add(text)
    assert len(texts) > 1  # constrained sampling still samples
    assert engine.grammar.num_compiles == 1  # one schema, compiled once


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredSpec("regex", r"[a-c]{3}-\d{2}"), lambda t: len(t) == 6 and t[3] == "-"),
        (StructuredSpec("choice", json.dumps(["yes", "no", "maybe"])), lambda t: t in ("yes", "no", "maybe")),
        (StructuredSpec("grammar", 'start: "x" ("+" "x")~1..3'), lambda t: t.startswith("x+x")),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_every_kind_holds(engine: LLMEngine, tokenizer, spec: StructuredSpec, check) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured=spec)
    outs = run_all(engine, [("r", prompts(6)[0], params)])["r"]
    text = tokenizer.decode(tokens(outs), skip_special_tokens=True)
    assert outs[-1].finish_reason == "stop", text
    assert check(text), text


def test_json_object_output_is_a_json_object_prefix(engine: LLMEngine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Any object is allowed, so a random model may not close it within max_tokens: what
    came out must still be an object's start (``{`` then a key string)."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=StructuredSpec("json_object"))
    outs = run_all(engine, [("r", prompts(6)[0], params)])["r"]
    text = tokenizer.decode(tokens(outs), skip_special_tokens=True)
    assert text.startswith('{"') or text == "{}", text
    if outs[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_resumed_output_is_replayed_into_the_matcher(engine: LLMEngine, make_engine, model_dir) -> None:  # type: ignore[no-untyped-def]
    prompt = prompts(8)[0]
    full = tokens(run_all(engine, [("a", prompt, _json(1.0, seed=5))])["a"])
    assert len(full) > 6
    other = make_engine(model_dir=str(model_dir), num_kv_blocks=256)
    other.add_request(RequestSpec("b", prompt, _json(1.0, seed=5), resumed_output=full[:5]))
    outs: list = []
    while other.has_unfinished():
        outs.extend(other.step())
    # Continues exactly where the uninterrupted run was (a matcher left at the start
    # of the grammar would force "{" again).
    assert full[:5] + tokens(outs) == full


def test_bad_specs_are_refused_naming_the_field(engine: LLMEngine) -> None:
    bad = [
        (StructuredSpec("json", "{not json"), "structured_outputs.json"),
        (StructuredSpec("json", '{"type": "bogus"}'), "structured_outputs.json"),
        (StructuredSpec("regex", "a("), "structured_outputs.regex"),
        (StructuredSpec("choice", "[]"), "structured_outputs.choice"),
        (StructuredSpec("grammar", "start: ("), "structured_outputs.grammar"),
        (StructuredSpec("xml", ""), "structured_outputs kind"),
    ]
    for spec, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            engine.add_request(RequestSpec("r", [5, 6], SamplingParams(max_tokens=4, structured=spec)))
    for params, field in [
        (SamplingParams(logit_bias=((5, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias"),
        (SamplingParams(allowed_token_ids=(10**6,)), "allowed_token_ids"),
        (SamplingParams(bad_words=("",)), "bad_words"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.add_request(RequestSpec("r", [5, 6], params))
    assert not engine.has_unfinished()


def test_abort_while_preparing_leaks_nothing(engine: LLMEngine) -> None:
    engine.add_request(RequestSpec("r", [5, 6, 7], _json()))
    assert engine.abort_request("r")
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not engine.has_unfinished()


def test_logit_bias_allowed_and_bad_words(engine: LLMEngine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = prompts(6)[0]
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = tokens(run_all(engine, [("p", prompt, SamplingParams(**base))])["p"])  # type: ignore[arg-type]
    biased = tokens(run_all(engine, [("b", prompt, SamplingParams(**base, logit_bias=((77, 100.0),)))])["b"])  # type: ignore[arg-type]
    assert biased == [77] * 6 != plain
    suppressed = SamplingParams(**base, logit_bias=((plain[0], -100.0),))  # type: ignore[arg-type]
    assert tokens(run_all(engine, [("s", prompt, suppressed)])["s"])[0] != plain[0]
    allowed = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, allowed_token_ids=(40, 41, 42)
    )
    assert set(tokens(run_all(engine, [("a", prompt, allowed)])["a"])) <= {40, 41, 42}
    word = tokenizer.decode([plain[0]]).strip()
    assert word
    banned = SamplingParams(**base, bad_words=(word,))  # type: ignore[arg-type]
    out = tokens(run_all(engine, [("w", prompt, banned)])["w"])
    assert word not in tokenizer.decode(out[:1])


def test_engine_keeps_stepping_while_a_grammar_is_prepared(engine: LLMEngine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The grammar pool is held busy (a real task blocking its one thread): the
    constrained request waits outside the scheduler while a plain request runs to its
    end, then gets its matcher and finishes valid."""
    import threading

    gate = threading.Event()
    engine.grammar._pool.submit(gate.wait, 30)
    engine.add_request(RequestSpec("json", prompts(5)[0], _json()))
    engine.add_request(
        RequestSpec("plain", prompts(6)[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    )
    outs: dict[str, list] = {"json": [], "plain": []}
    while "plain" in engine.requests:
        for out in engine.step():
            outs[out.request_id].append(out)
    assert len(tokens(outs["plain"])) == 8 and not outs["json"]
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    _check(json.loads(tokenizer.decode(tokens(outs["json"]), skip_special_tokens=True)))


def test_rules_leaving_the_grammar_no_token_abort_only_that_request(engine: LLMEngine) -> None:
    """allowed_token_ids disjoint from what the grammar allows at the start ("{"): the
    request ends (abort) instead of failing the batch; its neighbour is unaffected."""
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = tokens(run_all(engine, [("p", prompts(6)[0], plain)])["p"])
    clash = _json(allowed_token_ids=(40, 41))
    outs = run_all(engine, [("p", prompts(6)[0], plain), ("c", prompts(5)[0], clash)])
    assert outs["c"][-1].finish_reason == "abort"
    assert tokens(outs["p"]) == alone
