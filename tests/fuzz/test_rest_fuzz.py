"""REST fuzz of the gateway of the shared real mesh.

* schemathesis generates requests (valid and invalid) from the gateway's own
  `/openapi.json`, a few examples per operation;
* hypothesis throws malformed bodies at every POST route: arbitrary JSON values,
  valid bodies with one field replaced by arbitrary JSON, non-JSON bytes.

Nothing may answer 5xx (the only 5xx allowed is /v1/embeddings' 503: this mesh runs
no embedding worker), and every 4xx is an OpenAI error object (on /v1/messages*:
Anthropic's).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.schemas import BaseSchema

from tests.mesh import MODEL_NAME, RunningMesh

# Small so the suite stays fast; per operation and generation mode.
SCHEMATHESIS_EXAMPLES = 8
HYPOTHESIS_EXAMPLES = 30
# Valid generation requests are capped to this many tokens so accepted ones finish quickly.
MAX_TOKENS_CAP = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")


def _no_embedding_worker(path: str, reply: httpx.Response | Any) -> bool:
    """The mesh has no embedding worker: /v1/embeddings answers 503 'unavailable'."""
    if path != "/v1/embeddings" or reply.status_code != 503:
        return False
    return bool(reply.json()["error"]["code"] == "unavailable")


def _cap(body: Any) -> Any:
    """Keeps accepted generations short: a valid token count above the cap is lowered."""
    if isinstance(body, dict):
        for name in TOKEN_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
                body[name] = MAX_TOKENS_CAP if name != "min_tokens" else 0
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
    return body


def _assert_error_shape(reply: Any, path: str) -> None:
    if 400 <= reply.status_code < 500:
        body = reply.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error", reply.text
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], reply.text
        assert isinstance(error["type"], str)


@pytest.fixture(scope="module")
def gateway_schema(mesh: RunningMesh) -> BaseSchema:
    """The gateway's OpenAPI schema as schemathesis loads it from the running gateway."""
    return schemathesis.openapi.from_url(mesh.gateway_url + "/openapi.json", timeout=30)


# (method, path) of every operation the gateway documents; checked against the schema.
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]


def test_operation_list_matches_the_schema(gateway_schema: BaseSchema) -> None:
    """The parametrization below covers exactly the operations of /openapi.json."""
    found = set()
    for result in gateway_schema.get_all_operations():
        assert isinstance(result, Ok), result
        found.add((result.ok().method.upper(), result.ok().path))
    assert found == set(OPERATIONS)


# Schema-violating cases exist only for operations with a body (the rest take no input
# but a path parameter, which every string satisfies; a cancel is a bodyless POST).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" and not p.endswith("/cancel")
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_openapi_operations_never_answer_5xx(
    gateway_schema: BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    """schemathesis-generated cases (schema-conforming and schema-violating) for every
    operation of /openapi.json: no 5xx, and 4xx bodies are OpenAI error objects."""
    operation = gateway_schema[path][method]
    base_url = gateway_schema.get_base_url()

    @settings(
        max_examples=SCHEMATHESIS_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if method == "POST":
            case.body = _cap(case.body)
        reply = case.call(base_url=base_url, timeout=60)
        if _no_embedding_worker(path, reply):
            return
        assert reply.status_code < 500, f"{method} {path} -> {reply.status_code}: {reply.text[:500]}"
        _assert_error_shape(reply, path)

    run()


VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
    "/tokenize": {"model": MODEL_NAME, "prompt": "hi"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1, 2]},
    "/v1/embeddings": {"model": MODEL_NAME, "input": "hi"},
    "/v1/responses": {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
}
FIELDS: dict[str, list[str]] = {
    "/v1/chat/completions": [
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
        "seed",
        "logit_bias",
        "chat_template_kwargs",
        "priority",
        "stop_token_ids",
    ],
    "/v1/completions": ["model", "prompt", "max_tokens", "echo", "logprobs", "suffix", "stream", "n", "stop"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "return_token_strs"],
    "/detokenize": ["model", "tokens"],
    "/v1/embeddings": ["model", "input", "encoding_format", "dimensions"],
    "/v1/responses": [
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "temperature",
        "store",
        "previous_response_id",
        "stream",
    ],
    "/v1/messages": [
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "top_k",
        "tools",
        "tool_choice",
        "stream",
    ],
    "/v1/messages/count_tokens": ["model", "messages", "system", "tools", "tool_choice"],
}
ROUTES = sorted(VALID_BODIES)

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FUZZ = settings(
    max_examples=HYPOTHESIS_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


def _post(
    mesh: RunningMesh, route: str, content: bytes, content_type: str = "application/json"
) -> httpx.Response:
    return httpx.post(
        mesh.gateway_url + route, content=content, headers={"Content-Type": content_type}, timeout=60
    )


def _check(route: str, reply: httpx.Response) -> None:
    if _no_embedding_worker(route, reply):
        return
    assert reply.status_code < 500, f"{route} -> {reply.status_code}: {reply.text[:500]}"
    _assert_error_shape(reply, route)


@FUZZ
@given(route=st.sampled_from(ROUTES), data=st.data())
def test_mutated_bodies_never_answer_5xx(mesh: RunningMesh, route: str, data: st.DataObject) -> None:
    """A valid body with one field replaced by arbitrary JSON (or a non-finite number)."""
    body = dict(VALID_BODIES[route])
    name = data.draw(st.sampled_from(FIELDS[route]), label="field")
    body[name] = data.draw(_json | st.sampled_from(["NaN", "Infinity", "-Infinity"]), label="value")
    text = json.dumps(_cap(body))
    for token in ("NaN", "Infinity", "-Infinity"):
        text = text.replace(f'"{token}"', token)  # raw non-finite numbers (json extension)
    _check(route, _post(mesh, route, text.encode()))


@FUZZ
@given(route=st.sampled_from(ROUTES), value=_json)
def test_arbitrary_json_bodies_never_answer_5xx(mesh: RunningMesh, route: str, value: Any) -> None:
    """Any JSON value as the whole body."""
    _check(route, _post(mesh, route, json.dumps(_cap(value)).encode()))


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    raw=st.binary(max_size=200),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_non_json_bodies_never_answer_5xx(
    mesh: RunningMesh, route: str, raw: bytes, content_type: str
) -> None:
    """Random bytes (invalid UTF-8 included) with assorted content types."""
    _check(route, _post(mesh, route, raw, content_type))


def test_deeply_nested_json_is_a_400(mesh: RunningMesh) -> None:
    """A pathologically nested body does not blow the gateway's stack."""
    nested = "[" * 100_000 + "]" * 100_000
    body = '{"model": "tiny", "messages": ' + nested + "}"
    reply = _post(mesh, "/v1/chat/completions", body.encode())
    assert reply.status_code == 400, reply.text[:500]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    # The body cannot be parsed at all, so no field can be named as the offending one.
    assert error["param"] is None, error
    assert httpx.get(mesh.gateway_url + "/health", timeout=10).status_code == 200
