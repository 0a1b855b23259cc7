"""The HTTP routes: OpenAI's completions and chat completions (streamed as server-sent events or whole), the model
list and the one model, health and Prometheus metrics.

A request's life: parse and check the body (protocol.py), make its own decoder and encode its prompt (in a thread:
tokenizing and building a policy are not free), queue it with the scheduler (429 at once when full), then relay the
worker's updates. The worker never waits for a client: updates cross to the event loop through an asyncio queue.
A client that goes away is noticed when a send fails or, while no text flows, by polling, and its job is cancelled
so its slot frees before the next step; the request is counted with status 499 (nginx's "client closed request"),
streamed or not.
"""
from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..engine.prompts import conversation_ids, decode_text, has_chat_template
from .decoders import Decoders
from .logprobs import Logprobs
from .metrics import CONTENT_TYPE, Metrics
from .output import DONE, Reply, event, visible_text
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Limits,
    chat_messages,
    check_model,
    check_sampling,
    completion_prompt,
    max_tokens,
    parse_request,
    stop_strings,
)
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown, Update

CLIENT_CLOSED = 499  # nginx's status for "the client closed the request": only ever seen in the metrics
DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STARTED = int(time.time())  # a model card's `created`: when this server started
RETRY_AFTER_S = 1  # a full server's hint: one round of steps frees slots, so a second later is worth a try


def create_app(decoders: Decoders, limits: Limits, scheduler: Scheduler, metrics: Metrics,
               render_metrics: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """The app around one engine. `render_metrics` answers GET /metrics (default: `metrics` rendered; on Ray Serve,
    every replica's metrics gathered, see replicas.py)."""
    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="arborspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return error_response(request, metrics, err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):  # unknown paths, wrong methods
        return error_response(request, metrics, APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        return error_response(request, metrics, APIError(500, f"internal error: {err}", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what load balancers' probes often send
    async def health():
        active, waiting = scheduler.load()
        status = "stopping" if scheduler.draining else "ok"
        return JSONResponse({"status": status, "active": active, "queued": waiting},
                            status_code=503 if scheduler.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(await render_metrics() if render_metrics else metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, limits)
        metrics.requests.labels(endpoint="/v1/models", status="200").inc()
        return {"object": "list", "data": [model_card(limits)]}

    @app.get("/v1/models/{model_id:path}")  # :path: a model named after a hub id or a directory holds slashes
    async def model(request: Request, model_id: str):
        check_key(request, limits)
        check_model(model_id, limits)
        metrics.requests.labels(endpoint=_endpoint(request), status="200").inc()
        return model_card(limits)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request, limits)
        req = parse_request(await read_body(request, limits.max_body_bytes), CompletionRequest)
        check_model(req.model, limits)
        return await generate(request, req, completion_prompt(req), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request, limits)
        req = parse_request(await read_body(request, limits.max_body_bytes), ChatRequest)
        check_model(req.model, limits)
        return await generate(request, req, chat_messages(req), chat=True)

    async def generate(request: Request, req, prompt, chat: bool):
        check_sampling(req)
        n, stop = max_tokens(req, limits), stop_strings(req)
        top, echo = req.top_logprobs_asked(), getattr(req, "echo", False)  # echo: completions' only
        admit(scheduler.check_room)  # a full server answers now, not after the round its decoder would wait for
        steps = await run_in_threadpool(start_generation, decoders, limits.model_name, req, prompt, chat, n, stop,
                                        scheduler.models, top, echo and top is not None)
        opts, tokenizer = req.arborspec, decoders.target.tokenizer
        echo_text = (prompt if isinstance(prompt, str) else decode_text(tokenizer, prompt, False)) if echo else None
        reply = Reply(limits.model_name, chat, stop, token_ids=bool(opts and opts.return_token_ids),
                      include_usage=bool(req.stream_options and req.stream_options.include_usage),
                      logprobs=None if top is None else Logprobs(tokenizer, chat, base=len(echo_text or "")),
                      echo=echo_text)
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(update: Update) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the event loop is gone: nobody is left to tell
                pass

        job = Job(steps, deliver, stream=bool(req.stream))
        try:
            admit(lambda: scheduler.submit(job))
        except APIError:
            steps.close()
            raise
        endpoint = _endpoint(request)
        if req.stream:
            ended = {}  # the status of an error event the stream ended with, if any (set by sse)

            def counted(completed: bool) -> None:  # the status is known only when the stream ends
                status = ended.get("status", 200) if completed else CLIENT_CLOSED
                metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

            return JobStream(sse(job, updates, request, reply, scheduler, ended), job, counted)
        try:
            update = await next_update(updates, job, request, scheduler)
            while not update.done:
                update = await next_update(updates, job, request, scheduler)
        except ClientGone:
            metrics.requests.labels(endpoint=endpoint, status=str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        finally:
            job.cancel()  # a no-op once finished; frees the slot if this handler was cancelled
        if update.error:
            raise failure(update)
        metrics.requests.labels(endpoint=endpoint, status="200").inc()
        return JSONResponse(reply.body(update.result))

    return app


# ---- helpers --------------------------------------------------------------------------------------------------------
def model_card(limits: Limits) -> dict:
    return {"id": limits.model_name, "object": "model", "created": STARTED, "owned_by": "arborspec"}


def admit(check: Callable[[], None]) -> None:
    """`check` (the scheduler's check_room or submit), its refusals as the client hears them: 429 with Retry-After
    when the server is full, 503 when it is stopping."""
    try:
        check()
    except QueueFull as err:
        raise APIError(429, str(err), "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ShuttingDown as err:
        raise APIError(503, str(err), "server_error", code="shutting_down") from None


def failure(update: Update) -> APIError:
    """The error a generation that ended early (`update.error`) is to its client."""
    return APIError(503 if update.code == "shutdown" else 500, update.error, "server_error", code=update.code)


def start_generation(decoders: Decoders, model_name: str, req, prompt, chat: bool, n: int, stop: list[str],
                     models: threading.Lock, logprobs: int | None = None, prompt_logprobs: bool = False):
    """The request's decoder loop, not started: its prompt encoded and its decoder made, so a bad setting or prompt
    is a 400 here rather than an error in the middle of a stream. The prompt is checked first: the decoder is made
    holding `models` (the scheduler's), which waits for the running round (making it may run the models: a
    measurement the first time a pair or setting is seen), and a prompt over the context window waited 14 s for
    a round reading a long prompt on llama.cpp before its 400.
    `logprobs`: how many alternatives each token's logprob comes with (None: no logprobs); `prompt_logprobs`:
    the prompt's tokens' too (an echo)."""
    opts = req.arborspec
    try:
        spec = decoders.spec_for(opts.method, opts.verifier, opts.budget, opts.allow_lossy) if opts else decoders.spec
    except ValueError as err:  # the request's own method, verifier, budget or consent
        raise APIError(400, str(err), param="arborspec") from None
    param = None  # the field a ValueError is about, named in the 400 (clients show it beside the field)
    try:
        sampling = decoders.sampling(req.temperature, req.top_k, req.top_p, req.seed)
        param = "messages" if chat else "prompt"
        if chat:
            prompt = render_chat(decoders.target.tokenizer, prompt, model_name)
        # ValueError (a 400) for ids outside the vocabulary, text not UTF-8, ...; scored alone, it may fill the window
        ids = decoders.encode(prompt, room=min(n, 1))
        check_context(ids, n, req, decoders.context_window, chat)
        param = "arborspec" if opts else None  # the request's method or verifier with its sampling: a budget too big
        with models:
            decoder = decoders.build(spec, sampling)
        # the engine's per-step loop: each request owns one, and the scheduler advances them in turn
        return decoder.steps(ids, n, stop or None, sampling.seed, bool(req.ignore_eos), decoders.prefill_chunk,
                             logprobs, prompt_logprobs)
    except ValueError as err:
        if "context window" in str(err):
            raise APIError(400, str(err), param="messages" if chat else "prompt",
                           code="context_length_exceeded") from None
        raise APIError(400, str(err), param=param) from None


def check_context(ids: list[int], n: int, req, window: int, chat: bool) -> None:
    """A request that names its max_tokens and cannot have them in the target's context window is a 400, as
    OpenAI's (it ran, and ended cut short as "length"). One that names none runs to the window's end."""
    asked = req.max_completion_tokens is not None or req.max_tokens is not None
    if asked and len(ids) + n > window:
        where = "messages" if chat else "prompt"
        raise APIError(400, f"this model's context window is {window} tokens, but {len(ids) + n} were asked for "
                            f"({len(ids)} in the {where}, {n} in the completion); shorten the {where} or lower "
                            f"max_tokens", param=where, code="context_length_exceeded")


def render_chat(tokenizer, messages: list[dict], model_name: str) -> list[int]:
    """The conversation's token ids, in the target's chat template (engine/prompts.py, as `arborspec generate
    --chat` and `arborspec chat` encode it)."""
    if not has_chat_template(tokenizer):
        raise APIError(400, f"the model {model_name!r} has no chat template; use /v1/completions")
    try:
        return conversation_ids(tokenizer, messages, content_as_text=True)
    except Exception as err:  # templates raise their own errors, e.g. on roles out of the order they expect
        raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit` bytes (declared or as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                       code="body_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
    except ClientDisconnect:  # gone before its body was whole: nobody to answer; counted, never a traceback
        raise APIError(CLIENT_CLOSED, "the client closed the connection before sending its whole request",
                       code="client_closed") from None
    return bytes(body)


def check_key(request: Request, limits: Limits) -> None:
    if limits.api_key is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), limits.api_key.encode()):
        raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                       "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def error_response(request: Request, metrics: Metrics, err: APIError) -> JSONResponse:
    metrics.requests.labels(endpoint=_endpoint(request), status=str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _endpoint(request: Request) -> str:
    """The route for a metric label: a known path, or "other" (a label per scanned path would grow unbounded)."""
    path = request.url.path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics") else "other"


class ClientGone(Exception):
    """The client disconnected while its request was queued or generating."""


async def next_update(updates: asyncio.Queue, job: Job, request: Request, scheduler: Scheduler) -> Update:
    """The worker's next update for `job`; cancels the job and raises ClientGone if the client has gone, and
    cancels it and says so once a shutdown's grace is over (the worker would tell only after its round)."""
    while True:
        try:
            return await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone from None
            if scheduler.overdue:
                job.cancel()
                return Update(job.result, True, "the server is shutting down", "shutdown")


async def sse(job: Job, updates: asyncio.Queue, request: Request, reply: Reply, scheduler: Scheduler,
              ended: dict) -> AsyncIterator[str]:
    """The stream's events: text as it is committed (held back where a stop string may be starting), then a last
    chunk with the finish reason, usage and speculative statistics (see Reply.last_events), then [DONE]. Ends
    without [DONE] when the client has gone. A generation that fails sends an error event, then [DONE], and
    `ended["status"]` is its status (the metrics count the request with it)."""
    if first := reply.first_event():
        yield first
    shown = ""
    while True:
        try:
            update = await next_update(updates, job, request, scheduler)
        except ClientGone:
            return
        while not update.done and not updates.empty():  # the client fell behind: skip to the newest text
            update = updates.get_nowait()
        if update.error:
            err = failure(update)
            ended["status"] = err.status
            yield event(err.body())
            break
        text = visible_text(update.result.text, reply.stop, update.done)
        if len(text) > len(shown):  # decoding more tokens only extends the text (as SpeculativeDecoder.stream has it)
            yield reply.text_event(text[len(shown):], update.result, text)
            shown = text
        if update.done:
            for last in reply.last_events(update.result, shown):
                yield last
            break
    yield DONE


class JobStream(StreamingResponse):
    """A server-sent-event stream that cancels its job however the response ends: finished, client gone (a failed
    send, or noticed by `sse`), or the server cancelling it at shutdown; and then says `ended(completed)`, completed
    meaning that [DONE] was handed to the connection."""

    def __init__(self, events: AsyncIterator[str], job: Job, ended: Callable[[bool], None]):
        super().__init__(self._watched(events), media_type="text/event-stream", headers=SSE_HEADERS)
        self.job, self.ended, self.completed = job, ended, False

    async def _watched(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for data in events:
            yield data
            self.completed = data == DONE  # resumed: the send of `data` returned

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.ended(self.completed)

