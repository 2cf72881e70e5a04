"""Deterministic in-process fake Tokenizer, Scheduler and Worker gRPC services (no model)
and a harness that runs them, plus gateways under test, on an event loop in a
background thread so tests can use the synchronous `openai` and `httpx` clients.

Fake tokenizer: a REAL byte-level BPE tokenizer without merges, built at import with the
`tokenizers` library: byte b is token b + 10, ids 1 and 2 are the special tokens "<s>"
and "</s>" (EOS), 0 and 3..9 are unused fillers (vocabulary of 266). ASCII text is one
token per character (id = code point + 10); other text is one token per UTF-8 byte, so
a character may span several tokens (the gateway's detokenizer must hold partial
characters back). `GetTokenizer` streams its files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json) in small chunks with sha256 + size on
each file's last chunk, as the tokenizer service does; the gateway loads them with
transformers.AutoTokenizer. Chat rendering is `<|role|>content\n` per message plus
`<|assistant|>`.

Fake scheduler: a route on the gateway's RouteStream leases a registered fake worker (the
first one in `route_first` order, then registration order, skipping
`exclude_worker_ids` and workers marked down); records every RouteRequest, lease and
released lease (a stream message's `release`).

Fake workers: tests/fake_worker.py's `FakeWorker` (`keyword_worker`) serving the fake
model with the keyword script (`KeywordScript`): the output text of choice i depends on
keywords in the prompt (see `keyword_text`); one token per choice per step, finish STOP
(stop token 2) or LENGTH at max_tokens (16 when unset), usage with cached_tokens=3 on the
last message. An abort ends the request with a final FINISH_REASON_ABORT message;
request-level failures go out as `RequestError`s. Records every added request and every
abort. Each is served by the harness and registered with the fake scheduler.

Prompt keywords: TOOL, JSON, SLOW (200 ticks, 20 ms per step), UNICODE (non-ASCII
text), ENDLESS (the usual text, then a slow endless tail: only an abort or max_tokens
ends it), CRASH (RequestError INTERNAL after 3 tokens), WORKER_ABORTS (the worker aborts
the request by itself after its first token), WORKER_MOVES (the worker ends it as moved
after 3 tokens, unless it is resumed), OVERLOAD (the route answers
RESOURCE_EXHAUSTED), WORKER_REFUSES (RequestError INVALID_ARGUMENT naming top_k),
GRAMMAR_REFUSED (INVALID_ARGUMENT naming structured_outputs, as a worker refusing a constraint),
EVICTED (the first add of a request id fails FAILED_PRECONDITION, as when image
embeddings were evicted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from gateway.__main__ import server_config
from gateway.app import create_app
from gateway.config import GatewayConfig
from meshserve.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.errors import Code, status_number
from services.rpc import PARAM_METADATA_KEY
from tests.fake_worker import FakeWorker, Plan, Refusal

T = TypeVar("T")

BOS, EOS = 1, 2
MODEL = "tiny"
EMBED_MODEL = "embed-tiny"
MAX_MODEL_LEN = 256
CACHED_TOKENS = 3
BYTE_OFFSET = 10
VOCAB_SIZE = 256 + BYTE_OFFSET
DEFAULT_WORKER = "fake-worker-0"
# GetTokenizer chunk size: small, so every file spans several chunks.
TOKENIZER_CHUNK_BYTES = 4096
HELLO = "Hello from choice {index}! The quick brown fox jumps over the lazy dog."
UNICODE_TEXT = "Grüße, 世界! 🎉 naïve café — ∑ 👩‍💻"
# ENDLESS: tokens after this many come every SLOW_STEP_S (an abort arrives long before).
ENDLESS_FAST_TOKENS = 40
SLOW_STEP_S = 0.02
# A keyword worker's seconds between steps, and its max_tokens of a request that sets none.
STEP_DELAY_S = 0.001
DEFAULT_MAX_TOKENS = 16


# ----------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what ByteLevel pre-tokenizes into)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> Tokenizer:
    """The fake model's tokenizer: byte-level BPE without merges, byte b = id b + 10."""
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS}
    vocab.update({f"<reserved_{i}>": i for i in range(3, BYTE_OFFSET)})
    vocab.update({char: b + BYTE_OFFSET for b, char in _bytes_to_unicode().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    # Prompts encoded with special tokens start with BOS, like Llama's (the gateway renders
    # completion prompts with these files).
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    return tokenizer


TOKENIZER = build_tokenizer()


def write_tokenizer_files(directory: Path) -> list[Path]:
    """Writes the fake model's tokenizer files (what GetTokenizer streams) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    TOKENIZER.save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    return [
        directory / name for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    ]


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens): its UTF-8 bytes + 10."""
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def decode(ids: list[int], skip_special: bool = True) -> str:
    """The tokenizer's decode; special tokens render as <s> / </s> unless skipped."""
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=skip_special))


def file_chunks(
    path: Path, chunk_bytes: int = TOKENIZER_CHUNK_BYTES
) -> Iterator[tokenizer_pb2.TokenizerFileChunk]:
    """`path` as GetTokenizer chunks: the last one has `last`, the sha256 and the size."""
    data = path.read_bytes()
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    for i, piece in enumerate(pieces):
        chunk = tokenizer_pb2.TokenizerFileChunk(name=path.name, data=piece)
        if i == len(pieces) - 1:
            chunk.last, chunk.size, chunk.sha256 = True, len(data), hashlib.sha256(data).hexdigest()
        yield chunk


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """The fake model's tokenizer service; records RenderChat requests and GetTokenizer
    calls. `corrupt_files` makes GetTokenizer send a wrong sha256."""

    def __init__(self, files_dir: Path) -> None:
        self.files = write_tokenizer_files(files_dir)
        self.last_render: tokenizer_pb2.RenderChatRequest | None = None
        self.get_tokenizer_calls = 0
        self.corrupt_files = False
        # Seconds GetTokenizer waits before its first chunk (single-flight tests).
        self.get_tokenizer_delay_s = 0.0

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

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        ids = ([BOS] if request.add_special_tokens else []) + encode(request.text)
        strs = [str(TOKENIZER.id_to_token(i)) for i in ids] if request.return_token_strs else []
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, token_strs=strs, max_model_len=MAX_MODEL_LEN)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        ids = list(request.token_ids)
        if any(not 0 <= i < VOCAB_SIZE for i in ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: outside the vocabulary")
        return tokenizer_pb2.DetokenizeResponse(text=decode(ids, request.skip_special_tokens))

    async def GetTokenizerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model, context)
        return tokenizer_pb2.TokenizerInfo(
            model=request.model, vocab_size=VOCAB_SIZE, eos_token_ids=[EOS], max_model_len=MAX_MODEL_LEN
        )

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The tokenizer files, each in chunks, sha256 + size on its last chunk."""
        self.get_tokenizer_calls += 1
        await self._check_model(request.model, context)
        if self.get_tokenizer_delay_s:
            await asyncio.sleep(self.get_tokenizer_delay_s)
        for path in self.files:
            for chunk in file_chunks(path):
                if chunk.last and self.corrupt_files:
                    chunk.sha256 = "0" * 64
                yield chunk


# ----------------------------------------------------------------------- scheduler


def _param(name: str) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming the request field at fault (as services.rpc sends it)."""
    return ((PARAM_METADATA_KEY, name),)


@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Leases on the registered fake workers; records routes, leases and releases."""

    # Prefix of the lease ids (several fake replicas never issue the same id).
    name: str = "sched"
    # worker_id -> address, in registration order.
    workers: dict[str, str] = field(default_factory=dict)
    # Workers a route tries first (in this order), then the others.
    route_first: list[str] = field(default_factory=list)
    # Workers listed unhealthy and never routed to.
    down: set[str] = field(default_factory=set)
    routes: list[scheduler_pb2.RouteRequest] = field(default_factory=list)
    # lease_id -> (request_id, worker_id)
    leases: dict[str, tuple[str, str]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    # lease id -> LeaseOutcome the gateway released it with
    outcomes: dict[str, Any] = field(default_factory=dict)
    release_calls: list[list[str]] = field(default_factory=list)
    # ListWorkers calls answered or waiting; while `list_workers_gate` is set to an
    # unset Event, ListWorkers waits for it (a scheduler slow to list its workers).
    list_workers_calls: int = 0
    list_workers_gate: asyncio.Event | None = None
    # ListWorkers lists the embedding worker and its model first (as a real scheduler may).
    embedding_first: bool = False
    _lease_ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def requests(self) -> list[common_pb2.GenerateRequest]:
        """The GenerateRequest of every route."""
        return [route.request for route in self.routes]

    def routes_of(self, request_id: str) -> list[scheduler_pb2.RouteRequest]:
        """Routes for `request_id`, in order."""
        return [route for route in self.routes if route.request.request_id == request_id]

    def leases_of(self, request_id: str) -> list[str]:
        """Lease ids issued for `request_id`, in order."""
        return [lease for lease, (rid, _w) in self.leases.items() if rid == request_id]

    async def RouteStream(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """The gateway's route stream: each route answered at once, in order."""
        async for message in request_iterator:
            if message.HasField("release"):
                self._record_release(message.release)
            if not message.HasField("route"):
                continue
            reply = scheduler_pb2.RouteStreamResponse(call_id=message.call_id)
            answer = self._route(message.route)
            if isinstance(answer, tuple):
                status, text, param = answer
                reply.error.CopyFrom(
                    scheduler_pb2.RouteError(code=status_number(Code(status.name)), message=text, param=param)
                )
            else:
                reply.route.CopyFrom(answer)
            yield reply

    def _route(self, request: Any) -> Any:
        """The lease for one RouteRequest, or (status, message, param) when refused."""
        self.routes.append(scheduler_pb2.RouteRequest.FromString(request.SerializeToString()))
        generate = request.request
        if not generate.model:
            return grpc.StatusCode.INVALID_ARGUMENT, "model is required", "model"
        if generate.model != MODEL:
            return (
                grpc.StatusCode.NOT_FOUND,
                f"model '{generate.model}' is not served by any decoder",
                "model",
            )
        if not generate.prompt_token_ids:
            return grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids must not be empty", "prompt"
        if "OVERLOAD" in decode(list(generate.prompt_token_ids)):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "scheduler queue is full", ""
        excluded = set(request.exclude_worker_ids) | self.down
        order = [w for w in self.route_first if w in self.workers] + list(self.workers)
        worker_id = next((w for w in order if w not in excluded), None)
        if worker_id is None:
            return grpc.StatusCode.UNAVAILABLE, "no healthy decoder worker", ""
        request_id = generate.request_id or uuid.uuid4().hex
        lease_id = f"{self.name}-lease-{next(self._lease_ids)}"
        self.leases[lease_id] = (request_id, worker_id)
        return scheduler_pb2.RouteResponse(
            request_id=request_id,
            lease_id=lease_id,
            worker_id=worker_id,
            worker_address=self.workers[worker_id],
            mm_items=generate.mm_items,
            lease_ttl_ms=60_000,
            reason="fake",
        )

    def _note_outcomes(self, outcomes: Any) -> list[str]:
        """Records leases released with their outcome (actual cached tokens); their ids."""
        for outcome in outcomes:
            self.outcomes[outcome.lease_id] = outcome
        return [outcome.lease_id for outcome in outcomes]

    def _record_release(self, request: Any) -> None:
        """Records a route stream message's `release`."""
        ids = list(request.lease_ids) + self._note_outcomes(request.outcomes)
        self.release_calls.append(ids)
        self.released.extend(ids)

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
        self.list_workers_calls += 1
        if self.list_workers_gate is not None:
            await self.list_workers_gate.wait()
        workers = [
            scheduler_pb2.WorkerStatus(
                worker=scheduler_pb2.WorkerDescriptor(
                    worker_id=worker_id,
                    address=address,
                    role=worker_pb2.WORKER_ROLE_DECODER,
                    model=MODEL,
                    max_model_len=MAX_MODEL_LEN,
                ),
                healthy=worker_id not in self.down,
                load=worker_pb2.LoadStats(),
            )
            for worker_id, address in self.workers.items()
        ]
        embedding = scheduler_pb2.WorkerStatus(
            worker=scheduler_pb2.WorkerDescriptor(
                worker_id="emb-0", role=worker_pb2.WORKER_ROLE_EMBEDDING, model=EMBED_MODEL
            ),
            healthy=True,
        )
        if self.embedding_first:
            return scheduler_pb2.ListWorkersResponse(
                workers=[embedding, *workers], models=[EMBED_MODEL, MODEL]
            )
        return scheduler_pb2.ListWorkersResponse(workers=[*workers, embedding], models=[MODEL, EMBED_MODEL])


# -------------------------------------------------------------------------- worker


def keyword_text(prompt: str, index: int) -> str:
    """Output text of choice `index` for a prompt (the keyword script)."""
    if "TOOL" in prompt:
        return 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    if "JSON" in prompt:
        return '{"answer": 42}' if index == 0 else "not json"
    if "SLOW" in prompt:
        return "tick " * 200
    if "UNICODE" in prompt:
        return UNICODE_TEXT
    text = HELLO.format(index=index)
    if "ENDLESS" in prompt:
        text += " and on" * 300
    return text


@dataclass
class KeywordPlan(Plan):
    """A request run by the keyword script: its text, failures and pace by prompt keywords."""

    prompt: str
    stop_token_id = EOS

    def tokens(self, index: int) -> Iterable[int]:
        """The tokens of `keyword_text`, then STOP."""
        return encode(keyword_text(self.prompt, index))

    def failure(self, position: int) -> Refusal | None:
        """CRASH: INTERNAL after 3 tokens."""
        if "CRASH" in self.prompt and position >= 3:
            return Refusal(grpc.StatusCode.INTERNAL, "worker crashed")
        return None

    def aborts(self, position: int) -> bool:
        """WORKER_ABORTS: the worker aborts the request by itself after its first token."""
        return "WORKER_ABORTS" in self.prompt and position >= 1

    def moves(self, position: int) -> bool:
        """WORKER_MOVES: the worker ends the request as moved after 3 tokens."""
        return "WORKER_MOVES" in self.prompt and position >= 3

    def pause_s(self, position: int, delay: float) -> float:
        """SLOW, and ENDLESS past its fast part: SLOW_STEP_S per step."""
        slow = "SLOW" in self.prompt or ("ENDLESS" in self.prompt and position >= ENDLESS_FAST_TOKENS)
        return SLOW_STEP_S if slow else delay


@dataclass
class KeywordScript:
    """The gateway suite's script for a fake worker (one per worker: EVICTED remembers)."""

    # request ids whose first add was refused as EVICTED
    evicted: set[str] = field(default_factory=set)

    def __call__(self, request: common_pb2.GenerateRequest) -> Plan | Refusal:
        """The keyword plan of `request`, or the refusal its keywords ask for."""
        prompt = decode(list(request.prompt_token_ids))
        if "WORKER_REFUSES" in prompt:
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "top_k: refused by the worker", "top_k")
        if "GRAMMAR_REFUSED" in prompt:  # as the real worker names a constraint it cannot build
            return Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "the grammar could not be built", "structured_outputs"
            )
        if "EVICTED" in prompt and request.request_id not in self.evicted:
            self.evicted.add(request.request_id)
            return Refusal(grpc.StatusCode.FAILED_PRECONDITION, "image embeddings were evicted")
        return KeywordPlan(prompt)


def keyword_worker(worker_id: str, **options: Any) -> FakeWorker:
    """A fake worker of the fake model run by the keyword script (options: FakeWorker's)."""
    settings: dict[str, Any] = {
        "script": KeywordScript(),
        "model": MODEL,
        "tokens": DEFAULT_MAX_TOKENS,
        "delay": STEP_DELAY_S,
        "cached_tokens": CACHED_TOKENS,
    }
    return FakeWorker(worker_id, **{**settings, **options})


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


@dataclass
class WorkerHandle:
    """A fake worker and its server."""

    worker: FakeWorker
    server: FakeServer

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Polls `predicate` until true or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


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
        self.tmp = Path(tempfile.mkdtemp(prefix="gateway-harness-"))
        self.tokenizer = FakeTokenizer(self.tmp / "tokenizer-files")
        self.scheduler = FakeScheduler()
        self.tok_server = self.run(
            start_fake(self.tokenizer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server)
        )
        self.sched_server = self.run(
            start_fake(self.scheduler, scheduler_pb2_grpc.add_SchedulerServicer_to_server)
        )
        self.workers: dict[str, WorkerHandle] = {}
        default = self.start_worker(DEFAULT_WORKER)
        self.worker, self.worker_server = default.worker, default.server
        self.gateways: list[RunningGateway] = []
        self._cache_dirs = itertools.count()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Runs a coroutine on the harness loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def config(self, **overrides: Any) -> GatewayConfig:
        """A gateway config pointing at the fakes (its own tokenizer cache directory)."""
        values: dict[str, Any] = {
            "port": 0,
            "tokenizer_address": self.tok_server.address,
            "scheduler_address": self.sched_server.address,
            "tokenizer_cache_dir": str(self.tmp / f"tokenizer-cache-{next(self._cache_dirs)}"),
        }
        values.update(overrides)
        return GatewayConfig(**values)

    # -- workers ------------------------------------------------------------------

    def start_worker(self, worker_id: str, **options: Any) -> WorkerHandle:
        """Starts a fake worker and registers it with the fake scheduler."""
        worker = keyword_worker(worker_id, **options)
        server = self.run(start_fake(worker, worker_pb2_grpc.add_WorkerServicer_to_server))
        handle = self.workers[worker_id] = WorkerHandle(worker, server)
        self.scheduler.workers[worker_id] = server.address
        return handle

    def kill_worker(self, handle: WorkerHandle) -> None:
        """Stops the worker's server at once (its streams break); it stays registered."""
        self.run(handle.server.server.stop(0))

    def remove_worker(self, handle: WorkerHandle) -> None:
        """Stops the worker and unregisters it."""
        self.kill_worker(handle)
        self.scheduler.workers.pop(handle.worker_id, None)
        self.scheduler.down.discard(handle.worker_id)
        with contextlib.suppress(ValueError):
            self.scheduler.route_first.remove(handle.worker_id)
        self.workers.pop(handle.worker_id, None)

    @contextlib.contextmanager
    def extra_worker(
        self, worker_id: str, route_first: bool = True, **options: Any
    ) -> Iterator[WorkerHandle]:
        """A fake worker for one test (routed to first by default), removed afterwards."""
        handle = self.start_worker(worker_id, **options)
        if route_first:
            self.scheduler.route_first.insert(0, worker_id)
        try:
            yield handle
        finally:
            self.remove_worker(handle)

    # -- gateways -----------------------------------------------------------------

    def start_gateway(self, config: GatewayConfig) -> RunningGateway:
        """Starts `create_app(config)` under uvicorn on an ephemeral port."""
        return self.run(self._start_gateway(config))

    def start_app(self, app: Any) -> RunningGateway:
        """Serves an already built gateway app (see start_gateway)."""
        return self.run(self._serve(app))

    async def _start_gateway(self, config: GatewayConfig) -> RunningGateway:
        return await self._serve(create_app(config), config)

    async def _serve(self, app: Any, config: GatewayConfig | None = None) -> RunningGateway:
        """Serves `app` with the gateway's own uvicorn settings for `config` (uvicorn's
        defaults without one), quieter and with a short final grace."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        quiet = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 1}
        settings = uvicorn.Config(app, **quiet) if config is None else server_config(app, config, **quiet)
        server = _QuietServer(settings)
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
        with contextlib.suppress(ValueError):
            self.gateways.remove(gateway)

    async def _stop_gateway(self, gateway: RunningGateway) -> None:
        gateway.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await gateway.task

    @contextlib.contextmanager
    def gateway(self, **overrides: Any) -> Iterator[RunningGateway]:
        """A gateway for one test (config overrides as `config`), stopped afterwards."""
        gateway = self.start_gateway(self.config(**overrides))
        try:
            yield gateway
        finally:
            self.stop_gateway(gateway)

    def close(self) -> None:
        """Stops every gateway, the fakes and the loop."""
        for gateway in list(self.gateways):
            with contextlib.suppress(Exception):
                self.stop_gateway(gateway)
        for handle in list(self.workers.values()):
            with contextlib.suppress(Exception):
                self.run(handle.server.server.stop(0))
        self.run(self.tok_server.server.stop(0))
        self.run(self.sched_server.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        shutil.rmtree(self.tmp, ignore_errors=True)
