"""Chapter 12's engine behind a real server: an OpenAI-compatible ``POST /v1/completions`` over HTTP.

One background thread runs the engine (``serving.Engine``'s online API): between two steps it takes the requests
that came (they join the running batch at the next step) and the requests whose clients went away (their blocks go
back to the pool); after each step it hands every request its new token. The HTTP side is a Starlette app served by
uvicorn on the loopback address (127.0.0.1) only: many clients at once, each waiting on its own queue.

The request body is OpenAI's completions API, sent as ``application/json`` (another content type is a 415: a web page
may POST text/plain to 127.0.0.1 unasked) of at most ``MAX_BODY_BYTES`` (else 413), arriving within ``BODY_SECONDS``
(else 408: a client that sends a byte now and then would hold its connection, and the drain on shutdown, forever),
checked before anything runs; a
bad request gets HTTP 400 with OpenAI's error body ``{"error": {"message", "type": "invalid_request_error", "param":
the field, "code"}}`` and touches no other request (so do an unknown path, 404, and method, 405). Supported fields
(any other is a 400 naming it; null is the default, as the official client sends it for None):

* ``model`` (the served model's name; null or absent: that model), ``prompt`` (a string, through the model's
  tokenizer, or a list of token ids), ``max_tokens`` (an integer >= 1, default 16; prompt + max_tokens within the
  model's context),
* ``temperature`` (in [0, 2], default 1; 0 and below 1e-5 are greedy, as in vLLM), ``top_p`` (in (0, 1], default 1),
  ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], default 0; greedy too, before the argmax), ``seed`` (an
  integer; the request's own ``torch.Generator``, so a seeded request gets the same tokens whatever batch it runs
  in; default: a random one),
* ``stop`` (a string or a list of at most 4 non-empty strings: the text ends before the first one, which is not
  returned), ``stream`` (server-sent events, one per token, then ``data: [DONE]``), ``stream_options``
  (``{"include_usage": true}``: a last event with the usage), ``n`` (1 only), ``logprobs`` (null only), ``user``
  (ignored).

No client's request holds the event loop: the prompt is tokenized on a worker thread, after a string too long for
the context in any tokenization is refused; the stop check is linear in the text, whatever the stop strings' length.

The model has no end-of-text token, so a completion ends at max_tokens (finish_reason "length") or at a stop string
("stop"). ``usage`` counts the prompt's tokens and the completion's tokens (those generated, a stop string's included).
A client that disconnects (streaming or not) aborts its request: its blocks go back at once. Stopping the server
(``Server.stop``, or Ctrl-C for ``course serve``) stops accepting connections and drains: running requests finish.

``Server`` runs it in a background thread (a notebook, a test); ``serve`` in the foreground (``course serve``);
``course_lib.bench.serve_http`` drives it with Poisson arrivals and reports time to first token and time per output token
from the streamed tokens, as vLLM's benchmarks/benchmark_serving.py does (``course bench serve-http``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import queue
import random
import threading
import time
from collections import deque
from contextlib import asynccontextmanager

from . import assets
from .decoding import check_settings
from .serving import SEED_RANGE, Engine, Request, StepLog, is_real_number
from .validation import is_count

HOST = "127.0.0.1"  # loopback only: the course's server is for this machine's clients
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "user")
MAX_BODY_BYTES = 2 ** 20  # a larger body is refused (413) without being read to its end
BODY_SECONDS = 30.0  # a body must arrive within this many seconds of its request's headers (else 408)
LOG_STEPS = 1024  # a running server keeps the step log of its last this many steps


class BadRequest(ValueError):
    """A request the server refuses: `message` says why, `param` names the field (None for the body as a whole)."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclasses.dataclass
class Completion:
    """A checked request: the engine's Request, and what the HTTP side needs (stop strings, streaming)."""

    request: Request
    stop: list
    stream: bool
    include_usage: bool


def parse_completion(body, *, name: str, model_name: str, tokenizer, context: int, vocab_size: int, num_blocks: int,
                     block_size: int, token_bytes: int) -> Completion:
    """Check an OpenAI completions body (a dict parsed from JSON); raise BadRequest naming the first bad field.

    name: the engine's name for the request; model_name: the served model; context: the model's context length;
    vocab_size: token ids allowed in [0, vocab_size); num_blocks, block_size: the engine's pool; token_bytes: the
    most UTF-8 bytes one token decodes to (``longest_token``), so that a prompt string too long for the context is
    refused before it is tokenized (it holds at least len(prompt) / token_bytes tokens). A field sent as null takes
    its default."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}", None)
    for key in body:
        if key not in FIELDS:
            raise BadRequest(f"unknown or unsupported field {key!r}; the fields are {', '.join(FIELDS)}", key)
    if body.get("model") is not None and body["model"] != model_name:  # null: the served model, as every field's
        raise BadRequest(f"model must be {model_name!r} (the model this server serves), got {body['model']!r}",
                         "model", 404, "model_not_found")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if len(prompt) > (context - 1) * token_bytes:  # more tokens than the context holds, whatever they are
            raise BadRequest(f"prompt is too long: this model's context is {context} tokens, and a prompt of "
                             f"{len(prompt)} characters holds more than {context - 1}", "prompt",
                             code="context_length_exceeded")
        try:
            ids = tokenizer.encode(prompt)
        except ValueError as error:
            raise BadRequest(f"prompt: {error}", "prompt") from None
    elif isinstance(prompt, list) and len(prompt) >= context:  # refused by its length: its items are never scanned
        raise BadRequest(f"prompt is too long: this model's context is {context} tokens, the prompt holds "
                         f"{len(prompt)} items, leaving no room for a completion", "prompt", code="context_length_exceeded")
    elif isinstance(prompt, list) and all(is_count(t) for t in prompt):
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[0]}", "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of integer token ids (one prompt: no batches), got "
                         f"{_kind(prompt)}", "prompt")
    if not ids:
        raise BadRequest("prompt must hold at least 1 token, got an empty prompt", "prompt")
    max_tokens = _or_default(body, "max_tokens", 16)
    if not is_count(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if len(ids) >= context:
        raise BadRequest(f"prompt is too long: this model's context is {context} tokens, the prompt holds {len(ids)}, "
                         f"leaving no room for a completion", "prompt", code="context_length_exceeded")
    if len(ids) + max_tokens > context:
        raise BadRequest(f"max_tokens is too large: this model's context is {context} tokens, the prompt holds "
                         f"{len(ids)}, so max_tokens must be <= {context - len(ids)}, got {max_tokens}", "max_tokens",
                         code="context_length_exceeded")
    if math.ceil((len(ids) + max_tokens) / block_size) > num_blocks:
        raise BadRequest(f"max_tokens is too large for the server's pool of {num_blocks} blocks of {block_size} tokens: "
                         f"the prompt holds {len(ids)} tokens, so max_tokens must be <= "
                         f"{num_blocks * block_size - len(ids)}, got {max_tokens}", "max_tokens")
    temperature = _setting(body, "temperature", 1.0, vocab_size)
    if temperature > 2:  # OpenAI's cap (the processor takes any temperature >= 0)
        raise BadRequest(f"temperature must be at most 2 (OpenAI's range is [0, 2]), got {body['temperature']!r}",
                         "temperature")
    top_p = _setting(body, "top_p", 1.0, vocab_size)
    presence = _setting(body, "presence_penalty", 0.0, vocab_size)
    frequency = _setting(body, "frequency_penalty", 0.0, vocab_size)
    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(2 ** 63)
    elif not is_count(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise BadRequest(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be null, a non-empty string or a list of at most 4 non-empty strings, got "
                         f"{body.get('stop')!r}", "stop")
    stream = _or_default(body, "stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(f'stream_options must be {{"include_usage": true or false}}, got {options!r}',
                             "stream_options")
    n = _or_default(body, "n", 1)
    if n != 1 or isinstance(n, bool):
        raise BadRequest(f"n must be 1 (one completion per request), got {n!r}", "n")
    if body.get("logprobs") is not None:
        raise BadRequest(f"logprobs must be null (log-probabilities are not returned), got {_kind(body['logprobs'])}",
                         "logprobs")
    if not isinstance(_or_default(body, "user", ""), str):
        raise BadRequest(f"user must be a string, got {_kind(body['user'])}", "user")
    # only the settings that change something: the same draws as a request without them; at temperature 0 the
    # penalties still apply, before the argmax (OpenAI's and vLLM's meaning), and top_p cannot change the argmax
    changed = {key: value for key, value, default in (("top_p", top_p, 1.0), ("presence_penalty", presence, 0.0),
                                                      ("frequency_penalty", frequency, 0.0)) if value != default}
    if temperature == 0:
        changed.pop("top_p", None)
    sampling = {"temperature": temperature, **changed} if temperature > 0 or changed else None  # None: greedy
    request = Request(name, list(ids), max_tokens, sampling=sampling, seed=seed)
    return Completion(request, stop, bool(stream), bool(options and options.get("include_usage")))


def _or_default(body: dict, key: str, default):
    """body[key], or `default` when it is missing or null (the official client sends null for a None argument)."""
    value = body.get(key)
    return default if value is None else value


def longest_token(tokenizer, vocab_size: int) -> int:
    """The most UTF-8 bytes one token of `tokenizer` decodes to (a byte-level token that is part of a character
    decodes to U+FFFD, 3 bytes: never fewer than its own): a token id's text, at most this long."""
    return max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(vocab_size))


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _setting(body: dict, key: str, default: float, vocab_size: int) -> float:
    """The sampling setting `key` of the body as a float (`default` when missing or null): a 400 naming it unless it is
    a finite number in the range its processor checks (``decoding.check_settings``, whose ValueError says the range)."""
    value = body.get(key)
    if value is None:
        return default
    if not is_real_number(value) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {_kind(value)}", key)
    try:
        check_settings(vocab_size, **{key: float(value)})
    except ValueError as error:
        raise BadRequest(str(error), key) from None
    return float(value)


def _error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stop_cut(text: str, stops: list, start: int = 0) -> tuple:
    """How much of `text` can be sent: (end, stopped). The text up to the first stop string, and stopped=True; else
    the text but a character whose bytes are not all there yet (U+FFFD at its end) and the longest tail that could
    begin a stop string (held back until the next tokens tell: a stop may begin in that character), and False.

    start: the end this returned for the text's previous version (the text before it is settled: no stop string
    begins there), so that each call looks only at what is new or held back. A request's calls then cost in all
    about its text's length times its stop strings' number, whatever their length (a 100 KB stop string included)."""
    first = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return first, True
    known = text.rstrip("\ufffd")
    return len(known) - max((_stop_prefix(known, s, start) for s in stops), default=0), False


def _stop_prefix(text: str, stop: str, start: int) -> int:
    """The length of the longest tail of `text`, beginning at `start` or later, that is a proper prefix of `stop`."""
    i = text.find(stop[0], max(start, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


# ----------------------------------------------------------------------------------------------------
# the engine's thread


class EngineLoop:
    """The thread that runs the engine. Other threads talk to it through ``add`` and ``abort`` (both thread-safe).

    ``add(request, deliver)``: the request joins at the next step; ``deliver(event)`` is then called from the engine's
    thread with ("token", id) for each new token but the last, ("done", id) for the last, or ("error", message) when
    the request fails (rejected on arrival, failed in a step, or the engine's fault). ``abort(name)``:
    the request leaves (if it has not already), its blocks go back. ``close()``: finish what runs, then stop.
    ``counts``: requests finished, aborted, failed (rejected on arrival or failed in a step)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict = {}  # name -> deliver, for the requests in the engine
        self.counts = {"finished": 0, "aborted": 0, "failed": 0}
        self.closing = False
        self._fresh()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def add(self, request: Request, deliver) -> None:
        self.inbox.put(("add", request, deliver))

    def abort(self, name: str) -> None:
        self.inbox.put(("abort", name))

    def close(self, timeout: float | None = None) -> None:
        self.inbox.put(("close",))
        self.thread.join(timeout)

    def _fresh(self) -> None:
        """A new pool and a bounded step log (a server runs for days: it keeps only the last LOG_STEPS steps)."""
        self.engine.reset()
        log = StepLog()
        for f in dataclasses.fields(StepLog):
            if isinstance(getattr(log, f.name), list):
                setattr(log, f.name, deque(maxlen=LOG_STEPS))
        self.engine.log = log

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = bool(engine.waiting or engine.running)
            try:
                command = self.inbox.get(block=not busy)  # idle: sleep until someone comes
                while True:
                    try:
                        self._command(command)
                    except Exception as error:  # noqa: BLE001 - the engine's own fault, as in _step
                        self._fail_all(error)
                    command = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if engine.waiting or engine.running:
                self._step()
            elif self.closing and self.inbox.empty():
                return

    def _command(self, command: tuple) -> None:
        engine = self.engine
        if command[0] == "close":
            self.closing = True
        elif command[0] == "add":
            _, request, deliver = command
            if self.closing:
                deliver(("error", "the server is shutting down"))
                return
            try:
                result = engine.add_request(request)
            except ValueError as error:  # a name already in the engine: the HTTP side makes them unique
                deliver(("error", str(error)))
                return
            if result.error:  # rejected on arrival (the HTTP side checked it: only the engine's own limits are left)
                engine.results.pop(request.name)
                self.counts["failed"] += 1
                deliver(("error", result.error))
            else:
                self.streams[request.name] = deliver
        elif command[0] == "abort":
            name = command[1]
            if name in self.streams:  # not finished yet
                engine.abort(name)
                engine.results.pop(name)
                del self.streams[name]
                self.counts["aborted"] += 1

    def _fail_all(self, error: Exception) -> None:
        """The engine's own fault (not one request's): every open request gets the error, then a fresh engine."""
        message = f"the engine failed: {type(error).__name__}: {error}"
        for deliver in self.streams.values():
            deliver(("error", message))
        self.counts["failed"] += len(self.streams)
        self.streams.clear()
        self._fresh()

    def _step(self) -> None:
        engine = self.engine
        try:
            output = engine.step()
        except Exception as error:  # noqa: BLE001 - the engine's own fault
            self._fail_all(error)
            return
        for name in output.finished:
            result = engine.results.pop(name)
            deliver = self.streams.pop(name)
            self.counts["failed" if result.error else "finished"] += 1
            deliver(("error", result.error) if result.error else ("done", output.tokens[name]))
        for name, token in output.tokens.items():
            if name in self.streams:  # not finished in this step
                self.streams[name](("token", token))


# ----------------------------------------------------------------------------------------------------
# the HTTP side


def make_app(model, tokenizer, model_name: str, *, num_blocks: int | None = None, block_size: int = 8,
             token_budget: int = 64, max_num_seqs: int | None = None):
    """The Starlette app: POST /v1/completions, GET /v1/models, GET /health. Its engine runs while the app does
    (started and drained by the ASGI lifespan); ``app.state.engine_loop`` is the ``EngineLoop``.

    num_blocks: the pool (default: room for 32 sequences of the full context)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    context, vocab_size = model.config.block_size, model.config.vocab_size
    num_blocks = num_blocks if num_blocks is not None else 32 * math.ceil(context / max(block_size, 1))  # Engine checks
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget,
                    max_num_seqs=max_num_seqs)
    engine_loop = EngineLoop(engine)
    counter = iter(range(1, 2 ** 62))
    token_bytes = longest_token(tokenizer, vocab_size)

    @asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.close)  # drained already: connections closed

    def error_response(error: BadRequest) -> JSONResponse:
        return JSONResponse(_error_body(str(error), error.param, code=error.code), status_code=error.status)

    async def completions(http: HTTPRequest):
        loop = asyncio.get_running_loop()
        created, cid = int(time.time()), f"cmpl-{next(counter)}-{random.getrandbits(32):08x}"
        try:
            raw = await _read_body(http, MAX_BODY_BYTES, BODY_SECONDS)
            body = _json_body(http.headers.get("content-type"), raw)
            # tokenizing (and checking a long prompt's token ids) is no work for the event loop: other clients wait
            completion = await loop.run_in_executor(None, functools.partial(
                parse_completion, body, name=cid, model_name=model_name, tokenizer=tokenizer, context=context,
                vocab_size=vocab_size, num_blocks=num_blocks, block_size=block_size, token_bytes=token_bytes))
        except BadRequest as error:
            return error_response(error)
        events = asyncio.Queue()

        def deliver(event: tuple) -> None:  # called from the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        engine_loop.add(completion.request, deliver)
        prompt_tokens = len(completion.request.prompt)

        def chunk(text: str, finish: str | None, usage: dict | None = None, choices: bool = True) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}] if choices else [],
                    "usage": usage}

        async def pieces():
            """(text to send, finish_reason or None) as tokens come; a finish_reason ends it; an error raises."""
            tokens, sent = [], 0
            try:
                while True:
                    kind, value = await events.get()
                    if kind == "error":
                        raise RuntimeError(value)
                    tokens.append(value)
                    text = tokenizer.decode(tokens)
                    end, stopped = stop_cut(text, completion.stop, sent)
                    if kind == "done" and not stopped:
                        end = len(text)  # the end: nothing is held back
                    if stopped:
                        engine_loop.abort(cid)
                    finish = "stop" if stopped else "length" if kind == "done" else None
                    if end > sent or finish:
                        yield text[sent:end], finish, len(tokens)
                        sent = end
                    if finish:
                        return
            finally:  # finished, stopped, failed, or the client went away (this generator is cancelled)
                engine_loop.abort(cid)

        def usage(n: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

        if completion.stream:
            async def events_stream():
                try:
                    async for text, finish, n in pieces():
                        yield f"data: {json.dumps(chunk(text, finish))}\n\n"
                        if finish and completion.include_usage:
                            yield f"data: {json.dumps(chunk('', None, usage(n), choices=False))}\n\n"
                except RuntimeError as error:
                    yield f"data: {json.dumps(_error_body(str(error), None, 'server_error'))}\n\n"
                finally:  # also when the client went away while a chunk was being sent
                    engine_loop.abort(cid)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events_stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def collect():
            text, finish, n = "", None, 0
            async for piece, finish, n in pieces():
                text += piece
            return text, finish, n

        outcome = await _unless_disconnected(http, collect)
        if outcome is None:  # the client went away: pieces() aborted the request
            return JSONResponse(_error_body("the client disconnected", None), status_code=499)
        if isinstance(outcome, RuntimeError):
            return JSONResponse(_error_body(str(outcome), None, "server_error"), status_code=500)
        text, finish, n = outcome
        return JSONResponse(chunk(text, finish, usage(n)))

    async def models(http: HTTPRequest):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "course", "max_model_len": context}]})

    async def health(http: HTTPRequest):
        return JSONResponse({"status": "ok", **engine_loop.counts})

    async def http_error(http: HTTPRequest, error: HTTPException):  # an unknown path (404) or method (405)
        message = {404: f"no such path: {http.method} {http.url.path}",
                   405: f"{http.method} is not allowed on {http.url.path}"}.get(error.status_code, str(error.detail))
        return JSONResponse(_error_body(message, None), status_code=error.status_code, headers=error.headers)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])],
                    exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.engine_loop = engine_loop
    return app


async def _read_body(http, limit: int, seconds: float) -> bytes:
    """The request's body, or BadRequest (413) as soon as it is known to exceed `limit` bytes (its Content-Length
    says so, or the bytes read so far do): a larger body is never read to its end; BadRequest (408) when it has not
    ended `seconds` after this call (slowloris); BadRequest (499) when the client disconnects before its body ends."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body is too large: at most {limit} bytes, Content-Length says {declared}", None, 413)
    from starlette.requests import ClientDisconnect

    body = bytearray()

    async def read() -> None:
        async for chunk in http.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise BadRequest(f"the body is too large: at most {limit} bytes", None, 413)

    try:
        await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
        raise BadRequest(f"the body did not arrive within {seconds:g} s ({len(body)} bytes came)", None,
                         408) from None
    except ClientDisconnect:  # gone before its body ended: an answer nobody reads, not a traceback in the log
        raise BadRequest("the client disconnected before its body ended", None, 499) from None
    return bytes(body)


def _json_body(content_type: str | None, raw: bytes):
    """The JSON value of a body sent as application/json; BadRequest otherwise (415 for another content type: a web
    page may POST text/plain to 127.0.0.1 without asking, and must not spend the server's compute)."""
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise BadRequest(f"the body must be sent as Content-Type: application/json, got {content_type!r}", None, 415)
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply", None) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON: {error}", None) from None


async def _unless_disconnected(http, work):
    """await work(), unless the client disconnects first (then work is cancelled and None returned); a RuntimeError
    that work raises is returned."""
    task = asyncio.ensure_future(work())

    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None
    try:
        return task.result()
    except RuntimeError as error:
        return error


def _load(model_name: str):
    """A GPT checkpoint (the engine runs course_lib.gpt.GPT) and its tokenizer."""
    from .gpt import GPT

    model = assets.load(model_name)
    if not isinstance(model, GPT):
        raise ValueError(f"model must be a GPT checkpoint of course_lib.assets with a tokenizer (char-gpt, "
                         f"char-gpt-draft, bpe-gpt): the engine runs course_lib.gpt.GPT, got {model_name} "
                         f"({type(model).__name__})")
    return model, assets.tokenizer(model_name)


class Server:
    """The server in a background thread, on 127.0.0.1 at `port` (0: one the OS chooses): ``start()``, ``url``
    (the OpenAI base URL, ``http://127.0.0.1:PORT/v1``), ``stop()`` (drains: running requests finish). Also a
    context manager. model_name: a checkpoint of course_lib.assets with a tokenizer (default: chapter 12's
    char-gpt); engine settings as ``make_app``'s."""

    def __init__(self, model_name: str = "char-gpt", *, port: int = 0, log_level: str = "warning", **engine):
        import uvicorn

        model, tokenizer = _load(model_name)
        self.app = make_app(model, tokenizer, model_name, **engine)
        self.engine_loop = self.app.state.engine_loop
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=HOST, port=port, log_level=log_level,
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port = None

    def start(self, timeout: float = 30.0) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop accepting connections, let the running requests finish, stop the engine."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model_name: str = "char-gpt", port: int = 8000, **engine) -> None:
    """Serve in the foreground until Ctrl-C (then drain): ``course serve``."""
    import uvicorn

    model, tokenizer = _load(model_name)
    where = f"http://{HOST}:{port}/v1" if port else "the port uvicorn reports below, under /v1"
    print(f"serving {model_name}'s OpenAI-compatible completions API at {where}; Ctrl-C stops it, letting running "
          f"requests finish", flush=True)
    uvicorn.run(make_app(model, tokenizer, model_name, **engine), host=HOST, port=port, log_level="info")
