"""The HTTP side: a Starlette app serving the OpenAI API's completions, chat completions and models, and /health,
over one Scheduler. A handler queues its request's Jobs and answers with their outcome, or streams it as
server-sent events, a chunk per verified step; a client that goes cancels its jobs."""

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from functools import partial

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import Reply, RequestError, parse
from .scheduler import MALLOC_TRIM, Failed, Job, News, QueueFull, ShuttingDown

log = logging.getLogger("minispec.serve")

# A body is read (and a prompt tokenized) before it is checked against the context: a bound keeps a client from
# filling the memory (body_bound: also what the context can hold).
MAX_BODY_BYTES = 16 * 2**20
TRIM_AFTER_BYTES = 2**16  # bodies after which release_memory runs


def build_app(scheduler, model_name, draft_name, api_key=None, shutdown_timeout=None):
    """The app, which starts the scheduler and stops it (waiting at most `shutdown_timeout` seconds);
    api_key: the Bearer token every request must carry (None: none needed)."""
    if scheduler.target.tokenizer is None:
        raise ValueError(f"{scheduler.target.name} has no tokenizer files: the server reads and writes text")
    server = Handlers(scheduler, model_name, draft_name, body_bound(scheduler))

    def guarded(handler):
        async def endpoint(request):
            try:
                if api_key is not None:
                    check_key(request, api_key)
                return await handler(request)
            except RequestError as error:
                return error_response(error)
            except Exception as error:  # a bug met by this request: it fails, the server goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return error_response(failure(error))
        return endpoint

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.stop, shutdown_timeout)
        from ..decoding.suffix import save_stores  # draft="suffix"'s store, for the next replica; read only here
        save_stores()

    complete = server.complete
    routes = [Route("/v1/completions", guarded(lambda request: complete(request, False)), methods=["POST"]),
              Route("/v1/chat/completions", guarded(lambda request: complete(request, True)), methods=["POST"]),
              Route("/v1/models", guarded(server.models), methods=["GET"]),
              Route("/health", guarded(server.health), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


class Handlers:
    def __init__(self, scheduler, model_name, draft_name, max_body):
        self.scheduler, self.model_name, self.draft_name, self.max_body = scheduler, model_name, draft_name, max_body
        self.started = int(time.time())

    async def complete(self, request, chat):
        body, size = await read_json(request, self.max_body)
        try:  # tokenizing a long prompt takes a while: off the event loop, which streams the others' replies
            parsed = await run_in_threadpool(parse, body, chat, self.scheduler, self.model_name)
        finally:
            release_memory(size)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()

        def deliver(i, event):  # on the scheduler's thread: the event, with the answer it is of
            with suppress(RuntimeError):  # the event loop has closed: nobody waits any more
                loop.call_soon_threadsafe(events.put_nowait, (i, event))

        jobs = [Job(one, partial(deliver, i)) for i, one in enumerate(parsed.requests)]
        try:
            self.scheduler.submit(*jobs)
        except QueueFull:
            raise RequestError(429, f"{self.scheduler.max_waiting} requests are waiting already; retry later",
                               kind="rate_limit_error", code="rate_limit_exceeded") from None
        except ShuttingDown as error:
            raise server_error(str(error), 503) from None
        reply = Reply(chat, self.model_name, self.draft_name, parsed.requests[0].prompt_ids.shape[1],
                      self.scheduler.target.tokenizer)
        if parsed.stream:
            return StreamingResponse(self.stream(jobs, events, reply, parsed.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.whole(request, jobs, events, reply, parsed)

    async def whole(self, request, jobs, events, reply, parsed):
        """The reply in one body once every answer ends (best_of: the n best)."""
        watcher = asyncio.create_task(report_disconnect(request, events))
        outcomes = {}
        try:
            while len(outcomes) < len(jobs):
                i, event = await events.get()
                if not isinstance(event, News):  # failed, or the client went (None)
                    break
                if event.outcome is not None:
                    outcomes[i] = event.outcome
        finally:  # also when this handler is cancelled (a shutdown's grace period is over)
            watcher.cancel()
            self.scheduler.cancel(*jobs)
        if len(outcomes) == len(jobs):
            outcomes = [outcomes[i] for i in range(len(jobs))]
            chosen = outcomes
            if len(jobs) > parsed.n:  # best_of: the n answers of the highest total log-probability, best first
                chosen = sorted(outcomes, key=lambda outcome: -sum(e.logprob for e in outcome.logprobs))[:parsed.n]
            if not parsed.logprobs:  # asked for ranking only
                chosen = [replace(outcome, logprobs=None) for outcome in chosen]
            return JSONResponse(reply.whole(chosen, outcomes))
        if isinstance(event, Failed):
            return error_response(server_error(event.message, event.status))
        return Response(status_code=499)  # the client went: nobody reads this

    async def stream(self, jobs, events, reply, include_usage):
        """Server-sent events: each step's text by answer, each answer's ending, usage if asked, [DONE]. When the
        client goes, Starlette cancels this generator, and so the jobs."""
        usage = {"usage": None} if include_usage else {}  # as OpenAI: every chunk has it, the last one filled
        outcomes = []
        try:
            if reply.chat:
                for i in range(len(jobs)):  # who speaks
                    yield event_data({**reply.chunk({"delta": {"role": "assistant", "content": ""}}, index=i), **usage})
            while len(outcomes) < len(jobs):
                i, event = await events.get()
                if isinstance(event, Failed):
                    yield event_data(server_error(event.message, event.status).body())
                    break
                if event.piece or event.logprobs:
                    yield event_data({**reply.piece(event.piece, event.logprobs, index=i), **usage})
                if event.outcome is not None:
                    yield event_data({**reply.ending(event.outcome, i), **usage})
                    outcomes.append(event.outcome)
            if include_usage and len(outcomes) == len(jobs):
                yield event_data(reply.usage_chunk(outcomes))
        except Exception as error:  # a bug met by this request, after its headers were sent
            log.exception("streaming a reply failed")
            yield event_data(failure(error).body())
        finally:
            self.scheduler.cancel(*jobs)
        yield "data: [DONE]\n\n"

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.started, "owned_by": "minispec"}]})

    async def health(self, request):
        return JSONResponse({"status": "stopping" if self.scheduler.stopping else "ok", **self.scheduler.load})


def body_bound(scheduler):
    """The largest body a request that fits the context can need: max_text characters at up to 12 bytes of JSON
    each (an escaped surrogate pair), and 1 MiB for the other fields."""
    return 12 * scheduler.max_text + 2**20


async def read_json(request, max_body):
    max_body = min(max_body, MAX_BODY_BYTES)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > max_body:
                raise RequestError(413, f"the request body is larger than {max_body} bytes")
    except ClientDisconnect:  # nobody reads the reply
        raise RequestError(499, "the client went before its body was sent") from None
    try:
        return json.loads(body, parse_constant=refuse_constant), len(body)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than Python recurses
        raise RequestError(400, f"the body is not valid JSON: {error}") from None


def release_memory(size):
    """Give the C heap's free pages back after a large body, else at most once a second: the thread pool's
    threads, which parse and tokenize bodies, each keep what they freed in a glibc arena of their own."""
    global trimmed
    if MALLOC_TRIM is not None and (size > TRIM_AFTER_BYTES or time.monotonic() > trimmed + 1):
        MALLOC_TRIM(0)
        trimmed = time.monotonic()


trimmed = 0.0  # when release_memory last trimmed


def refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


async def report_disconnect(request, events):
    """(None, None) among the events when the client goes (once the body is read, receive() answers only that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait((None, None))


def check_key(request, api_key):
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), api_key.encode())):
        raise RequestError(401, "a valid API key is needed (Authorization: Bearer <key>)", code="invalid_api_key")


def server_error(message, status=500):
    return RequestError(status, message, kind="server_error")


def failure(error):
    """A bug's error as the client sees it: the kind of exception, not its text (the log has that)."""
    return server_error(f"the server failed on this request ({type(error).__name__}, logged)")


def error_response(error):
    headers = {429: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(error.status)
    return JSONResponse(error.body(), error.status, headers=headers)


async def http_error(request, error):
    """Starlette's own refusals (an unknown path, a wrong method) in the OpenAI error shape."""
    return error_response(RequestError(error.status_code, error.detail))


def event_data(payload):
    return f"data: {json.dumps(payload)}\n\n"
