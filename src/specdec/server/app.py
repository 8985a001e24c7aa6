"""OpenAI-compatible HTTP API over one Engine: `create_app(llm, ServerConfig(...))` -> FastAPI app.

No globals: the engine loop, metrics and configuration live in a `ServerState` owned by the app
(`app.state.server`); the engine thread starts and stops with the app's lifespan.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.engine.engine import StepOutput
from specdec.kernels.report import kernel_report
from specdec.server.engine_loop import EngineLoop, RequestFailed, RequestHandle
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, parse_request,
                                     resolve_max_tokens, sampling_params)
from specdec.server.responses import ChatBuilder, CompletionBuilder, ResponseBuilder, sse

logger = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).with_name("static")  # the playground page (plain HTML/JS/CSS)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # the id clients must send as `model`; default: the model's config name
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_queue: int = 256  # requests waiting for a KV slot before new ones get 503
    disconnect_poll_s: float = 0.25  # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


class ServerState:
    def __init__(self, llm, config: ServerConfig) -> None:
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.config = config
        self.model_name = config.model_name or llm.model.config.name
        self.spec_config = getattr(llm, "spec_config", None)  # an LLM's SpeculativeConfig (None: plain only)
        self.max_model_len = self.engine.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(self.engine, self.metrics, config.max_queue)
        self.kernels = kernel_report(getattr(llm.model, "device", "cpu"), getattr(llm.model, "weight_format", "q8"),
                                     llm.model.linear_bytes() if hasattr(llm.model, "linear_bytes") else None)

    # ---- checks -----------------------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise bad_request(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                              "model", "model_not_found")

    # ---- prompts ----------------------------------------------------------------------------------------
    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            return self.tokenizer.encode(prompt)
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)

    def chat_prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True)
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - template errors (raise_exception, bad roles) are the client's
            raise bad_request(f"could not apply the chat template: {error}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the chat prompt is empty", "messages")
        return ids

    # ---- serving ----------------------------------------------------------------------------------------
    async def serve(self, request: Request, body, prompt_ids: list[int], requested_max_tokens: int | None,
                    builder: ResponseBuilder):
        max_tokens = resolve_max_tokens(requested_max_tokens, len(prompt_ids), self.max_model_len)
        params = sampling_params(body, max_tokens, body.num_logprobs())
        handle = RequestHandle(builder.request_id, prompt_ids, params, body.speculative, asyncio.get_running_loop())
        self.loop.submit(handle)
        events = self._events(request, handle)
        try:
            first = await anext(events)  # errors before the first token still get their status code
        except BaseException:
            await events.aclose()
            raise
        if body.stream:
            return StreamingResponse(self._sse(first, events, builder, body.include_usage_in_stream()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            builder.add(first)
            async for output in events:
                builder.add(output)
        finally:
            await events.aclose()
        return JSONResponse(builder.response())

    async def _events(self, request: Request, handle: RequestHandle) -> AsyncIterator[StepOutput]:
        """The request's StepOutputs until it finishes; aborts it in the engine if the consumer goes away."""
        finished = False
        getter: asyncio.Future | None = None
        poll_s = self.config.disconnect_poll_s
        checked_at = time.monotonic()
        try:
            while True:
                if time.monotonic() - checked_at >= poll_s:  # even while tokens flow (non-streaming requests)
                    if await request.is_disconnected():
                        raise ClientGone()
                    checked_at = time.monotonic()
                getter = getter or asyncio.ensure_future(handle.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=poll_s)
                if not done:
                    continue
                item, getter = getter.result(), None
                if isinstance(item, RequestFailed):
                    finished = True
                    raise item.error
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if getter is not None:
                getter.cancel()
            if not finished:
                self.loop.abort(handle.request_id)

    async def _sse(self, first: StepOutput, events: AsyncIterator[StepOutput], builder: ResponseBuilder,
                   include_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in builder.start_chunks():
                yield sse(chunk)
            yield sse(builder.chunk(first))
            async for output in events:
                yield sse(builder.chunk(output))
            if include_usage:
                yield sse(builder.usage_chunk())
        except APIError as error:  # the engine failed mid-stream: tell the client in-band
            yield sse(error.body())
        except ClientGone:
            return
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    def spec_info(self) -> dict[str, Any]:
        """What the playground needs to know about speculation on this server, and which kernel path runs it."""
        spec = self.spec_config
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "speculative": self.engine.drafter is not None,
            "method": spec.method if spec else None,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
            "per_request_k": False,  # k is the server's; requests choose only speculative true/false
            **self.kernels.to_dict(),  # kernel_isa, supported_kernel_isas, ..., kernel_warning (None on a SIMD path)
        }

    def status(self) -> dict[str, Any]:
        snapshot = self.loop.snapshot
        return {
            "model": self.model_name,
            "engine_alive": self.loop.alive,
            "num_requests_running": snapshot.running,
            "num_requests_waiting": snapshot.waiting + self.loop.pending,
            "kv_cache_free_slots": snapshot.free_slots,
            "kv_cache_total_slots": snapshot.total_slots,
            "max_model_len": self.max_model_len,
            "spec_decode": snapshot.spec.to_dict(),
        }


def create_app(llm, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `llm` (an `LLM`, or anything with `.engine`, `.tokenizer` and `.model`)."""
    state = ServerState(llm, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/")
    async def playground():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/v1/specdec/info")
    async def spec_info(request: Request):
        state.check_api_key(request)
        return state.spec_info()

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            raise APIError(503, "the engine thread is not running", "service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(state.loop.snapshot, state.loop.pending)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status")
    async def status():
        return state.status()

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_api_key(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "specdec", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_api_key(request)
        body = parse_request(await request.body(), CompletionRequest)
        state.check_model(body.model)
        prompt_ids = state.completion_prompt_ids(body.single_prompt())
        builder = CompletionBuilder(f"cmpl-{uuid.uuid4().hex}", state.model_name, state.tokenizer, len(prompt_ids),
                                    body.return_token_ids, body.return_token_kinds)
        return await state.serve(request, body, prompt_ids, body.max_tokens, builder)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_api_key(request)
        body = parse_request(await request.body(), ChatCompletionRequest)
        state.check_model(body.model)
        prompt_ids = state.chat_prompt_ids(body)
        builder = ChatBuilder(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, state.tokenizer, len(prompt_ids),
                              body.return_token_ids, body.return_token_kinds)
        return await state.serve(request, body, prompt_ids, body.requested_max_tokens(), builder)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        headers = {"Retry-After": "1"} if error.status_code == 503 else None
        return JSONResponse(error.body(), status_code=error.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(bad_request(f"invalid request: {error.errors()[:1]}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}", "internal_server_error").body(),
                            status_code=500)
