"""The token path on a plain TCP port (`Worker.OpenTokenStream` in worker.proto): the
messages of `GenerateStream`, framed (services.framing), one `StreamSession` per
connection -- the same session, so adds, aborts, `stream_interval`, drain and the
one-message-per-engine-step batching are the gRPC stream's.

A connection must open with a `hello` carrying this worker's ticket (handed out by the
`OpenTokenStream` RPC, i.e. only to a client that can call the worker's gRPC services);
anything else, an undecodable frame or one over the size limit closes it. `ping`s are
answered at once from the event loop. A connection that ends aborts its requests (their
KV blocks are freed), as a cancelled `GenerateStream` does; so does one that has sent
nothing for SILENCE_LIMIT_S (the client pings at least every KEEPALIVE_TIME_MS: a
silent one is hung, its requests would run for nobody).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import ssl
from collections.abc import Callable

from google.protobuf.message import DecodeError

from meshserve.v1 import worker_pb2
from services.framing import FrameConnection
from services.rpc import INFLIGHT, KEEPALIVE_TIME_MS, PING_TIMEOUT_MS
from worker_svc.stream_session import StreamSession

log = logging.getLogger(__name__)

# A client that pings every KEEPALIVE_TIME_MS and has sent nothing for this long is hung.
SILENCE_LIMIT_S = (KEEPALIVE_TIME_MS + PING_TIMEOUT_MS) / 1000


class _Peer:
    """One client connection: its frames in, its session's messages out."""

    def __init__(self, owner: TokenStreamServer) -> None:
        self._owner = owner
        # Plaintext connections may be written from the engine thread (StreamSession.write_to).
        self.conn = FrameConnection(self._on_frame, self._on_lost, owner.max_frame_bytes, thread_writes=True)
        self._session: StreamSession | None = None
        self._writer: asyncio.Task[None] | None = None
        self.last_frame = asyncio.get_running_loop().time()

    def _on_frame(self, frame: bytes) -> None:
        self.last_frame = asyncio.get_running_loop().time()
        try:
            message = worker_pb2.GenerateStreamRequest.FromString(frame)
        except DecodeError:
            self.conn.abort("an undecodable frame")
            log.warning("token stream: closed a connection that sent an undecodable frame")
            return
        kind = message.WhichOneof("kind")
        if self._session is None:
            self._greet(message, kind)
        elif kind == "ping":
            self.conn.write(worker_pb2.GenerateStreamResponse(pong=message.ping).SerializeToString())
        elif kind in ("add", "abort"):
            self._session.handle(message)

    def _greet(self, message: worker_pb2.GenerateStreamRequest, kind: str | None) -> None:
        if kind != "hello" or not hmac.compare_digest(message.hello.ticket, self._owner.ticket):
            self.conn.abort("no valid hello")
            log.warning("token stream: closed a connection without a valid hello (%s first)", kind)
            return
        self._session = self._owner.open_session()
        INFLIGHT.enter()  # a drain waits for the session as for a GenerateStream call
        self._writer = asyncio.get_running_loop().create_task(self._write(self._session))

    async def _write(self, session: StreamSession) -> None:
        """The session's messages out until it ends (drain, or the client went away)."""
        try:
            await session.write_to(self.conn)
            self.conn.close("the worker ended the stream")
        finally:
            self._owner.end_session(session)
            INFLIGHT.exit()

    def _on_lost(self, reason: str) -> None:
        self._owner.peers.discard(self)
        if self._writer is not None and not self._writer.done():
            log.info("token stream: client gone (%s); its requests are aborted", reason)
            self._writer.cancel()  # ends the session: every request on it is aborted


class TokenStreamServer:
    """Serves `OpenTokenStream` connections for a decoder's servicer."""

    def __init__(
        self,
        open_session: Callable[[], StreamSession],
        end_session: Callable[[StreamSession], None],
        max_frame_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.open_session = open_session
        self.end_session = end_session
        self.max_frame_bytes = max_frame_bytes
        self.ticket = secrets.token_bytes(16)
        self.port = 0
        self.peers: set[_Peer] = set()
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on `host`:`port` (0: any free port); returns the bound port."""
        self._server = await asyncio.get_running_loop().create_server(self._accept, host, port, ssl=self._ssl)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._watch()
        log.info("token stream listening on %s:%d%s", host, self.port, " (TLS)" if self._ssl else "")
        return self.port

    def _watch(self) -> None:
        """Every few seconds: closes the connections of clients silent for too long."""
        loop = asyncio.get_running_loop()
        for peer in list(self.peers):
            if loop.time() - peer.last_frame > SILENCE_LIMIT_S:
                log.warning("token stream: client silent for %.0f s (hung?); closing", SILENCE_LIMIT_S)
                peer.conn.abort(f"the client sent nothing for {SILENCE_LIMIT_S:g} s")
        self._watchdog = loop.call_later(min(SILENCE_LIMIT_S / 3, 5.0), self._watch)

    def _accept(self) -> FrameConnection:
        peer = _Peer(self)
        self.peers.add(peer)
        return peer.conn

    def stop_accepting(self) -> None:
        """No new connections (draining); the open ones end with their sessions."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Closes the listener and every connection (their requests are aborted)."""
        self.stop_accepting()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for peer in list(self.peers):
            peer.conn.abort("the worker stopped")
        self.peers.clear()
