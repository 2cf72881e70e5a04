"""The gateway's in-process tokenizer: detokenization without a round trip per token.

At first use of a model the gateway streams its tokenizer files from the tokenizer
service (`Tokenizer.GetTokenizer`), verifies every file's sha256 and size, stores them
in a content-addressed directory under a cache root, and loads them with
`transformers.AutoTokenizer` in a worker thread. A gateway pod therefore needs no model
volume, and each generated token costs a few microseconds of local CPU instead of a
gRPC message.

Layers: `TokenizerDownload` (files → verified directory) and `LocalTokenizer` are
grpc-free; `fetch_tokenizer_files` is the only function that touches gRPC;
`GatewayTokenizers` caches one `LocalTokenizer` per model with single-flight loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import grpc
from transformers import AutoTokenizer

from gateway.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, make_decoder
from meshserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.errors import InvalidArgument, Unavailable
from services.model_files import eos_token_ids
from services.rpc import error_from_rpc

log = logging.getLogger(__name__)

# Token strings kept per tokenizer (logprobs); a few MB at most.
TOKEN_STRING_CACHE_SIZE = 65536


class TokenizerFilesError(Unavailable):
    """The tokenizer service sent files that fail verification (bad name, hash, size or
    framing). UNAVAILABLE: the gateway cannot serve the model until a good copy arrives."""


class ChunkLike(Protocol):
    """One `TokenizerFileChunk` (the proto message or anything shaped like it)."""

    name: str
    data: bytes
    sha256: str
    size: int
    last: bool


def _check_name(name: str) -> None:
    # The name becomes a path under the cache root: a plain file name only (no
    # separators, no '..', no hidden files), so a bad server cannot write elsewhere.
    bad = (
        not name
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0"))
        or os.path.basename(name) != name
    )
    if bad:
        raise TokenizerFilesError(f"tokenizer service sent an unsafe file name {name!r}")


def files_key(digests: dict[str, tuple[str, int]]) -> str:
    """Directory name for a set of files: sha256 over the sorted (name, sha256) pairs."""
    manifest = "\n".join(f"{name}\0{sha}" for name, (sha, _size) in sorted(digests.items()))
    return hashlib.sha256(manifest.encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_directory(directory: Path, digests: dict[str, tuple[str, int]]) -> str | None:
    """None when `directory` holds exactly `digests`' files with those hashes and sizes,
    else what is wrong."""
    try:
        present = {p.name for p in directory.iterdir()}
        if present != set(digests):
            return f"files {sorted(present)} instead of {sorted(digests)}"
        for name, (sha, size) in digests.items():
            path = directory / name
            if path.stat().st_size != size or _file_sha256(path) != sha:
                return f"{name} does not match its sha256 {sha}"
    except OSError as exc:
        return f"unreadable: {exc}"
    return None


class TokenizerDownload:
    """Receives GetTokenizer chunks into a temporary directory, verifying each file, then
    publishes them atomically as `cache_root/<files_key>`. Blocking file I/O: callers in
    an event loop run `add` and `finish` in a thread. Use once."""

    def __init__(self, cache_root: Path) -> None:
        self._root = cache_root
        self._root.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self._root))
        self._digests: dict[str, tuple[str, int]] = {}
        self._name = ""
        self._file: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._size = 0

    def add(self, chunk: ChunkLike) -> None:
        """Writes one chunk; verifies the file on its last chunk."""
        file = self._file
        if file is None:
            file = self._open(chunk.name)
        elif chunk.name != self._name:
            raise TokenizerFilesError(f"{chunk.name!r} started before {self._name!r} ended")
        file.write(chunk.data)
        self._hash.update(chunk.data)
        self._size += len(chunk.data)
        if chunk.last:
            self._file = None
            self._close(file, chunk.sha256, chunk.size)

    def _open(self, name: str) -> IO[bytes]:
        _check_name(name)
        if name in self._digests:
            raise TokenizerFilesError(f"tokenizer service sent {name!r} twice")
        self._name, self._hash, self._size = name, hashlib.sha256(), 0
        self._file = (self._tmp / name).open("xb")
        return self._file

    def _close(self, file: IO[bytes], sha256: str, size: int) -> None:
        with file:
            file.flush()
            # Durable before the rename publishes it: a crash must not leave a cached copy
            # that fails verification on the next start.
            os.fsync(file.fileno())
        actual = self._hash.hexdigest()
        if actual != sha256.lower() or self._size != size:
            raise TokenizerFilesError(
                f"{self._name}: received {self._size} bytes with sha256 {actual}, "
                f"expected {size} bytes with sha256 {sha256!r}"
            )
        self._digests[self._name] = (actual, size)

    def finish(self) -> Path:
        """Publishes the verified files; returns their directory (an existing verified copy
        is reused; a cached copy that fails verification is replaced)."""
        if self._file is not None:
            raise TokenizerFilesError(f"the stream ended inside {self._name!r}")
        if not self._digests:
            raise TokenizerFilesError("the tokenizer service sent no files")
        target = self._root / files_key(self._digests)
        failure: OSError | None = None
        # Retried: another process may publish or retire `target` between our steps.
        for _attempt in range(3):
            if target.is_dir():
                problem = verify_directory(target, self._digests)
                if problem is None:
                    self.discard()
                    return target
                log.warning("replacing corrupt cached tokenizer %s: %s", target, problem)
                self._retire(target)
            try:
                # Atomic publish; fails when `target` (re)appeared meanwhile.
                self._tmp.rename(target)
            except OSError as exc:
                failure = exc
                continue
            return target
        raise TokenizerFilesError(f"cannot publish tokenizer files to {target}: {failure}")

    def _retire(self, target: Path) -> None:
        trash = Path(tempfile.mkdtemp(prefix=".stale-", dir=self._root))
        with contextlib.suppress(FileNotFoundError):
            target.rename(trash / "old")
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self) -> None:
        """Removes the temporary directory (after success or failure)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self._tmp, ignore_errors=True)


async def fetch_tokenizer_files(
    stub: tokenizer_pb2_grpc.TokenizerStub, model: str, cache_root: Path, timeout: float
) -> Path:
    """Streams `model`'s tokenizer files (GetTokenizer, `timeout` seconds for the whole
    stream) into a verified, content-addressed directory under `cache_root`; returns it.

    Raises TokenizerFilesError for files that fail verification and the peer's error as
    a MeshError (`services.rpc.error_from_rpc`: NOT_FOUND for an unknown model, ...).
    """
    download = await asyncio.to_thread(TokenizerDownload, cache_root)
    try:
        call = stub.GetTokenizer(tokenizer_pb2.GetTokenizerRequest(model=model), timeout=timeout)
        async for chunk in call:
            await asyncio.to_thread(download.add, chunk)
        return await asyncio.to_thread(download.finish)
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc) from exc
    finally:
        await asyncio.to_thread(download.discard)


class LocalTokenizer:
    """One model's Hugging Face tokenizer in the gateway process (thread-safe reads)."""

    def __init__(self, tokenizer: Any, directory: Path) -> None:
        self.tokenizer = tokenizer
        self.directory = directory
        self.vocab_size: int = len(tokenizer)
        self.eos_token_ids = self._eos_token_ids(directory, tokenizer)
        self._decode_single = make_decoder(tokenizer, skip_special_tokens=False)
        self._token_string = functools.lru_cache(maxsize=TOKEN_STRING_CACHE_SIZE)(self._single)

    @classmethod
    def load(cls, directory: Path) -> LocalTokenizer:
        """Loads the tokenizer files in `directory` (blocking, ~0.1-1 s: run in a thread)."""
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        # The first encode may reset truncation/padding left in tokenizer.json (a mutation
        # of the Rust tokenizer); do it before any threads share the tokenizer.
        tokenizer.encode("warm up")
        return cls(tokenizer, directory)

    @staticmethod
    def _eos_token_ids(directory: Path, tokenizer: Any) -> list[int]:
        # The tokenizer service's rule, from the same module.
        return eos_token_ids(directory, tokenizer.eos_token_id)

    def detokenizer(
        self,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> IncrementalDetokenizer:
        """An incremental detokenizer for one generated sequence (see
        gateway.detokenizer). Only the prompt's last few ids are used, as decoding
        context; they must be in the vocabulary (InvalidArgument naming prompt_token_ids).
        Generated ids pushed later are not checked: they come from the model."""
        tail = [int(i) for i in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        bad = next((i for i in tail if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompt_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})",
                param="prompt_token_ids",
            )
        return IncrementalDetokenizer(
            self.tokenizer, tail, skip_special_tokens, list(stop), include_stop_str_in_output
        )

    def _single(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            return ""  # what a full decode yields for an unknown id
        return self._decode_single([token_id])

    def token_strings(self, ids: Iterable[int]) -> dict[int, str]:
        """The text of each id on its own (`decode([id], skip_special_tokens=False,
        clean_up_tokenization_spaces=False)`, so a partial character shows as U+FFFD);
        '' for ids outside the vocabulary.
        Cached (LRU, TOKEN_STRING_CACHE_SIZE entries)."""
        return {int(i): self._token_string(int(i)) for i in ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The text of `ids`, exactly as the tokenizer service's Detokenize decodes it."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


class GatewayTokenizers:
    """The gateway's `LocalTokenizer` per model, fetched from the tokenizer service on
    first use. Concurrent first requests share one load (single flight); a failed load
    is not cached, so the next request retries."""

    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerStub,
        cache_root: Path,
        timeout: float,
        base_model: Callable[[str], str] = lambda model: model,
    ) -> None:
        self._stub = stub
        self._cache_root = cache_root
        self._timeout = timeout
        # A LoRA adapter's name -> its base model, whose tokenizer it uses.
        self._base_model = base_model
        self._loaded: dict[str, LocalTokenizer] = {}
        self._loading: dict[str, asyncio.Task[LocalTokenizer]] = {}

    def cached(self, model: str) -> LocalTokenizer | None:
        """The loaded tokenizer of `model`, or None (no I/O; for hot paths)."""
        return self._loaded.get(self._base_model(model))

    async def get(self, model: str) -> LocalTokenizer:
        """`model`'s tokenizer, loading it on first use. Errors as fetch_tokenizer_files."""
        model = self._base_model(model)
        loaded = self._loaded.get(model)
        if loaded is not None:
            return loaded
        task = self._loading.get(model) or self._start_load(model)
        # Shielded: a caller that goes away (client disconnect) must not cancel the load
        # the other callers wait for.
        return await asyncio.shield(task)

    def prefetch(self, model: str) -> None:
        """Starts loading `model`'s tokenizer unless it is loaded or loading (no wait; a
        failure is logged, and the next `get` tries again)."""
        model = self._base_model(model)
        if model not in self._loaded and model not in self._loading:
            self._start_load(model)

    async def _load(self, model: str) -> LocalTokenizer:
        directory = await fetch_tokenizer_files(self._stub, model, self._cache_root, self._timeout)
        tokenizer = await asyncio.to_thread(LocalTokenizer.load, directory)
        self._loaded[model] = tokenizer
        log.info("tokenizer of %s loaded from %s (vocab %d)", model, directory, tokenizer.vocab_size)
        return tokenizer

    def _start_load(self, model: str) -> asyncio.Task[LocalTokenizer]:
        task = asyncio.create_task(self._load(model), name=f"load-tokenizer-{model}")
        self._loading[model] = task
        task.add_done_callback(functools.partial(self._loaded_or_failed, model))
        return task

    def _loaded_or_failed(self, model: str, task: asyncio.Task[LocalTokenizer]) -> None:
        if self._loading.get(model) is task:
            del self._loading[model]
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here so a load whose callers all left is logged, not "never retrieved".
            log.warning("loading the tokenizer of %s failed: %s", model, task.exception())
