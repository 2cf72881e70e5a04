"""Error paths over raw HTTP: every error is an OpenAI error object with the right
status and `param`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_fakes import EMBED_MODEL, MODEL, Harness, wait_for

from gateway.middleware import tenant_of
from services.ports import free_port

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(reply: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """Checks the status and the OpenAI error shape; returns the error object."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_invalid_fields_are_400_naming_the_param(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, **extra}
    error = assert_error(http.post(CHAT, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_nan_and_missing_and_bad_json(http: httpx.Client) -> None:
    raw = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    reply = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(reply, 400, "temperature")
    error = assert_error(http.post(CHAT, json={"model": MODEL}), 400, "messages")
    assert error["code"] == "missing_required_parameter"
    reply = http.post(CHAT, content="{not json", headers={"content-type": "application/json"})
    assert assert_error(reply, 400)["code"] == "invalid_json"


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "frobnicate": 1, "store": True}
    assert http.post(CHAT, json=body).status_code == 200


def test_context_length(http: httpx.Client) -> None:
    long_messages = [{"role": "user", "content": "x" * 300}]
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": long_messages}), 400, "messages")
    assert "maximum context length is 256 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 250}), 400)
    assert error["param"] == "max_tokens"
    assert "asks for 250 completion tokens" in error["message"]
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "y" * 256})
    assert_error(reply, 400, "prompt")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    error = assert_error(http.post(CHAT, json={"model": "nope", "messages": MESSAGES}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(http.get("/v1/models/nope"), 404, "model")
    assert_error(http.get("/no/such/route"), 404)


def assert_released(harness: Harness, request_id: str) -> None:
    """Every lease issued for `request_id` went back to the scheduler (Release)."""
    leases = harness.scheduler.leases_of(request_id)
    assert leases, f"no lease was issued for {request_id}"
    assert wait_for(lambda: set(leases) <= set(harness.scheduler.released)), f"leases {leases} not released"


def test_upstream_errors_map_to_http(http: httpx.Client, harness: Harness) -> None:
    bad = [{"role": "user", "content": "BAD_TEMPLATE"}]
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": bad}), 400)
    assert "template rejected" in error["message"]
    overload = [{"role": "user", "content": "OVERLOAD"}]
    routes = len(harness.scheduler.routes)
    error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": overload}), 429)
    assert "queue is full" in error["message"]
    assert len(harness.scheduler.routes) == routes + 1  # refused by Route, not retried
    # Streaming keeps the HTTP status when the scheduler fails before the first token.
    body = {"model": MODEL, "messages": overload, "stream": True}
    assert_error(http.post(CHAT, json=body), 429)
    # Route: a model that no decoder serves (the embedding model is listed) → 404 naming it.
    error = assert_error(http.post(CHAT, json={"model": EMBED_MODEL, "messages": MESSAGES}), 404, "model")
    assert "not served" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_worker_refusal_names_the_field(http: httpx.Client, harness: Harness, stream: bool) -> None:
    """A RequestError from the worker (INVALID_ARGUMENT naming a field) before any token
    is answered with its HTTP status and `param`, streaming or not; the lease goes back."""
    refused = [{"role": "user", "content": "WORKER_REFUSES"}]
    reply = http.post(CHAT, json={"model": MODEL, "messages": refused, "stream": stream})
    error = assert_error(reply, 400, "top_k")
    assert "refused by the worker" in error["message"]
    request_id = harness.worker.last_request.request_id
    assert len(harness.scheduler.routes_of(request_id)) == 1  # a client error is not rerouted
    assert_released(harness, request_id)


def test_midstream_failure_is_an_error_event_then_done(http: httpx.Client, harness: Harness) -> None:
    """The worker fails the request (RequestError INTERNAL) after 3 tokens: the stream
    ends with an error event and [DONE]; no reroute (tokens were sent); lease released."""
    crash = [{"role": "user", "content": "CRASH"}]
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": crash, "stream": True}) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["message"] == "worker: worker crashed"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hel"
    request_id = chunks[0]["id"]
    assert len(harness.scheduler.routes_of(request_id)) == 1
    assert_released(harness, request_id)
    assert_error(http.post(CHAT, json={"model": MODEL, "messages": crash}), 500)
    assert_released(harness, harness.worker.last_request.request_id)


def test_upstream_deadline_is_504(harness: Harness) -> None:
    """request_timeout_s bounds the whole generation: a request still running at the
    deadline is answered 504 (an error event once streaming), aborted on the worker,
    and its lease released."""
    with harness.gateway(request_timeout_s=1.5) as gw, httpx.Client(base_url=gw.url, timeout=20) as http:
        # Warm up (the first request also fetches and loads the tokenizer).
        assert (
            http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).status_code == 200
        )
        slow = [{"role": "user", "content": "SLOW"}]
        error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": slow}), 504)
        assert error["type"] == "timeout_error" and "timed out after 1.5s" in error["message"]
        request_id = harness.worker.last_request.request_id
        assert wait_for(lambda: request_id in harness.worker.aborted), "the worker never saw the abort"
        assert request_id not in harness.worker.completed
        assert_released(harness, request_id)
        with http.stream("POST", CHAT, json={"model": MODEL, "messages": slow, "stream": True}) as reply:
            assert reply.status_code == 200
            events = [line for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "timeout_error"
        request_id = json.loads(events[0].removeprefix("data: "))["id"]
        assert wait_for(lambda: request_id in harness.worker.aborted)
        assert_released(harness, request_id)


def test_api_keys_and_rate_limit(harness: Harness) -> None:
    gw = harness.start_gateway(
        harness.config(api_keys=("k1", "k2"), rate_limit_rps_per_key=0.5, rate_limit_burst=2)
    )
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            assert_error(http.get("/v1/models"), 401)
            error = assert_error(http.get("/v1/models", headers={"Authorization": "Bearer bad"}), 401)
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # no key needed
            ok = {"Authorization": "Bearer k1"}
            reply = http.post(CHAT, headers=ok, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
            assert reply.status_code == 200
            assert harness.scheduler.requests[-1].tenant == tenant_of("k1")
            assert harness.worker.last_request.tenant == tenant_of("k1")
            assert http.get("/v1/models", headers=ok).status_code == 200
            limited = http.get("/v1/models", headers=ok)  # burst of 2 used up
            assert_error(limited, 429)
            assert int(limited.headers["retry-after"]) >= 1
            # Buckets are per key.
            assert http.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    finally:
        harness.stop_gateway(gw)


def test_body_size_limit(harness: Harness) -> None:
    gw = harness.start_gateway(harness.config(max_request_bytes=2048))
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            big = [{"role": "user", "content": "z" * 4096}]
            error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": big}), 413)
            assert error["code"] == "request_too_large"
            small = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
            assert http.post(CHAT, json=small).status_code == 200
    finally:
        harness.stop_gateway(gw)


def test_upstream_down_is_503(harness: Harness) -> None:
    dead = f"127.0.0.1:{free_port()}"
    gw = harness.start_gateway(harness.config(tokenizer_address=dead, scheduler_address=dead))
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES}), 503)
            assert error["message"].startswith("scheduler")
            assert_error(http.get("/v1/models"), 503)
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json()["components"]["tokenizer"] == "down"
            assert health.json()["components"]["scheduler"] == "down"
    finally:
        harness.stop_gateway(gw)
    # Only the tokenizer down: the model check passes, rendering fails with 503.
    gw = harness.start_gateway(harness.config(tokenizer_address=dead))
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as http:
            error = assert_error(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES}), 503)
            assert error["message"].startswith("tokenizer")
    finally:
        harness.stop_gateway(gw)


def test_health_follows_upstream_health(http: httpx.Client, harness: Harness) -> None:
    reply = http.get("/health")
    assert reply.status_code == 200
    assert reply.json()["status"] == "ok" and reply.json()["components"]["decoder_workers"] == 1
    harness.run(harness.tok_server.set_serving(False))
    try:
        reply = http.get("/health")
        assert reply.status_code == 503 and reply.json()["components"]["tokenizer"] == "down"
        assert "tokenizer" in reply.json()["message"]
    finally:
        harness.run(harness.tok_server.set_serving(True))
    harness.scheduler.down = set(harness.scheduler.workers)
    try:
        reply = http.get("/health")
        assert reply.status_code == 503 and reply.json()["components"]["decoder_workers"] == 0
    finally:
        harness.scheduler.down = set()
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize(http: httpx.Client) -> None:
    reply = http.post("/tokenize", json={"model": MODEL, "prompt": "ab", "return_token_strs": True})
    assert reply.status_code == 200
    assert reply.json() == {
        "count": 3,
        "max_model_len": 256,
        "tokens": [1, 107, 108],
        "token_strs": ["<s>", "a", "b"],
    }
    reply = http.post("/tokenize", json={"messages": MESSAGES})
    assert reply.json()["count"] == len("<|user|>hi\n<|assistant|>")
    assert reply.json()["token_strs"] is None
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [107, 108]}).json() == {"prompt": "ab"}
    assert_error(http.post("/tokenize", json={"model": MODEL}), 400, "prompt")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens[0]")


def test_metrics_and_openapi(http: httpx.Client) -> None:
    http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3})
    text = http.get("/metrics").text
    assert 'meshserve_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    for name in (
        "meshserve_gateway_time_to_first_token_seconds_bucket",
        "meshserve_gateway_time_per_output_token_seconds_bucket",
        "meshserve_gateway_inter_token_latency_seconds_bucket",
        "meshserve_gateway_request_duration_seconds_bucket",
        "meshserve_gateway_requests_in_flight",
    ):
        assert name in text
    spec = http.get("/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ChatCompletionResponse"
    )
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    for status in ("400", "401", "404", "429", "503"):
        assert chat["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
            "ErrorResponse"
        )
    assert "422" not in chat["responses"]
    for path in ("/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in spec["paths"]
