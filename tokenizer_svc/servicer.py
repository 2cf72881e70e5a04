"""Tokenizer gRPC servicer: a thin proto ↔ domain layer over `Renderer`.

CPU-heavy work (chat templates, image decoding, long tokenize/decode) and file reads run
in worker threads via `asyncio.to_thread` so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from meshserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.errors import NotFound, Unavailable
from services.proto_mirror import mirrored
from services.rpc import rpc_handler
from tokenizer_svc.messages import parse_json
from tokenizer_svc.renderer import Renderer, RenderResult
from tokenizer_svc.tokenizer_files import FileChunk, read_chunks, tokenizer_files

log = logging.getLogger(__name__)

SERVICE = "meshserve.v1.Tokenizer"


def _render_pb(result: RenderResult) -> tokenizer_pb2.RenderResponse:
    return tokenizer_pb2.RenderResponse(
        prompt_token_ids=result.prompt_token_ids,
        prompt_text=result.prompt_text,
        mm_items=[mirrored(common_pb2.MultiModalItem, item) for item in result.mm_items],
    )


def _chunk_pb(chunk: FileChunk) -> tokenizer_pb2.TokenizerFileChunk:
    return tokenizer_pb2.TokenizerFileChunk(
        name=chunk.name, data=chunk.data, sha256=chunk.sha256, size=chunk.size, last=chunk.last
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Serves one model's tokenizer. Calls fail with UNAVAILABLE until `set_renderer`."""

    def __init__(self, model_name: str, renderer: Renderer | None = None) -> None:
        self.model_name = model_name
        self._renderer = renderer

    def set_renderer(self, renderer: Renderer) -> None:
        self._renderer = renderer

    def _ready(self, model: str) -> Renderer:
        if model and model != self.model_name:
            raise NotFound(f"model {model!r} does not exist (serving {self.model_name!r})", param="model")
        if self._renderer is None:
            raise Unavailable("tokenizer is still loading")
        return self._renderer

    @rpc_handler
    async def RenderChat(
        self, request: tokenizer_pb2.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.RenderResponse:
        """Renders OpenAI chat messages (JSON) through the chat template into prompt ids,
        with image items expanded to placeholder runs in `mm_items`."""
        renderer = self._ready(request.model)
        result = await asyncio.to_thread(self._render_chat, renderer, request)
        return _render_pb(result)

    @staticmethod
    def _render_chat(renderer: Renderer, request: tokenizer_pb2.RenderChatRequest) -> RenderResult:
        return renderer.render_chat(
            messages=parse_json(request.messages_json, "messages", None),
            tools=parse_json(request.tools_json, "tools", None),
            tool_choice=parse_json(request.tool_choice_json, "tool_choice", None),
            chat_template=request.chat_template if request.HasField("chat_template") else None,
            chat_template_kwargs=parse_json(request.chat_template_kwargs_json, "chat_template_kwargs", None),
            add_generation_prompt=(
                request.add_generation_prompt if request.HasField("add_generation_prompt") else None
            ),
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
        )

    @rpc_handler
    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        """Token ids (and token strings on request) of `text`, plus max_model_len."""
        renderer = self._ready(request.model)
        ids, strs = await asyncio.to_thread(
            renderer.tokenize, request.text, request.add_special_tokens, request.return_token_strs
        )
        return tokenizer_pb2.TokenizeResponse(
            token_ids=ids, token_strs=strs, max_model_len=renderer.max_model_len
        )

    @rpc_handler
    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        """The text of `token_ids` (INVALID_ARGUMENT naming token_ids for unknown ids)."""
        renderer = self._ready(request.model)
        text = await asyncio.to_thread(
            renderer.detokenize, list(request.token_ids), request.skip_special_tokens
        )
        return tokenizer_pb2.DetokenizeResponse(text=text)

    @rpc_handler
    async def GetTokenizerInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        """Vocabulary size, EOS ids, context length, whether a chat template exists and the
        image placeholder of a vision model."""
        renderer = self._ready(request.model)
        info = tokenizer_pb2.TokenizerInfo(
            model=self.model_name,
            vocab_size=renderer.vocab_size,
            eos_token_ids=renderer.eos_token_ids,
            max_model_len=renderer.max_model_len,
            has_chat_template=renderer.has_chat_template,
        )
        image = renderer.image_token
        if image is not None:
            info.image_token_id, info.image_token = image.token_id, image.token
        return info

    @rpc_handler
    async def GetTokenizer(
        self, request: tokenizer_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.TokenizerFileChunk]:
        """Streams the served model's tokenizer files (those of TOKENIZER_FILE_NAMES that
        exist, in that order), each in chunks of at most 1 MiB. Every chunk names its file;
        a file's last chunk has `last=true`, the hex sha256 of the whole file and its size.
        NOT_FOUND for another model, UNAVAILABLE while the tokenizer is loading."""
        renderer = self._ready(request.model)
        paths = await asyncio.to_thread(tokenizer_files, renderer.model_dir)
        for path in paths:
            chunks = read_chunks(path)
            # One chunk per thread hop: reads never block the loop, and since grpc aio waits
            # for each write, a slow client costs about one chunk of memory, not a file.
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield _chunk_pb(chunk)
