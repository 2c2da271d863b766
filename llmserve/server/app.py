"""The FastAPI app: lifespan (load the engine off the event loop, shut it down gracefully) and thin routes.

The engine loads in a worker thread after the app starts, so /health answers 503 while it loads
and 200 once it serves; the routes only parse, check readiness and hand over to `serving_*`. A registered
sentence-embedding model (`llmserve serve all-minilm-l6-v2`) is served instead of an engine: /v1/embeddings,
and a clear 400 from the text-generation routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware

from llmserve import __version__
from llmserve.embeddings import Embedder
from llmserve.engine.async_engine import AsyncLLM, ServingStats
from llmserve.loader.default_models import embedding_model
from llmserve.server.config import ServerConfig
from llmserve.server.errors import APIError, install_handlers
from llmserve.server.kv_transfer import KVTransfer
from llmserve.server.metrics import CONTENT_TYPE, ServerMetrics
from llmserve.server.middleware import GateMiddleware, RequestBodyMiddleware, RequestIdMiddleware
from llmserve.server.openapi import (
    API_ERRORS,
    MODEL_ERRORS,
    OPEN_ERRORS,
    STORED_ERRORS,
    complete_openapi,
    json_or_sse,
)
from llmserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    HealthStatus,
    KVBlocksRequest,
    ModelCard,
    ModelList,
    ResponseObject,
    ResponsesRequest,
    VersionInfo,
)
from llmserve.server.serving_chat import OpenAIServingChat
from llmserve.server.serving_completion import OpenAIServingCompletion
from llmserve.server.serving_embedding import OpenAIServingEmbedding
from llmserve.server.serving_engine import ModelInfo, check_model
from llmserve.server.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)


class ServerState:
    """What the routes need, filled in once the engine has loaded."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.llm: AsyncLLM | None = None
        self.chat: OpenAIServingChat | None = None
        self.completion: OpenAIServingCompletion | None = None
        self.embedding: OpenAIServingEmbedding | None = None
        self.responses: OpenAIServingResponses | None = None
        self.kv: KVTransfer | None = None
        self.info: ModelInfo | None = None
        self.model_root: str | None = None  # the loaded model's own name
        self.load_error: BaseException | None = None
        self.draining = False
        self.metrics = ServerMetrics(self.stats)

    def stats(self) -> ServingStats | None:
        return self.llm.stats() if self.llm is not None else None

    def ready(self) -> None:
        """503 while the model is loading, failed to load, or the server is shutting down."""
        if self.draining:
            raise APIError(503, "server is shutting down")
        if self.info is None:
            raise APIError(503, "the model failed to load" if self.load_error else "the model is still loading")

    def generating(self) -> None:
        """`ready`, and a model that generates text (400 for an embedding model)."""
        self.ready()
        if self.llm is None:
            raise APIError(400, f"{self.info.served_names[0]} is an embedding model: it serves /v1/embeddings, not "
                           "text generation", param="model", code="model_not_supported")

    def embedding_serving(self) -> OpenAIServingEmbedding:
        """`ready`, and a model that embeds (400 for a text-generation model)."""
        self.ready()
        if self.embedding is None:
            raise APIError(400, f"{self.info.served_names[0]} generates text and does not embed; serve an embedding "
                           "model for /v1/embeddings (llmserve serve all-minilm-l6-v2)", param="model",
                           code="model_not_supported")
        return self.embedding

    async def end_open_requests(self) -> None:
        """The stop signal's deadline: end every request still open, so each response ends properly
        (a stream with an error event and [DONE], a waiting request with 503) before the server closes
        its connections."""
        self.draining = True
        if self.llm is not None:
            ended = await asyncio.to_thread(self.llm.abort_all, "server shut down before the request finished")
            if ended:
                logger.warning("shutdown timeout: %d request(s) still open were ended", ended)

    def serving(self, llm: AsyncLLM, config: ServerConfig) -> None:
        self.info = ModelInfo(
            served_names=list(config.served_model_names or [llm.model_name]),
            max_model_len=llm.max_model_len,
            max_tokens_default=config.max_tokens_default,
        )
        self.metrics.bind(self.info.served_names[0])
        llm.structured_outputs.prepare()  # the grammar library's tokenizer index, built in the background
        self.kv = KVTransfer(llm, self.metrics, config.role, config.api_key, config.request_timeout)
        self.chat = OpenAIServingChat(llm, self.info, self.metrics, self.kv)
        self.completion = OpenAIServingCompletion(llm, self.info, self.metrics, self.kv)
        self.responses = OpenAIServingResponses(self.chat)
        self.model_root = llm.model_name
        self.llm = llm  # last: from here on the routes serve

    def serving_embeddings(self, embedder: Embedder, config: ServerConfig) -> None:
        self.info = None
        info = ModelInfo(served_names=list(config.served_model_names or [embedder.name]),
                         max_model_len=embedder.max_length)
        self.metrics.bind(info.served_names[0])
        self.embedding = OpenAIServingEmbedding(embedder, info)
        self.model_root = embedder.name
        self.info = info  # last: from here on the routes serve


def create_app(config: ServerConfig, on_engine_failure: Callable[[BaseException], None] | None = None,
               load_first: bool = False) -> FastAPI:
    """The app; the engine starts loading when the app starts (its lifespan), not here. `load_first`: the
    start-up waits for the model (and fails if it fails to load), for hosts that route to an app once it
    has started (a Ray Serve replica), rather than the /health 503 -> 200 a load balancer watches."""
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state, config, on_engine_failure))
        if load_first:
            await loading
            if state.load_error is not None:
                raise RuntimeError(f"the model failed to load: {state.load_error}")
        yield
        state.draining = True
        if not loading.done():
            logger.info("shutting down while the model loads; waiting for the load to end")
            await asyncio.gather(loading, return_exceptions=True)
        if state.llm is not None:
            # uvicorn has already waited for open responses; this lets the engine finish anything left
            await asyncio.to_thread(state.llm.shutdown, config.shutdown_timeout)
            logger.info("engine stopped")
        if state.kv is not None:  # KV files written for decode instances that never took them
            state.kv.shared.sweep(0)
        if state.embedding is not None:
            state.embedding.embedder.close()

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_handlers(app)
    # Each add_middleware wraps the ones before: the gate (capacity, draining, key) runs before a body
    # is read, and CORS, outermost, answers browsers' preflights (which carry no key) and labels every
    # answer, errors included.
    app.add_middleware(RequestBodyMiddleware, max_bytes=config.max_request_body_bytes,
                       timeout=config.request_timeout)
    app.add_middleware(GateMiddleware, api_key=config.api_key, is_draining=lambda: state.draining)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After", "X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
    app.include_router(_open_routes(state))
    app.include_router(_api_routes(state), prefix="/v1")
    complete_openapi(app)
    return app


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
    @router.head("/health", include_in_schema=False)  # load balancers probe with HEAD
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if state.info is None:
            status = "failed" if state.load_error else "loading"
            return JSONResponse({"status": status}, status_code=503)
        if state.llm is not None and not state.llm.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}, "description": "Prometheus text"}})
    @router.head("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)  # stats() waits for the engine lock
        return Response(body, media_type=CONTENT_TYPE)

    @router.get("/version", response_model=VersionInfo)
    @router.head("/version", include_in_schema=False)
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return router


def _api_routes(state: ServerState) -> APIRouter:
    # strict_content_type=False: a body without a Content-Type is read as JSON (one with another type
    # was already answered 415)
    router = APIRouter(route_class=_StrictJSONRoute, strict_content_type=False)

    @router.get("/models", response_model=ModelList, responses=OPEN_ERRORS)
    @router.head("/models", include_in_schema=False)
    async def models() -> JSONResponse:
        state.ready()
        info = state.info
        cards = [ModelCard(id=name, root=state.model_root, max_model_len=info.max_model_len)
                 for name in info.served_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @router.get("/models/{model:path}", response_model=ModelCard, responses=MODEL_ERRORS)
    @router.head("/models/{model:path}", include_in_schema=False)
    async def model(model: str) -> JSONResponse:
        state.ready()
        check_model(state.info, model)  # 404 model_not_found for another name
        return JSONResponse(ModelCard(id=model, root=state.model_root,
                                      max_model_len=state.info.max_model_len).model_dump())

    @router.post("/chat/completions", response_class=Response,
                 responses={200: json_or_sse(ChatCompletionResponse), **API_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        state.generating()
        return await _guarded(state.chat.create(body, raw), "chat completion")

    @router.post("/completions", response_class=Response, responses={200: json_or_sse(CompletionResponse),
                                                                      **API_ERRORS})
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        state.generating()
        return await _guarded(state.completion.create(body, raw), "completion")

    @router.post("/responses", response_class=Response, responses={200: json_or_sse(ResponseObject), **API_ERRORS})
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        state.generating()
        return await _guarded(state.responses.create(body, raw), "response")

    @router.get("/responses/{response_id}", response_model=ResponseObject, responses=STORED_ERRORS)
    async def stored_response(response_id: str) -> JSONResponse:
        state.generating()
        return JSONResponse(state.responses.get(response_id))

    if state.config.role != "decode":
        @router.post("/kv/blocks", response_class=Response, include_in_schema=False)
        async def kv_blocks(body: KVBlocksRequest) -> Response:
            """A prompt's KV blocks for a decode instance (server/kv_transfer.py): raw bytes, their format in a
            header."""
            state.generating()
            headers, payload = await state.kv.export(body)
            return Response(payload, media_type="application/octet-stream", headers=headers)

    @router.post("/embeddings", response_model=EmbeddingResponse, responses=API_ERRORS)
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        serving = state.embedding_serving()
        response = await _guarded(serving.create(body), "embedding")
        return JSONResponse(response.model_dump())

    return router


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class _StrictJSONRoute(APIRoute):
    """Request bodies parsed by orjson, which holds JSON to its standard where Python's `json` does not:
    a lone UTF-16 surrogate (`"\\ud800"`, not valid Unicode, which made the tokenizer raise), NaN,
    Infinity and numbers that overflow to infinity are refused as invalid JSON (400), before any field
    is read. (orjson.JSONDecodeError is a json.JSONDecodeError, which FastAPI answers as such.)"""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def strict_json_handler(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict_json_handler


async def _guarded(work: Awaitable[Response], what: str) -> Response:
    """A bug while serving one request fails that request alone, with a 500 envelope."""
    try:
        return await work
    except APIError:
        raise
    except Exception as e:
        logger.exception("%s request failed", what)
        raise APIError(500, f"internal server error ({type(e).__name__})") from e


async def _load(state: ServerState, config: ServerConfig,
                on_failure: Callable[[BaseException], None] | None) -> None:
    name = embedding_model(config.engine.model.model)
    if name is not None:
        await _load_embedder(state, config, name, on_failure)
        return
    try:
        llm = await asyncio.to_thread(AsyncLLM, config.engine, config.max_queued_requests,
                                      config.log_stats_interval, on_failure)
        state.serving(llm, config)
    except Exception as e:
        if isinstance(e, ValueError):  # a bad flag or path: the message says it all
            logger.error("the model failed to load: %s", e)
        else:
            logger.exception("the model failed to load")
        state.load_error = e
        if on_failure is not None:
            on_failure(e)
        return
    info, stats = state.info, llm.stats()
    logger.info(
        "serving %s as %s: dtype %s, max_model_len %d, KV cache %d blocks (%d tokens)%s",
        llm.model_name, ", ".join(info.served_names), str(llm.engine.dtype).removeprefix("torch."),
        info.max_model_len, stats.num_kv_blocks, llm.processor.kv_cache_tokens,
        f" at {config.url}" if config.url else "",
    )


async def _load_embedder(state: ServerState, config: ServerConfig, name: str,
                         on_failure: Callable[[BaseException], None] | None) -> None:
    embedder = Embedder(name=name)
    try:
        await asyncio.to_thread(embedder.load)
        state.serving_embeddings(embedder, config)
    except Exception as e:
        logger.exception("the model failed to load")
        state.load_error = e
        if on_failure is not None:
            on_failure(e)
        return
    logger.info("serving the embedding model %s as %s (%d dimensions)%s", name, ", ".join(state.info.served_names),
                embedder.dim, f" at {config.url}" if config.url else "")
