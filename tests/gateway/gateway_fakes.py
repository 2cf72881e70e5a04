"""Deterministic in-process fake Tokenizer and Scheduler gRPC services (no model) and a
harness that runs them, plus gateways under test, on an event loop in a background
thread so tests can use the synchronous `openai` and `httpx` clients.

Fake tokenizer: one token per character, id = code point + 10; ids 1 and 2 are the
special tokens "<s>" and "</s>" (EOS). Chat rendering is `<|role|>content\n` per
message plus `<|assistant|>`.

Fake scheduler: the output text of choice i depends on keywords in the prompt (see
`FakeScheduler.script`); one token per choice per step, finish STOP (stop token 2)
or LENGTH at max_tokens, usage with cached_tokens=3 on the last message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.config import GatewayConfig
from meshserve.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
)

T = TypeVar("T")

BOS, EOS = 1, 2
SPECIAL = {BOS: "<s>", EOS: "</s>"}
MODEL = "tiny"
EMBED_MODEL = "embed-tiny"
MAX_MODEL_LEN = 256
CACHED_TOKENS = 3


def encode(text: str) -> list[int]:
    """Character-level token ids."""
    return [ord(c) + 10 for c in text]


def decode(ids: list[int], skip_special: bool = True) -> str:
    """Inverse of `encode`; special tokens render as <s> / </s> unless skipped."""
    out = []
    for i in ids:
        if i in SPECIAL:
            if not skip_special:
                out.append(SPECIAL[i])
        elif i >= 10:
            out.append(chr(i - 10))
    return "".join(out)


# ----------------------------------------------------------------------- tokenizer


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Character-level tokenizer service; records the last RenderChat request."""

    def __init__(self) -> None:
        self.last_render: tokenizer_pb2.RenderChatRequest | None = None
        self.detok_streams = 0

    async def _check_model(self, model: str, context: grpc.aio.ServicerContext) -> None:
        if model not in (MODEL, EMBED_MODEL):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {model}")

    async def RenderChat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        self.last_render = request
        messages = json.loads(request.messages_json)
        parts = []
        for message in messages:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if content == "BAD_TEMPLATE":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "messages[0]: template rejected the message"
                )
            parts.append(f"<|{message['role']}|>{content}\n")
        if not request.HasField("add_generation_prompt") or request.add_generation_prompt:
            parts.append("<|assistant|>")
        ids = encode("".join(parts))
        if request.add_special_tokens:
            ids = [BOS, *ids]
        return tokenizer_pb2.RenderResponse(prompt_token_ids=ids, prompt_text="".join(parts))

    async def RenderCompletion(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        if request.WhichOneof("prompt") == "token_ids":
            ids = list(request.token_ids.ids)
            return tokenizer_pb2.RenderResponse(prompt_token_ids=ids, prompt_text="")
        ids = encode(request.text)
        if request.add_special_tokens:
            ids = [BOS, *ids]
        return tokenizer_pb2.RenderResponse(prompt_token_ids=ids, prompt_text=request.text)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        ids = ([BOS] if request.add_special_tokens else []) + encode(request.text)
        strs = [decode([i], skip_special=False) for i in ids] if request.return_token_strs else []
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, token_strs=strs, max_model_len=MAX_MODEL_LEN)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        return tokenizer_pb2.DetokenizeResponse(
            text=decode(list(request.token_ids), request.skip_special_tokens)
        )

    async def GetTokenizerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        return tokenizer_pb2.TokenizerInfo(
            model=request.model, vocab_size=0x110000, eos_token_ids=[EOS], max_model_len=MAX_MODEL_LEN
        )

    async def DetokenizeStream(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """One response per `tokens`/`finish` message; holds back text that could be
        the start of a stop string; ends after a stop string or `finish`."""
        self.detok_streams += 1
        state: _DetokState | None = None
        async for message in request_iterator:
            if message.WhichOneof("kind") == "start":
                state = _DetokState(message.start)
                continue
            if state is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be start")
                return
            response = state.feed(list(message.tokens.ids), message.finish)
            yield response
            if response.stopped or message.finish:
                return


class _DetokState:
    def __init__(self, start: Any) -> None:
        self.stop = list(start.stop)
        self.include = start.include_stop_str_in_output
        self.skip = start.skip_special_tokens
        self.pending = ""
        self.num_tokens = 0
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def feed(self, ids: list[int], finish: bool) -> Any:
        out = []
        for token in ids:
            self.num_tokens += 1
            self.pending += decode([token], self.skip)
            for stop in self.stop:
                at = self.pending.find(stop)
                if at >= 0:
                    end = at + len(stop) if self.include else at
                    out.append(self.pending[:end])
                    return tokenizer_pb2.DetokenizeStreamResponse(
                        text="".join(out), stopped=True, matched_stop=stop, num_tokens=self.num_tokens
                    )
            safe = len(self.pending) - self.holdback if not finish else len(self.pending)
            if safe > 0:
                out.append(self.pending[:safe])
                self.pending = self.pending[safe:]
        if finish:
            out.append(self.pending)
            self.pending = ""
        return tokenizer_pb2.DetokenizeStreamResponse(text="".join(out), num_tokens=self.num_tokens)


# ----------------------------------------------------------------------- scheduler


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Scripted generation; records requests, aborts and cancellations."""

    requests: list[common_pb2.GenerateRequest] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)
    step_delay_s: float = 0.001
    decoders: int = 1
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    @staticmethod
    def script(prompt: str, index: int) -> str:
        """Output text of choice `index` for a prompt."""
        if "TOOL" in prompt:
            return (
                'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            )
        if "JSON" in prompt:
            return '{"answer": 42}' if index == 0 else "not json"
        if "SLOW" in prompt:
            return "tick " * 200
        return f"Hello from choice {index}! The quick brown fox jumps over the lazy dog."

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.requests.append(request)
        prompt = decode(list(request.prompt_token_ids))
        if "OVERLOAD" in prompt:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "scheduler queue is full")
        event = self._abort_events.setdefault(request.request_id, asyncio.Event())
        finished = False
        try:
            async for response in self._steps(request, prompt, event):
                yield response
            finished = True
        finally:
            # Cancellation shows as CancelledError or, when it hits while grpc writes a
            # response, as GeneratorExit at the yield.
            (self.completed if finished else self.cancelled).add(request.request_id)

    async def _steps(self, request: Any, prompt: str, aborted: asyncio.Event) -> AsyncIterator[Any]:
        sampling = request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        delay = 0.02 if "SLOW" in prompt else self.step_delay_s
        outputs = [encode(self.script(prompt, i)) for i in range(n)]
        positions = [0] * n
        done = [False] * n
        first = True
        while not all(done):
            if "CRASH" in prompt and positions[0] >= 3:
                await asyncio.sleep(0)
                raise RuntimeError("worker crashed")
            if aborted.is_set():
                deltas = [
                    common_pb2.SequenceDelta(index=i, finish_reason=common_pb2.FINISH_REASON_ABORT)
                    for i in range(n)
                    if not done[i]
                ]
                yield self._last(request, deltas, positions)
                return
            deltas = [self._delta(request, outputs[i], positions, done, i) for i in range(n) if not done[i]]
            response = common_pb2.GenerateResponse(request_id=request.request_id, deltas=deltas)
            if first:
                response.worker_id, first = "fake-worker-0", False
            if all(done):
                response.usage.CopyFrom(self._usage(request, positions))
                response.finished = True
            yield response
            await asyncio.sleep(delay)

    def _delta(self, request: Any, output: list[int], positions: list[int], done: list[bool], i: int) -> Any:
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        token = output[positions[i]]
        positions[i] += 1
        delta = common_pb2.SequenceDelta(index=i, token_ids=[token])
        if sampling.HasField("logprobs"):
            top = [common_pb2.TopLogprob(token_id=token, logprob=-0.25)]
            top += [common_pb2.TopLogprob(token_id=encode("x")[0] + k, logprob=-2.0 - k) for k in range(19)]
            delta.logprobs.append(
                common_pb2.TokenLogprob(token_id=token, logprob=-0.25, top=top[: max(sampling.logprobs, 1)])
            )
        if positions[i] >= len(output):
            delta.finish_reason, delta.stop_token_id, done[i] = common_pb2.FINISH_REASON_STOP, EOS, True
        elif positions[i] >= max_tokens:
            delta.finish_reason, done[i] = common_pb2.FINISH_REASON_LENGTH, True
        return delta

    def _usage(self, request: Any, positions: list[int]) -> Any:
        return common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=sum(positions),
            cached_tokens=CACHED_TOKENS,
        )

    def _last(self, request: Any, deltas: list[Any], positions: list[int]) -> Any:
        return common_pb2.GenerateResponse(
            request_id=request.request_id, deltas=deltas, usage=self._usage(request, positions), finished=True
        )

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.aborted.add(request.request_id)
        event = self._abort_events.get(request.request_id)
        if event is not None:
            event.set()
        return common_pb2.AbortResponse(found=event is not None)

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.model != EMBED_MODEL:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{request.model} is not an embedding model"
            )
        embeddings = []
        for text in request.inputs:
            values = [float(len(text)), 1.0, 0.0]
            if request.normalize:
                norm = math.sqrt(sum(v * v for v in values))
                values = [v / norm for v in values]
            embeddings.append(common_pb2.Embedding(values=values))
        tokens = sum(len(t) for t in request.inputs)
        return common_pb2.EmbedResponse(embeddings=embeddings, prompt_tokens=tokens)

    async def ListWorkers(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        workers = [
            scheduler_pb2.WorkerStatus(
                worker=scheduler_pb2.WorkerDescriptor(
                    worker_id=f"dec-{i}", role="decoder", model=MODEL, max_model_len=MAX_MODEL_LEN
                ),
                healthy=True,
                load=worker_pb2.LoadStats(),
            )
            for i in range(self.decoders)
        ]
        workers.append(
            scheduler_pb2.WorkerStatus(
                worker=scheduler_pb2.WorkerDescriptor(worker_id="emb-0", role="embedding", model=EMBED_MODEL),
                healthy=True,
            )
        )
        return scheduler_pb2.ListWorkersResponse(workers=workers, models=[MODEL, EMBED_MODEL])


# ------------------------------------------------------------------------- harness


@dataclass
class FakeServer:
    """A started fake gRPC server with its health servicer."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)


async def start_fake(servicer: Any, add_fn: Any) -> FakeServer:
    """Serves `servicer` (plus grpc health, SERVING) on 127.0.0.1:<ephemeral>."""
    server = grpc.aio.server()
    add_fn(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake = FakeServer(server, health_servicer, f"127.0.0.1:{port}")
    await fake.set_serving(True)
    return fake


def free_port() -> int:
    """A port nothing listens on (for "upstream down" tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handling (it runs in a background thread)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@dataclass
class RunningGateway:
    """A gateway served by uvicorn in the harness loop."""

    app: Any
    server: uvicorn.Server
    task: asyncio.Task[None]
    url: str


class Harness:
    """Background event loop hosting the fakes and the gateways under test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-harness", daemon=True)
        self.thread.start()
        self.tokenizer = FakeTokenizer()
        self.scheduler = FakeScheduler()
        self.tok_server = self.run(
            start_fake(self.tokenizer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server)
        )
        self.sched_server = self.run(
            start_fake(self.scheduler, scheduler_pb2_grpc.add_SchedulerServicer_to_server)
        )
        self.gateways: list[RunningGateway] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Runs a coroutine on the harness loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def config(self, **overrides: Any) -> GatewayConfig:
        """A gateway config pointing at the fakes."""
        values: dict[str, Any] = {
            "port": 0,
            "tokenizer_address": self.tok_server.address,
            "scheduler_address": self.sched_server.address,
        }
        values.update(overrides)
        return GatewayConfig(**values)

    def start_gateway(self, config: GatewayConfig) -> RunningGateway:
        """Starts `create_app(config)` under uvicorn on an ephemeral port."""
        return self.run(self._start_gateway(config))

    async def _start_gateway(self, config: GatewayConfig) -> RunningGateway:
        app = create_app(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = _QuietServer(
            uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        )
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        gateway = RunningGateway(app, server, task, f"http://127.0.0.1:{port}")
        self.gateways.append(gateway)
        return gateway

    def stop_gateway(self, gateway: RunningGateway) -> None:
        """Stops one gateway."""
        self.run(self._stop_gateway(gateway))

    async def _stop_gateway(self, gateway: RunningGateway) -> None:
        gateway.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await gateway.task

    def close(self) -> None:
        """Stops every gateway, the fakes and the loop."""
        for gateway in list(self.gateways):
            with contextlib.suppress(Exception):
                self.stop_gateway(gateway)
        self.run(self.tok_server.server.stop(0))
        self.run(self.sched_server.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
