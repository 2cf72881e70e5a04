"""The engine's side of a KV hand-off (P/D disaggregation): blocks held for export on a
prefill engine, blocks imported as prefix-cache blocks on a decode engine.

Prefill side: a prefill-only request (``transfer_id``) that finished keeps its blocks
pinned here (`hold`) until its transfer is released -- pulled to the end, released
explicitly, or ``ttl_s`` after it finished. A pull in progress is a *reader*: a release
while it reads is deferred to the reader's end, so no block of a transfer is freed (and
reused) while its bytes are still being read.

Decode side: `reserve_import` pins, before the prefill runs elsewhere, a block for each
full block of the prompt (the one cached here already, or an empty one), so a hand-off
never lacks room after the prefill worker did its work. `import_blocks` checks layout,
checksums and hashes (``kv_transfer``), then places each block under its hash (into the
reserved block, or one cached meanwhile) so the decode request's normal prefix lookup
finds it; `release_import` unpins them once the request holds them itself (or never came).

Everything here runs on the engine thread, except `manifest`, `begin_export` and
`read_blocks`, which the prefill worker's servicer calls from its own threads: the
manifest is made when the transfer is held, and a reader is counted under a lock, so an
answer and a pull never wait for the engine's step in progress (docs/design-decisions.md,
"P/D deadlines from estimates"). Blocks are freed on the engine thread alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.clock import Clock
from services.kv_hash import block_hashes
from worker_svc.engine.block_manager import BlockManager
from worker_svc.engine.kv_transfer import (
    KvBlockPayload,
    KvLayout,
    KvTransferError,
    block_checksum,
    verify_checksums,
)
from worker_svc.engine.request import Request
from worker_svc.engine.token_rate import TokenRate

__all__ = ["ExportManifest", "KvHandoff"]


@dataclass(frozen=True)
class ExportManifest:
    """What a held transfer offers: its full prompt blocks (those a decode engine can use
    as prefix-cache hits), their hashes, and the first token the prefill sampled."""

    transfer_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    first_token_id: int


@dataclass
class _Held:
    request: Request
    manifest: ExportManifest
    expires_at: float
    readers: int = 0
    released: bool = False


@dataclass
class _Import:
    block_ids: list[int] = field(default_factory=list)  # the prompt's blocks imported so far
    # Reserved before the prefill ran elsewhere (`reserve_import`): blocks already cached
    # here by index (pinned, nothing to write), and empty blocks for the others.
    cached: dict[int, int] = field(default_factory=dict)
    empty: list[int] = field(default_factory=list)

    def pinned(self) -> list[int]:
        """Every block this import holds a reference to."""
        return [*self.block_ids, *self.cached.values(), *self.empty]


@dataclass(eq=False)
class KvHandoff:
    """Held transfers and pinned imports of one engine."""

    block_manager: BlockManager
    read_block: Callable[[int], bytes]
    write_block: Callable[[int, bytes], None]
    # What this engine's blocks hold; a worker names its served model here.
    layout: KvLayout
    ttl_s: float
    clock: Clock = time.monotonic
    held: dict[str, _Held] = field(default_factory=dict, init=False)
    # Readers and releases of `held`, across threads.
    _held_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    imports: dict[str, _Import] = field(default_factory=dict, init=False)
    # Prompt tokens per second of recent imports, pull included (fed by the worker's
    # importer, which times the pull): a decoder reports it for P/D's estimates.
    import_rate: TokenRate = field(default_factory=TokenRate, init=False)

    # ------------------------------------------------------------ prefill side
    def hold(self, request: Request) -> None:
        """Keep a finished prefill-only request's blocks for its transfer."""
        assert request.transfer_id is not None
        manifest = self._make_manifest(request)
        with self._held_lock:
            self.held[request.transfer_id] = _Held(request, manifest, self.clock() + self.ttl_s)

    def begin_export(self, transfer_id: str) -> ExportManifest:
        """Start reading a held transfer (one more reader); KeyError when it is unknown.
        Any thread."""
        with self._held_lock:
            held = self._live(transfer_id)
            held.readers += 1
            return held.manifest

    def manifest(self, transfer_id: str) -> ExportManifest:
        """What a held transfer offers; KeyError when it is unknown or released. Any thread."""
        with self._held_lock:
            return self._live(transfer_id).manifest

    def _live(self, transfer_id: str) -> _Held:
        held = self.held.get(transfer_id)
        if held is None or held.released:
            raise KeyError(transfer_id)
        return held

    def _make_manifest(self, request: Request) -> ExportManifest:
        assert request.transfer_id is not None
        bs = self.block_manager.block_size
        # The blocks a decode request of this prompt can hit (its last token is never a hit).
        count = (request.num_prompt_tokens - 1) // bs
        hashes = self.block_manager.ensure_hashes(request, count)[:count]
        return ExportManifest(
            request.transfer_id,
            tuple(request.block_table[:count]),
            tuple(hashes),
            request.num_prompt_tokens,
            request.output_token_ids[0] if request.output_token_ids else -1,
        )

    def read_blocks(self, manifest: ExportManifest, start: int, count: int) -> list[KvBlockPayload]:
        """Blocks ``start .. start+count`` of a transfer being read, with their checksums."""
        payloads = []
        for index in range(start, min(start + count, len(manifest.block_ids))):
            data = self.read_block(manifest.block_ids[index])
            payloads.append(KvBlockPayload(index, manifest.block_hashes[index], data, block_checksum(data)))
        return payloads

    def end_export(self, transfer_id: str, complete: bool) -> None:
        """A reader ended; a complete pull releases the transfer (pull-complete)."""
        with self._held_lock:
            held = self.held.get(transfer_id)
            if held is None:
                return
            held.readers = max(0, held.readers - 1)
            if complete:
                held.released = True
            if held.released and held.readers == 0:
                self._free(transfer_id)

    def release(self, transfer_id: str) -> bool:
        """Release a held transfer now, or when its last reader ends; False when unknown."""
        with self._held_lock:
            held = self.held.get(transfer_id)
            if held is None:
                return False
            held.released = True
            if held.readers == 0:
                self._free(transfer_id)
            return True

    def expire(self) -> int:
        """Release transfers held past their TTL; returns how many."""
        now = self.clock()
        due = [tid for tid, held in list(self.held.items()) if held.expires_at <= now and not held.released]
        for transfer_id in due:
            self.release(transfer_id)
        return len(due)

    def _free(self, transfer_id: str) -> None:
        held = self.held.pop(transfer_id)
        self.block_manager.free(held.request)

    # ------------------------------------------------------------- decode side
    def import_blocks(
        self,
        import_id: str,
        layout: KvLayout,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        payloads: Sequence[KvBlockPayload],
        checksummed: bool = False,
    ) -> int:
        """Verify, then pin ``payloads`` (the next blocks of the prompt, in order) under
        ``import_id``; returns how many blocks the import holds. KvTransferError on any
        mismatch (nothing of this call pinned) or when the cache has no free block."""
        mismatch = self.layout.mismatch(layout)
        if mismatch is not None:
            raise KvTransferError("layout", f"KV layout differs from this engine's: {mismatch}")
        pinned = self.imports.setdefault(import_id, _Import()).block_ids
        hashes = self._expected_hashes(token_ids, extra_keys, len(pinned) + len(payloads))
        for offset, payload in enumerate(payloads):
            self._verify(payload, len(pinned) + offset, hashes, layout.block_bytes)
        if not checksummed:
            verify_checksums(payloads)
        bs = layout.block_size
        entry = self.imports[import_id]
        for payload in payloads:
            i = payload.index
            block_id, fresh = self._place(
                entry,
                i,
                payload.block_hash,
                hashes[i - 1] if i else None,
                list(token_ids[i * bs : (i + 1) * bs]),
            )
            if fresh:
                self.write_block(block_id, payload.data)
            pinned.append(block_id)
        return len(pinned)

    def reserve_import(self, import_id: str, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> int:
        """Room for the KV of the prompt's full blocks under ``import_id``, before it is
        computed elsewhere: returns how many blocks were reserved. KvTransferError
        ("import") when the cache lacks the free blocks (nothing reserved)."""
        if import_id in self.imports:
            raise ValueError(f"import {import_id!r} exists already")
        bs = self.block_manager.block_size
        hashes = block_hashes(token_ids[: (len(token_ids) - 1) // bs * bs], bs, extra_keys)
        entry = _Import()
        for index, block_hash in enumerate(hashes):
            block_id = self.block_manager.pin_cached(block_hash)
            if block_id is not None:
                entry.cached[index] = block_id
        empty = self.block_manager.reserve(len(hashes) - len(entry.cached))
        if empty is None:
            self.block_manager.unpin(list(entry.cached.values()))
            raise KvTransferError(
                "import", f"{len(hashes) - len(entry.cached)} free KV blocks needed for the prompt's KV"
            )
        entry.empty = empty
        self.imports[import_id] = entry
        return len(hashes)

    def _place(
        self, entry: _Import, index: int, block_hash: int, parent: int | None, token_ids: list[int]
    ) -> tuple[int, bool]:
        """The block block ``index`` goes into and whether its KV must be written."""
        if index in entry.cached:
            return entry.cached.pop(index), False
        if entry.empty:  # its reserved room, handed back for `import_block` to take
            self.block_manager.unpin([entry.empty.pop()])
        placed = self.block_manager.import_block(block_hash, parent, token_ids)
        if placed is None:
            raise KvTransferError("import", f"no free KV block for imported block {index}")
        return placed

    def _expected_hashes(
        self, token_ids: Sequence[int], extra_keys: tuple[str, ...], count: int
    ) -> list[int]:
        bs = self.block_manager.block_size
        if count > (len(token_ids) - 1) // bs:
            raise KvTransferError("hash", f"{count} blocks offered for a prompt of {len(token_ids)} tokens")
        return block_hashes(token_ids[: count * bs], bs, extra_keys)

    @staticmethod
    def _verify(payload: KvBlockPayload, index: int, hashes: list[int], block_bytes: int) -> None:
        if payload.index != index:
            raise KvTransferError("hash", f"block {payload.index} arrived where block {index} was due")
        if payload.block_hash != hashes[index]:
            raise KvTransferError("hash", f"block {index}: hash differs from this prompt's")
        if len(payload.data) != block_bytes:
            raise KvTransferError(
                "layout", f"block {index}: {len(payload.data)} bytes, layout says {block_bytes}"
            )
        if block_checksum(payload.data) != payload.checksum:
            raise KvTransferError("checksum", f"block {index}: checksum mismatch")

    def release_import(self, import_id: str) -> None:
        """Unpin an import's blocks (they stay cached under their hashes until evicted)."""
        entry = self.imports.pop(import_id, None)
        if entry is not None:
            self.block_manager.unpin(entry.pinned())
