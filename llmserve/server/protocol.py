"""OpenAI wire format: pydantic models of the requests we accept and the responses we send.

Field names, defaults and shapes follow the OpenAI API (and vLLM's extensions: top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids). Values the engine checks itself
(finite floats, penalties, seeds, token ids...) are validated by `SamplingParams` and the engine, so
the rules live in one place; here only types and OpenAI's own limits (temperature <= 2, n <= 128).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat

# --- requests ---------------------------------------------------------------------------------


def _json_integer(value: Any) -> Any:
    """JSON's integer: never a boolean or a string, which pydantic's lax int would take (`"n": true` as 1)."""
    if isinstance(value, bool | str):
        raise ValueError("must be an integer")
    return value


# A request's numbers as JSON types them: a boolean or a string is refused (400), not read as 1 or 0.
Integer = Annotated[int, BeforeValidator(_json_integer)]
Number = StrictFloat  # an integer or a float


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaSpec(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra parameter: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class KVTransferParams(BaseModel):
    """vLLM's `kv_transfer_params`, the fields of disaggregated prefill and decode (server/kv_transfer.py)."""

    model_config = ConfigDict(extra="ignore")

    do_remote_decode: StrictBool = False  # this request is a prefill for another instance
    do_remote_prefill: StrictBool = False  # the prompt's KV waits at `remote_url`: pull it first
    remote_url: str | None = None


class KVBlocksRequest(BaseModel):
    """`POST /v1/kv/blocks`: the KV blocks a decode instance pulls, by their hashes and tokens."""

    model_config = ConfigDict(extra="forbid")

    block_hashes: list[str] = Field(max_length=1 << 16)  # hexadecimal, the prompt's leading blocks in order
    token_ids: list[Integer] = Field(max_length=1 << 22)  # those blocks' tokens, for the collision check
    # "shm": the asker is on this host; the bytes go into a shared-memory file it reads and removes
    transport: Literal["tcp", "shm"] = "tcp"


class _SamplingRequest(BaseModel):
    """Fields chat and completions share. Unknown fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the first served model name
    max_tokens: Integer | None = None
    temperature: Number = Field(default=1.0, ge=0, le=2)  # OpenAI's range
    top_p: Number = Field(default=1.0, le=1)
    top_k: Integer = -1
    min_p: Number = 0.0
    seed: Integer | None = None
    stop: str | list[str] | None = None
    n: Integer = Field(default=1, ge=1, le=128)
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Integer = 0
    stop_token_ids: list[Integer] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    user: str | None = None
    cache_salt: str | None = None  # as vLLM: requests with different salts never share prefix-cache blocks
    kv_transfer_params: KVTransferParams | None = None  # disaggregated prefill and decode
    logit_bias: dict[str, Number] | None = None  # OpenAI's: token ids (as text) -> bias in [-100, 100]
    # Structured outputs: OpenAI's response_format, or vLLM's extra parameters (its current spelling,
    # structured_outputs, and the older guided_* names); at most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first parameter asking for what this server cannot give: refused with a 400
        rather than ignored, since the answer would not be what the client asked for."""
        return None


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's format)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: StrictBool = False
    top_logprobs: Integer | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: StrictBool = True
    # OpenAI parameters for what this server does not produce: refused (400) unless absent or neutral, since
    # the answer would not be what the client asked for. Hints that leave the answer as it is (store, metadata,
    # service_tier, prediction, reasoning_effort, prompt_cache_key, ...) are accepted and ignored.
    modalities: list[str] | None = None  # ["text"] only
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "modalities: only ['text'] is supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        if self.functions is not None or self.function_call is not None:
            return ("functions" if self.functions is not None else "function_call",
                    "the deprecated functions API is not supported; use tools and tool_choice")
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported"
        return None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Integer] | list[list[Integer]]
    max_tokens: Integer | None = 16  # the legacy API's default (OpenAI and vLLM)
    logprobs: Integer | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    prompt_logprobs: Integer | None = Field(default=None, ge=0, le=20)  # vLLM's: each prompt token's, k more
    suffix: str | None = None  # not supported; accepted only when absent
    best_of: Integer | None = None  # supported only when equal to n

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs is served on non-streamed completions only"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is supported only when equal to n"
        return None


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings request."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[Integer] | list[list[Integer]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Integer | None = None
    user: str | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API request: its items are checked where they become a chat (serving_responses.py)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    max_output_tokens: Integer | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, le=1)
    seed: Integer | None = None
    stream: StrictBool = False
    store: StrictBool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: StrictBool | None = None


# --- responses --------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": ..., "content": ...}, {"content": ...}, {"tool_calls": [...]} or {} on the last chunk
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None  # sent (null until the last chunk) only with include_usage


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's shape: per prompt token (None for the first) its logprob and the k most likely, by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # on stream chunks: sent (null until the last) only with include_usage


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ResponseObject(BaseModel):
    """OpenAI's Responses API response (documented here by its main fields; built in serving_responses.py)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: str  # "ok" (200); "loading", "failed", "shutting down" or "engine stopped" (503)


class VersionInfo(BaseModel):
    version: str
