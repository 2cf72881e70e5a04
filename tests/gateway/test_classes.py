"""Priority classes (gateway/classes.py): a request's service_tier becomes the priority and
queue timeout the scheduler sees, a key's class is its ceiling, bad names are 400s naming
the field (as each SDK's own error), bad config is refused at start naming the option;
admissions, queued time and tokens are counted per tenant and class."""

from __future__ import annotations

import anthropic
import openai
import pytest
from gateway_fakes import MODEL, Harness
from prometheus_client import REGISTRY

from gateway.classes import Classes, parse_classes, parse_key_classes
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.middleware import ANONYMOUS

MESSAGES = [{"role": "user", "content": "hi"}]
CLASSES = parse_classes(GatewayConfig().classes)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_default_classes_and_the_sdks_tier_names() -> None:
    classes = Classes(CLASSES, {})
    resolved = {
        tier: classes.resolve("t", tier, 0) for tier in (None, "auto", "priority", "flex", "sheddable")
    }
    assert {t: (r.name, r.priority, r.queue_timeout_s) for t, r in resolved.items()} == {
        None: ("default", 0, None),
        "auto": ("default", 0, None),
        "priority": ("interactive", 10, None),  # the mesh runs higher first: vLLM's -10
        "flex": ("batch", -10, None),
        "sheddable": ("sheddable", -20, 0.0),
    }
    assert classes.resolve("t", "standard_only", 0).name == "default"  # Anthropic's tier name
    # vLLM's own priority field still works when no class is asked for, not over one.
    assert classes.resolve("t", None, 5).priority == -5
    assert classes.resolve("t", "batch", 5).priority == -10
    with pytest.raises(APIError) as unknown:
        classes.resolve("t", "gold", 0)
    assert unknown.value.status == 400 and unknown.value.param == "service_tier"


def test_a_key_s_class_is_its_default_and_its_ceiling() -> None:
    classes = Classes(CLASSES, {"batch-key": "batch"})
    assert classes.resolve("batch-key", None, 0).name == "batch"
    assert classes.resolve("batch-key", "sheddable", 0).name == "sheddable"  # later is allowed
    for tier, priority, field in (("interactive", 0, "service_tier"), (None, -50, "priority")):
        with pytest.raises(APIError) as above:
            classes.resolve("batch-key", tier, priority)
        assert above.value.status == 400 and above.value.param == field
    assert classes.resolve("other", "interactive", 0).name == "interactive"  # no class: no ceiling


def test_bad_class_config_is_refused_naming_the_option() -> None:
    assert parse_classes(("default=0", "gold=-5/2.5"))["gold"].queue_timeout_s == 2.5
    for entries in (("default=x",), ("default=0", "a=1/-1"), ("default=0", "a=1/x"), ("a=1",), ("default",)):
        with pytest.raises(ValueError, match="classes"):
            parse_classes(entries)
    with pytest.raises(ValueError, match="reserved tier name"):
        parse_classes(("default=0", "flex=3"))
    with pytest.raises(ValueError, match="key_classes: unknown class 'gold'"):
        GatewayConfig(api_keys=("k1",), key_classes=("k1=gold",))
    with pytest.raises(ValueError, match="key_classes: a key that is not one of"):
        parse_key_classes(("k2=batch",), ("k1",), CLASSES)
    with pytest.raises(ValueError, match="classes"):
        GatewayConfig(classes=("default=0", "batch=ten"))


def test_the_scheduler_sees_each_class_and_each_sdk_its_error(harness: Harness) -> None:
    gw = harness.start_gateway(harness.config(api_keys=("k1", "k2"), key_classes=("k2=batch",)))
    try:
        chat = openai.OpenAI(base_url=gw.url + "/v1", api_key="k1", max_retries=0)
        seen = []
        chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, service_tier="flex")  # type: ignore[arg-type]
        seen.append(harness.scheduler.requests[-1])
        chat.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"service_tier": "sheddable"}
        )
        seen.append(harness.scheduler.requests[-1])
        chat.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="priority")
        seen.append(harness.scheduler.requests[-1])
        assert [(r.priority, r.HasField("queue_timeout_s"), r.queue_timeout_s) for r in seen] == [
            (-10, False, 0.0),
            (-20, True, 0.0),
            (10, False, 0.0),
        ]
        with pytest.raises(openai.BadRequestError) as unknown:
            chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, service_tier="gold")  # type: ignore[arg-type]
        assert unknown.value.param == "service_tier"
        claude = anthropic.Anthropic(base_url=gw.url, api_key="k2", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="service_tier"):
            claude.messages.create(
                model=MODEL, max_tokens=2, messages=MESSAGES, extra_body={"service_tier": "interactive"}
            )  # type: ignore[arg-type]
        claude.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES, service_tier="auto")  # type: ignore[arg-type]
        assert harness.scheduler.requests[-1].priority == -10  # k2's own class: batch
    finally:
        harness.stop_gateway(gw)


def test_admissions_queued_time_and_tokens_per_tenant_and_class(harness: Harness) -> None:
    gw = harness.start_gateway(harness.config())
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        labels = {"tenant": ANONYMOUS, "class": "batch"}
        admitted = metric("meshserve_gateway_admissions_total", **labels, outcome="admitted")
        overloaded = metric("meshserve_gateway_admissions_total", **labels, outcome="overloaded")
        queued = metric("meshserve_gateway_queued_seconds_count", **labels)
        tokens = metric("meshserve_gateway_tenant_tokens_total", **labels)
        answer = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, extra_body={"service_tier": "batch"}
        )
        with pytest.raises(openai.RateLimitError):  # the scheduler's queue is full
            client.completions.create(
                model=MODEL, prompt="OVERLOAD", max_tokens=3, extra_body={"service_tier": "batch"}
            )
        assert metric("meshserve_gateway_admissions_total", **labels, outcome="admitted") == admitted + 1
        assert metric("meshserve_gateway_admissions_total", **labels, outcome="overloaded") == overloaded + 1
        assert metric("meshserve_gateway_queued_seconds_count", **labels) == queued + 1
        assert answer.usage is not None
        assert metric("meshserve_gateway_tenant_tokens_total", **labels) == tokens + answer.usage.total_tokens
    finally:
        harness.stop_gateway(gw)
