"""OpenAI-compatible HTTP API over one Engine: `create_app(llm, ServerConfig(...))` -> FastAPI app.

No globals: the engine loop, metrics and configuration live in a `ServerState` owned by the app
(`app.state.server`); the engine thread and the prompt threads start and stop with the app's lifespan.

A POST to /v1/completions or /v1/chat/completions goes through, in order: the API key (401), the Content-Type
(415), a place among the requests in flight (503 before the body is read), the body read up to its limit (413),
parsing (400), the limits on stop strings and prompt length (400), the chat template and the tokenizer in a
prompt thread (off the event loop), the context length (400), then the engine. While it waits for outputs the
handler checks that its client is still there, its deadline (`request_timeout_s`, 504) and the engine's health
(a failed or stalled engine fails it with its error), so no handler waits for ever.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import GuidedDecoding
from specdec.engine.engine import StepOutput
from specdec.kernels.report import kernel_report
from specdec.server.engine_loop import EngineLoop, RequestFailed, RequestHandle, WatchdogConfig, shutting_down_error
from specdec.server.metrics import ServerMetrics
from specdec.server.openapi import openapi_document
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     RequestLimits, TokenizeChatRequest, TokenizeCompletionRequest, bad_request,
                                     parse_request, parse_tokenize_request, resolve_max_tokens, sampling_params)
from specdec.server.responses import ChatBuilder, CompletionBuilder, ResponseBuilder, sse
from specdec.server.tool_calls import ToolCallSetup, tags_are_tokens
from specdec.verify.grammar import start_warm_up

logger = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).with_name("static")  # the playground page (plain HTML/JS/CSS)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str | None = None  # the id clients must send as `model`; default: the model's config name
    api_key: str | None = field(default=None, repr=False)  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_queue: int = 256  # requests waiting for a KV slot before new ones get 503
    disconnect_poll_s: float = 0.25  # how often a waiting handler checks its client, deadline and the engine
    limits: RequestLimits = RequestLimits()
    watchdog: WatchdogConfig = WatchdogConfig()
    request_timeout_s: float | None = None  # a request's deadline from its arrival (504 past it); None: none
    shutdown_timeout_s: float = 30.0  # a shutdown lets running requests finish this long, then ends them (503)
    prompt_threads: int = 2  # threads that render chat templates and tokenize prompts

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
        if self.prompt_threads < 1:
            raise ValueError(f"prompt_threads must be >= 1, got {self.prompt_threads}")


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody receives it, access logs show it


def request_timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's request timeout ({timeout_s:g} s)",
                    "timeout_error", code="request_timeout")


def check_json_content_type(request: Request) -> None:
    """POST bodies must be declared JSON, so a cross-site HTML form (text/plain, form-urlencoded) cannot post."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the Content-Type must be application/json, got {media_type or 'none'}",
                       code="unsupported_media_type")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed max_bytes: from Content-Length before reading, else
    once the bytes read so far exceed it (the rest is never read, and the connection is closed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(f"{int(declared)} bytes", max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(f"more than {max_bytes} bytes", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(size: str, max_bytes: int) -> APIError:
    return APIError(413, f"the request body has {size}; this server accepts at most {max_bytes} bytes",
                    code="request_too_large", headers={"Connection": "close"})


@dataclass(frozen=True)
class PreparedPrompt:
    prompt_ids: list[int]
    requested_max_tokens: int | None
    builder: ResponseBuilder
    tool_guided: GuidedDecoding | None = None  # the constraint tool_choice "required" or a named function asks for


class ServerState:
    def __init__(self, llm, config: ServerConfig) -> None:
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.config = config
        self.limits = config.limits
        self.model_name = config.model_name or llm.model.config.name
        self.spec_config = getattr(llm, "spec_config", None)  # an LLM's SpeculativeConfig (None: plain only)
        self.max_model_len = self.engine.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(self.engine, self.metrics, config.max_queue, config.watchdog)
        self.prompt_pool = ThreadPoolExecutor(config.prompt_threads, thread_name_prefix="specdec-prompt")
        self.shutdown_deadline_s: float | None = None  # set when a shutdown begins (GracefulServer)
        self.grammar_warm_up: threading.Thread | None = None  # builds the grammar engine's tokenizer view at start
        self.kernels = kernel_report(getattr(llm.model, "device", "cpu"), getattr(llm.model, "weight_format", "q8"),
                                     llm.model.linear_bytes() if hasattr(llm.model, "linear_bytes") else None)

    def begin_shutdown(self) -> None:
        """From now on new requests get 503 shutting_down, and running ones end with it at the deadline."""
        self.shutdown_deadline_s = time.monotonic() + self.config.shutdown_timeout_s
        logger.info("shutting down: running requests have %.1f s to finish", self.config.shutdown_timeout_s)

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

    # ---- prompts (run in a prompt thread) ---------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> PreparedPrompt:
        prompt_ids = self.completion_prompt_ids(body.single_prompt())
        builder = CompletionBuilder(f"cmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, len(prompt_ids),
                                    body.return_token_ids, body.return_token_kinds)
        return PreparedPrompt(prompt_ids, body.max_tokens, builder)

    def prepare_chat(self, body: ChatCompletionRequest) -> PreparedPrompt:
        tools = body.tool_setup()
        prompt_ids = self.chat_prompt_ids(body, tools)
        builder = ChatBuilder(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, len(prompt_ids),
                              body.return_token_ids, body.return_token_kinds,
                              tool_parser=tools.parser() if tools else None)
        tool_guided = tools.guided(tags_are_tokens(self.tokenizer)) if tools else None
        return PreparedPrompt(prompt_ids, body.requested_max_tokens(), builder, tool_guided)

    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)

    def chat_prompt_ids(self, body: ChatCompletionRequest, tools: ToolCallSetup | None) -> list[int]:
        messages = body.template_messages()
        tool_list = list(tools.tools) if tools else None
        try:
            if tool_list and (self.tokenizer.apply_chat_template(messages, tools=tool_list)
                              == self.tokenizer.apply_chat_template(messages)):
                raise bad_request("this model's chat template does not render tools, so the model cannot be told "
                                  "about them; send tool_choice 'none' or no tools", "tools", "tools_not_supported")
            ids = self.tokenizer.encode_chat(messages, tools=tool_list)
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - template errors (raise_exception, bad roles) are the client's
            raise bad_request(f"could not apply the chat template: {error}", "messages") from None
        if not ids:
            raise bad_request("the chat prompt is empty", "messages")
        return ids

    # ---- /tokenize and /detokenize (vLLM's shape) -------------------------------------------------------
    async def read_request(self, request: Request, parse: Callable[[bytes], Any]) -> Any:
        """The checks of `handle` before the engine: API key, JSON, body size, model (optional), limits."""
        self.check_api_key(request)
        check_json_content_type(request)
        body = parse(await read_body(request, self.limits.max_body_bytes))
        if body.model is not None:
            self.check_model(body.model)
        if hasattr(body, "check_prompt_length"):
            body.check_prompt_length(self.limits)
        return body

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        if isinstance(body, TokenizeChatRequest):
            try:
                text = self.tokenizer.apply_chat_template(body.template_messages(),
                                                          add_generation_prompt=body.add_generation_prompt,
                                                          tools=body.template_tools())
            except Exception as error:  # noqa: BLE001 - template errors are the client's
                raise bad_request(f"could not apply the chat template: {error}", "messages") from None
        else:
            text = body.prompt
        tokens = self.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ---- serving ----------------------------------------------------------------------------------------
    async def handle(self, request: Request, model_cls: type[CompletionRequest | ChatCompletionRequest],
                     prepare: Callable[[Any], PreparedPrompt]):
        """The checks in the module docstring's order, then the engine; the answer, streamed or whole."""
        arrived_s = time.monotonic()
        timeout_s = self.config.request_timeout_s
        deadline_s = None if timeout_s is None else arrived_s + timeout_s
        self.check_api_key(request)
        check_json_content_type(request)
        if self.shutdown_deadline_s is not None:
            raise shutting_down_error()
        with self.loop.reserve() as reservation:
            body = parse_request(await read_body(request, self.limits.max_body_bytes), model_cls)
            self.check_model(body.model)
            body.check_limits(self.limits)
            prepared = await asyncio.get_running_loop().run_in_executor(self.prompt_pool, prepare, body)
            max_tokens = resolve_max_tokens(prepared.requested_max_tokens, len(prepared.prompt_ids),
                                            self.max_model_len)
            params = sampling_params(body, max_tokens, body.num_logprobs(), self.limits,
                                     self.engine.model.config.vocab_size, prepared.tool_guided)
            handle = RequestHandle(prepared.builder.request_id, prepared.prompt_ids, params, body.speculative,
                                   asyncio.get_running_loop())
            reservation.submit(handle)
        return await self.respond(request, body, handle, prepared.builder, arrived_s, deadline_s)

    async def respond(self, request: Request, body, handle: RequestHandle, builder: ResponseBuilder,
                      arrived_s: float, deadline_s: float | None):
        events = self._events(request, handle, deadline_s)
        try:
            first = await anext(events)  # errors before the first token still get their status code
        except ClientGone:
            return self._client_left(handle.request_id, arrived_s, "before its first token")
        except BaseException:
            await events.aclose()
            raise
        if body.stream:
            return StreamingResponse(self._sse(first, events, builder, body.include_usage_in_stream(), arrived_s),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            builder.add(first)
            async for output in events:
                builder.add(output)
        except ClientGone:
            return self._client_left(handle.request_id, arrived_s,
                                     f"after {len(builder.token_ids)} tokens of a non-streamed answer")
        finally:
            await events.aclose()
        return JSONResponse(builder.response())

    @staticmethod
    def _client_left(request_id: str, arrived_s: float, when: str) -> Response:
        """One info line, no traceback; the response goes nowhere (the client has gone)."""
        logger.info("client disconnected %s: request %s aborted %.2f s after it arrived", when, request_id,
                    time.monotonic() - arrived_s)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _events(self, request: Request, handle: RequestHandle,
                      deadline_s: float | None) -> AsyncIterator[StepOutput]:
        """The request's StepOutputs until it finishes. Raises ClientGone when the client leaves, a 504 APIError
        past the deadline, the engine's error when the engine fails or stalls; aborts the request in the engine
        whenever it ends unfinished (the abort's reason labels request_failure_total)."""
        finished = False
        abort_reason = "abort"
        getter: asyncio.Future | None = None
        poll_s = self.config.disconnect_poll_s
        checked_at = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if deadline_s is not None and now >= deadline_s:
                    abort_reason = "timeout"
                    raise request_timeout_error(self.config.request_timeout_s)
                if self.shutdown_deadline_s is not None and now >= self.shutdown_deadline_s:
                    abort_reason = "shutdown"
                    raise shutting_down_error()
                if now - checked_at >= poll_s:  # even while tokens flow (non-streaming requests)
                    if await request.is_disconnected():
                        raise ClientGone()
                    checked_at = time.monotonic()
                getter = getter or asyncio.ensure_future(handle.queue.get())
                wait_s = min([poll_s] + [max(0.0, deadline - now) for deadline in (deadline_s, self.shutdown_deadline_s)
                                         if deadline is not None])
                done, _ = await asyncio.wait({getter}, timeout=wait_s)
                if not done:  # nothing for a while: is the engine still able to answer?
                    unavailable = self.loop.unavailable_error()
                    if unavailable is not None:
                        abort_reason = "error"
                        raise unavailable
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
                self.loop.abort(handle.request_id, abort_reason)

    async def _sse(self, first: StepOutput, events: AsyncIterator[StepOutput], builder: ResponseBuilder,
                   include_usage: bool, arrived_s: float) -> AsyncIterator[str]:
        try:
            for chunk in builder.start_chunks():
                yield sse(chunk)
            yield sse(builder.chunk(first))
            async for output in events:
                yield sse(builder.chunk(output))
            if include_usage:
                yield sse(builder.usage_chunk())
        except APIError as error:  # the engine failed, stalled or ran out of time mid-stream: tell the client in-band
            yield sse(error.body())
        except ClientGone:
            self._client_left(builder.request_id, arrived_s, f"mid-stream after {len(builder.token_ids)} tokens")
            return
        except (asyncio.CancelledError, GeneratorExit):
            logger.info("stream of request %s closed after %d tokens (the client left or the server is stopping); "
                        "aborted", builder.request_id, len(builder.token_ids))
            raise
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
        health = self.loop.health()
        return {
            "model": self.model_name,
            "engine_alive": self.loop.alive,
            "num_requests_running": snapshot.running,
            "num_requests_waiting": snapshot.waiting + self.loop.pending,
            "kv_cache_free_slots": snapshot.free_slots,
            "kv_cache_total_slots": snapshot.total_slots,
            "max_model_len": self.max_model_len,
            "health": {"ok": health.ok, "code": health.code, "message": health.message},
            "engine_failed_steps_in_a_row": self.loop.failed_steps_in_a_row,
            "spec_decode": snapshot.spec.to_dict(),
        }


SHUTDOWN_BACKSTOP_S = 2.0  # uvicorn cancels what is still running this long after the app's own deadline


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which tells the app when a shutdown begins: new requests then get 503 shutting_down,
    running ones may finish within `shutdown_timeout_s` and then end with 503 shutting_down (in-band when
    streaming), so a stop never waits for ever and no request is cut off without an answer. uvicorn's own
    graceful timeout, a little longer, cancels whatever still runs after that."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.app_state: ServerState = config.app.state.server
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = self.app_state.config.shutdown_timeout_s + SHUTDOWN_BACKSTOP_S
        super().__init__(config)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.app_state.begin_shutdown()
        await super().shutdown(sockets)


def create_app(llm, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `llm` (an `LLM`, or anything with `.engine`, `.tokenizer` and `.model`)."""
    state = ServerState(llm, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # any request may ask for constrained output (response_format): the grammar engine's view of the tokenizer is
        # built now, beside the server, instead of during the first such request's step
        state.grammar_warm_up = start_warm_up(state.tokenizer, state.engine.model.config.vocab_size)
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop(state.config.shutdown_timeout_s)
            state.prompt_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    document = openapi_document(state.model_name, state.limits)
    app.openapi = lambda: document  # what GET /openapi.json serves (FastAPI's own generator is not used)
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
        health = state.loop.health()
        if not health.ok:
            raise health.error()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(state.loop.snapshot, state.loop.pending)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status")
    async def status():
        return state.status()

    @app.get("/openapi.json")
    async def openapi():
        return app.openapi()

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_api_key(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "specdec", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.handle(request, CompletionRequest, state.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.handle(request, ChatCompletionRequest, state.prepare_chat)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await state.read_request(request, parse_tokenize_request)
        return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, state.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await state.read_request(request, lambda raw: parse_request(raw, DetokenizeRequest))
        return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, state.detokenize, body)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        headers = {"Retry-After": "1", **error.headers} if error.status_code == 503 else error.headers
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
