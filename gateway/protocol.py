"""Pydantic v2 models of the OpenAI (and vLLM-extension) request and response objects.

Requests ignore unknown fields like OpenAI does. Per-field ranges are declared here
(FastAPI turns violations into 400s naming the field); rules that span several fields
or depend on the gateway configuration live in each request's `check()` method, which
raises `APIError` with the offending `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import APIError

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20

NonNegativeInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1)]
FinishReason = Literal["stop", "length", "tool_calls"]
ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Request(BaseModel):
    """Base of request bodies: unknown fields are ignored, NaN/inf are rejected."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    """Base of response bodies.

    A model's `object` discriminator (`"chat.completion.chunk"`, `"text_completion"`,
    ...) counts as set from construction on: SSE chunks are dumped with
    `exclude_unset=True` and OpenAI's reference (and strict clients) require it.
    """

    model_config = ConfigDict(extra="forbid")

    def model_post_init(self, context: Any, /) -> None:
        """Marks `object` as set so that `exclude_unset` dumps keep it."""
        if "object" in type(self).model_fields:
            self.__pydantic_fields_set__.add("object")


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Request):
    """`stream_options`: usage reporting of a streamed response."""

    include_usage: bool = False
    # vLLM extension: a usage object on every chunk.
    continuous_usage_stats: bool = False


class SamplingRequest(_Request):
    """Fields shared by chat completions and completions (OpenAI + vLLM extras)."""

    model: str | None = Field(None, description="Model to use; defaults to the only/first served model.")
    n: int = Field(1, ge=1, description="Number of choices; at most the gateway's --max-n.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    stop: StopString | list[StopString] | None = Field(None, description="Up to 4 stop strings.")
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, in [-100, 100]."
    )
    # vLLM extensions: token rules and structured outputs.
    allowed_token_ids: list[NonNegativeInt] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    structured_outputs: StructuredOutputs | None = None
    best_of: int | None = Field(None, ge=1, description="Only best_of == n is supported.")
    priority: int = Field(
        0,
        ge=-INT32_MAX,
        le=INT32_MAX,
        description="vLLM semantics: lower values are scheduled earlier (default 0).",
    )
    service_tier: str | None = Field(
        None, description="The request's priority class (gateway/classes.py); auto: its key's."
    )
    cache_salt: str | None = Field(
        None, description="Requests with different salts never share prefix cache."
    )
    # vLLM extension: the top-K logprobs of every prompt token (non-streamed answers only).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def stop_list(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with int keys; 400 naming the field for a bad id or value."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(
                    400, f"logit_bias value {bias} for token {key} is outside [-100, 100]", param="logit_bias"
                )
            out[int(key)] = bias
        return out

    def check(self, max_n: int) -> None:
        """Cross-field rules shared by both completion kinds (each adds its own); raises
        APIError naming the field."""
        if self.n > max_n:
            raise APIError(400, f"n must be at most {max_n}, got {self.n}", param="n", code="invalid_value")
        if len(self.stop_list()) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is enabled", param="stream_options"
            )
        self.logit_bias_ids()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise APIError(400, "min_tokens must be <= max_tokens", param="min_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )


# --------------------------------------------------------------------------- chat


class ChatMessage(BaseModel):
    """One chat message; extra keys are passed through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    """A callable function offered to the model."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    """An entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    """`{"name": ...}` of a named tool choice."""

    name: str


class NamedToolChoice(_Request):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: a named JSON schema the output must follow."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Request):
    """`response_format`: "text", "json_object" or "json_schema" (enforced while sampling)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # Only to refuse it by name: echo belongs to /v1/completions.
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the legacy `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self, max_n: int) -> None:
        """Cross-field validation; raises APIError naming the field."""
        super().check(max_n)
        if self.echo:
            raise APIError(
                400, "echo is not supported by chat completions (use /v1/completions)", param="echo"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if (
            self.response_format is not None
            and self.response_format.type == "json_schema"
            and self.response_format.json_schema is None
        ):
            raise APIError(400, "response_format json_schema needs json_schema", param="response_format")
        if (
            self.add_generation_prompt
            and self.continue_final_message
            and "add_generation_prompt" in (self.model_fields_set)
        ):
            raise APIError(
                400,
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        self._check_tools()

    def _check_tools(self) -> None:
        if self.tool_choice is None or self.tool_choice == "none":
            return
        if not self.tools:
            raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools}
            if self.tool_choice.function.name not in names:
                raise APIError(
                    400,
                    f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )

    def tools_enabled(self) -> bool:
        """Whether the output is parsed for tool calls (the model's own format)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def forced_tools(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to the
        calls' JSON (structured outputs) and always parses into tool calls."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        )


class ToolCallFunction(_Response):
    """Function name and JSON-encoded arguments of a tool call."""

    name: str
    arguments: str


class ToolCall(_Response):
    """A tool call of the assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TopLogprob(_Response):
    """One alternative token with its logprob."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class PromptLogprob(_Response):
    """vLLM's logprob of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token, None for the first (it has no context), then
# token id -> logprob for the prompt token itself and the top-K of its position.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatLogprob(_Response):
    """Logprob of one generated token with its top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    """`choices[].logprobs` of chat completions."""

    content: list[ChatLogprob] | None = None


class ChatResponseMessage(_Response):
    """The assistant message of a choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # vLLM extension: the text of a reasoning model's <think> section (--reasoning-parser).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class PromptTokensDetails(_Response):
    """Breakdown of prompt tokens."""

    cached_tokens: int = 0


class UsageInfo(_Response):
    """Token accounting of a request (prompt tokens counted once, not per choice)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatChoice(_Response):
    """A non-streamed chat choice."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM extension: the stop string or stop token id that ended the choice.
    stop_reason: int | str | None = None


class CompletionEnvelope(_Response, Generic[ChoiceT]):
    """The head every chat and text completion response and chunk starts with, in
    OpenAI's field order: the request's id, its `object` kind (each subclass fixes it),
    when and by which model it was answered, and its choices."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]


class ChatCompletionResponse(CompletionEnvelope[ChatChoice]):
    """`POST /v1/chat/completions` response (stream=false)."""

    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo
    system_fingerprint: str | None = None
    # vLLM extension, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(_Response):
    """Function part of a streamed tool call."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A streamed tool call: a header delta (index, id, type, name, arguments ""), then
    deltas with only index and arguments, as OpenAI sends them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    """`choices[].delta` of a chat chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    """A choice of a chat completion chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(CompletionEnvelope[ChatChunkChoice]):
    """One `data:` event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: UsageInfo | None = None


# --------------------------------------------------------------------- completions

TokenIds = list[NonNegativeInt]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions` body."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    # 0 only with echo: the prompt (and with logprobs, its logprobs) without generation.
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per prompt (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        # Validated: a list is all ints (one prompt of token ids), all strings or all
        # lists; its first entry says which, without a pass over every token.
        if prompt and isinstance(prompt[0], int):
            return [cast(list[int], list(prompt))]
        return cast(list[str | list[int]], list(prompt))

    def check(self, max_n: int) -> None:
        """Cross-field validation; raises APIError naming the field."""
        super().check(max_n)
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")

    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (OpenAI's scoring request).
        The engine still samples one token from the prefill's logits (vLLM does the same);
        the gateway drops it."""
        return self.echo and self.max_tokens == 0

    def engine_prompt_logprobs(self) -> int | None:
        """Top-K the engine computes per prompt token: echo with logprobs needs the
        prompt's logprobs too, with as many alternatives as the generated tokens get."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


class CompletionLogprobs(_Response):
    """`choices[].logprobs` of completions (legacy format)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    """A completion choice (also the choice of a streamed chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    # vLLM extension, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(CompletionEnvelope[CompletionChoice]):
    """`POST /v1/completions` response (stream=false)."""

    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(CompletionEnvelope[CompletionChoice]):
    """One `data:` event of a streamed completion."""

    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- embeddings


class EmbeddingRequest(_Request):
    """`POST /v1/embeddings` body (text inputs only)."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM extensions.
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    normalize: bool = True

    def texts(self) -> list[str]:
        """The inputs as a list of strings; token-id inputs raise APIError."""
        value = self.input
        if isinstance(value, str):
            texts = [value]
        elif all(isinstance(v, str) for v in value):
            texts = [v for v in value if isinstance(v, str)]
        else:
            raise APIError(400, "token id inputs are not supported for embeddings; send text", param="input")
        if not texts or any(not t for t in texts):
            raise APIError(400, "input must not be empty", param="input")
        if self.dimensions is not None:
            raise APIError(400, "dimensions is not supported by this server", param="dimensions")
        return texts


class EmbeddingData(_Response):
    """One embedding: floats, or base64 of little-endian float32 when asked."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    """Token accounting of an embedding request."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    """`POST /v1/embeddings` response."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# -------------------------------------------------------------------------- models


class ModelCard(_Response):
    """An entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    """`GET /v1/models` response."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# -------------------------------------------------------------- tokenize/detokenize


class TokenizeRequest(_Request):
    """`POST /tokenize` (vLLM): either `prompt` (completion style) or `messages` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="Default true for prompt, false for messages.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        """Exactly one of prompt and messages."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "exactly one of prompt and messages is required", param="prompt")


class TokenizeResponse(_Response):
    """`POST /tokenize` response."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """`POST /detokenize` body."""

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(_Response):
    """`POST /detokenize` response."""

    prompt: str


# ------------------------------------------------------------------ errors, health


class ErrorDetail(_Response):
    """The `error` object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Body of every error response."""

    error: ErrorDetail


class HealthResponse(_Response):
    """`GET /health`: "ok" only when every upstream component is ready."""

    status: Literal["ok", "unavailable"]
    components: dict[str, str | int]
    message: str | None = None
