"""`hf-specformer serve`: an OpenAI-compatible server on one speculative call that keeps running.

    hf-specformer serve                                    # SmolLM2 + the shipped drafter on 127.0.0.1:8000
    curl localhost:8000/v1/chat/completions -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'

One engine thread runs a `generate` call whose `RowFeed` (`Engine`) takes requests between steps and hands each
step's tokens to the requests' asyncio queues. FastAPI serves `/v1/chat/completions` and `/v1/completions` (streamed
or whole), `/v1/models`, `/health` and `/metrics`; docs/serving.md lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ..cpu import cpu_products
from ..generation import generate
from ..generation.batch import NewRow, RowFeed
from ..generation.proposers import NoDrafts

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted (413 beyond)."""


class APIError(Exception):
    """An OpenAI-style error: HTTP `status`, `message`, `type`, `code` and the offending `param`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One completion in flight: the row it asks for, its asyncio queue of engine events, what it produced."""

    row: NewRow
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    done: bool = False

    def put(self, event: tuple) -> None:
        """From the engine thread: ("tokens", ids), ("end", steps, accepted) or ("error", message)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine(RowFeed):
    """The engine thread and its feed: requests wait in `incoming` (at most `max_waiting` beyond the slots), join the
    running call between steps, and hear their tokens and their end."""

    def __init__(self, target, tokenizer, drafter=None, companion=None, max_batch_size: int = 16,
                 memory_budget_gib: float | None = None, max_prompt_tokens: int = 1024, max_tokens: int = 512,
                 max_waiting: int = 64):
        super().__init__([])
        self.target, self.tokenizer, self.drafter, self.companion = target, tokenizer, drafter, companion
        self.max_batch_size, self.memory_budget_gib = max_batch_size, memory_budget_gib
        self.max_prompt_tokens, self.max_tokens, self.max_waiting = max_prompt_tokens, max_tokens, max_waiting
        self.incoming: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[int, Request] = {}  # the call's row -> its request
        self.handed: list[Request] = []  # requests the last poll handed over, until their rows are known
        self.in_flight, self.lock = 0, threading.Lock()
        self.stopping = threading.Event()
        self.metrics = dict.fromkeys(("requests", "failed", "left", "tokens", "accepted", "steps", "step_seconds",
                                      "peak_rows"), 0)
        self.last_poll: float | None = None
        self.thread = threading.Thread(target=self._run, name="hf-specformer-engine", daemon=True)

    def submit(self, request: Request) -> None:
        """Queues `request`, or raises a 429 when the waiting queue is full."""
        with self.lock:
            if self.in_flight >= self.max_batch_size + self.max_waiting:
                raise APIError(429, "The server is at capacity; retry later.", "rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.in_flight += 1
            self.metrics["requests"] += 1
        self.incoming.put(request)

    def cancel(self, request: Request) -> None:
        """Frees `request`'s slot within a step (a client that left, a stop string met)."""
        if not request.cancelled and not request.done:
            request.cancelled = True
            self.cancelled.put(request)

    def _done(self, request: Request) -> None:
        """`request` leaves (ended, cancelled or failed), once."""
        with self.lock:
            if request.done:
                return
            request.done = True
            self.in_flight -= 1
        if request.row.row is not None and self.requests.get(request.row.row) is request:
            del self.requests[request.row.row]

    # ----- the feed, called by the engine between steps ------------------------------------------------------------
    def poll(self, idle: bool):
        now = time.perf_counter()
        if self.last_poll is not None and not idle:
            self.metrics["steps"] += 1
            self.metrics["step_seconds"] += now - self.last_poll
        new, cancelled = self._drain(self.incoming), self._drain(self.cancelled)
        while idle and not new and not cancelled:
            if self.stopping.is_set():
                return None
            try:
                new.append(self.incoming.get(timeout=0.1))
            except queue.Empty:
                continue
        self.last_poll = time.perf_counter()
        self._register()
        for request in cancelled + [request for request in new if request.cancelled]:
            self._done(request)
        self.handed = [request for request in new if not request.cancelled]
        return [request.row for request in self.handed], [request.row for request in cancelled]

    @staticmethod
    def _drain(source: queue.SimpleQueue) -> list:
        items = []
        while True:
            try:
                items.append(source.get_nowait())
            except queue.Empty:
                return items

    def committed(self, rows: list[int], tokens: list[list[int]]) -> None:
        self._register()
        self.metrics["peak_rows"] = max(self.metrics["peak_rows"], len(rows))
        for row, ids in zip(rows, tokens):
            if row in self.requests:
                self.metrics["tokens"] += len(ids)
                self.requests[row].put(("tokens", ids))

    def __call__(self, finished) -> None:
        self._register()
        request = self.requests.get(finished.row)
        if request is not None:
            self.metrics["accepted"] += finished.accepted
            request.put(("end", finished.steps, finished.accepted))
            self._done(request)

    def _register(self) -> None:
        """Requests the last poll handed over now know their rows."""
        for request in self.handed:
            self.requests[request.row.row] = request
        self.handed = []

    # ----- the engine thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.stopping.set()
        self.thread.join(timeout)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                first = self.incoming.get(timeout=0.1)
            except queue.Empty:
                continue
            if first.cancelled:
                self._done(first)
                continue
            try:
                self._session(first)
            except Exception as error:  # a failing call fails its requests; the next one starts afresh
                logger.exception("engine call failed")
                for request in list(self.requests.values()) + self.handed:
                    self.metrics["failed"] += 1
                    request.put(("error", f"{type(error).__name__}: {error}"))
                    self._done(request)
                self.requests, self.handed = {}, []

    def _session(self, first: Request) -> None:
        """One `generate` call, which runs as long as requests come."""
        width, pad = self.max_prompt_tokens, self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        prompt = first.row.prompt_ids
        device = self.target.device
        input_ids = torch.tensor([[pad] * (width - len(prompt)) + prompt], device=device)
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt)], device=device)
        first.row.row = 0
        self.initial_rows, self.requests, self.handed, self.last_poll = [first.row], {0: first}, [], None
        speculation = {"max_batch_size": self.max_batch_size, "memory_budget": self.memory_budget_gib and
                       self.memory_budget_gib * 2**30}
        models = [model for model in (self.target, self.drafter, self.companion) if model is not None]
        with cpu_products(*models):  # (on the CPU: the few-row products, for plain steps as for speculation)
            generate(self.target, input_ids=input_ids, attention_mask=mask, max_new_tokens=self.max_tokens,
                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad,
                     assistant_model=self.drafter if self.drafter is not None else NoDrafts(),
                     companion_model=self.companion, sampling_seeds=[first.row.seed], row_finished=self,
                     speculation_config={k: v for k, v in speculation.items() if v})


# ----- requests and responses ------------------------------------------------------------------------------------
def _number(body: dict, name: str, default, low: float, high: float, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
            or not low <= value <= high:
        raise APIError(400, f"`{name}` must be a number in [{low}, {high}], got {value!r}.", param=name)
    return kind(value)


def parse_request(body: dict, tokenizer, engine: Engine, model_name: str, chat: bool) -> tuple[NewRow, list[str]]:
    """A completion request's JSON -> (the row it asks for, its stop strings); APIError on bad input."""
    if body.get("model") not in (None, model_name):
        raise APIError(400, f"The model `{body.get('model')}` does not exist; this server serves `{model_name}`.",
                       param="model", code="model_not_found")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise APIError(400, "`messages` must be a non-empty list of {role, content} objects.", param="messages")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise APIError(400, "`prompt` must be a non-empty string.", param="prompt")
    prompt_ids = tokenizer(text, add_special_tokens=not chat).input_ids
    if len(prompt_ids) > engine.max_prompt_tokens:
        raise APIError(400, f"The prompt has {len(prompt_ids)} tokens; this server's context takes "
                            f"{engine.max_prompt_tokens}.", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if body.get("n", 1) != 1:
        raise APIError(400, "Only `n` = 1 is served.", param="n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, engine.max_tokens, 1, engine.max_tokens, int)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise APIError(400, "`stop` must be a string or a list of up to 4 non-empty strings.", param="stop")
    seed = _number(body, "seed", None, -2**63, 2**63 - 1, int)
    row = NewRow(prompt_ids, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                 _number(body, "top_p", 1.0, 0.0, 1.0) or 1e-6, random.getrandbits(62) if seed is None else seed)
    return row, stop


class Answer:
    """The text of one request as its tokens come: decoded whole, handed out in pieces, cut before a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.ids, self.sent = tokenizer, stop, [], ""
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        """The new text after `ids` (held back while it ends inside a character or might begin a stop string)."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stop if s in text), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        elif text.endswith("\ufffd"):
            return ""
        else:
            text = text[: len(text) - max((len(s) - 1 for s in self.stop), default=0)]
        if len(text) <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def rest(self) -> str:
        """What was held back, at the end."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.sent = text[len(self.sent):], text
        return piece


def build_app(engine: Engine, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application on `engine`."""
    async def guard(http: HTTPRequest):
        """The key on every endpoint but /health; the declared body size. (A dependency, not an HTTP middleware,
        which would hide a client's leaving from `is_disconnected`.)"""
        if api_key and http.url.path != "/health" and http.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "Invalid or missing API key.", "authentication_error", code="invalid_api_key")
        if int(http.headers.get("content-length") or 0) > max_body_bytes:
            raise APIError(413, f"The body exceeds {max_body_bytes} bytes.")

    app = FastAPI(title="hf-specformer", docs_url=None, redoc_url=None, dependencies=[Depends(guard)])

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "hf-specformer"}]}

    @app.get("/metrics")
    async def metrics():
        m = engine.metrics
        lines = [f"hf_specformer_requests_total {m['requests']}", f"hf_specformer_requests_failed_total {m['failed']}",
                 f"hf_specformer_requests_left_total {m['left']}",
                 f"hf_specformer_generated_tokens_total {m['tokens']}",
                 f"hf_specformer_accepted_drafts_total {m['accepted']}",
                 f"hf_specformer_requests_in_flight {engine.in_flight}",
                 f"hf_specformer_running_rows {len(engine.requests)}",
                 f"hf_specformer_queue_depth {max(engine.in_flight - len(engine.requests), 0)}",
                 f"hf_specformer_step_seconds_sum {m['step_seconds']:.6f}", f"hf_specformer_step_seconds_count "
                 f"{m['steps']}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def body_of(http: HTTPRequest) -> dict:
        raw = await http.body()
        if len(raw) > max_body_bytes:
            raise APIError(413, f"The body exceeds {max_body_bytes} bytes.")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"The body is not valid JSON: {error}.") from None
        if not isinstance(body, dict):
            raise APIError(400, "The body must be a JSON object.")
        return body

    async def complete(http: HTTPRequest, chat: bool):
        body = await body_of(http)
        row, stop = parse_request(body, engine.tokenizer, engine, model_name, chat)
        request = Request(row, asyncio.get_running_loop())
        engine.submit(request)
        answer, created = Answer(engine.tokenizer, stop), int(time.time())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

        async def events():
            """(text piece, finish reason or None, usage or None) as the engine's events come."""
            while True:
                event = await request.events.get()
                if event[0] == "left":
                    return
                if event[0] == "error":
                    raise APIError(500, event[1], "server_error")
                if event[0] == "tokens":
                    piece = answer.add(event[1])
                    if answer.stopped:
                        engine.cancel(request)
                        yield piece, "stop", _usage(row, answer, 0)
                        return
                    yield piece, None, None
                else:
                    done = len(answer.ids) >= row.max_new_tokens
                    yield answer.rest(), "length" if done else "stop", _usage(row, answer, event[2])
                    return

        def _usage(row, answer, accepted):
            return CompletionUsage(prompt_tokens=len(row.prompt_ids), completion_tokens=len(answer.ids),
                                   total_tokens=len(row.prompt_ids) + len(answer.ids),
                                   completion_tokens_details={"accepted_prediction_tokens": accepted})

        def chunk(piece: str, reason: str | None, usage) -> str:
            if chat:
                message = ChatCompletionChunk(id=ident, object="chat.completion.chunk", created=created,
                                              model=model_name, usage=usage, choices=[{
                                                  "index": 0, "delta": {"role": "assistant", "content": piece},
                                                  "finish_reason": reason}])
            else:  # (a `Completion` requires a finish reason, which chunks before the last lack)
                return "data: " + json.dumps({
                    "id": ident, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}],
                    **({"usage": usage.model_dump(exclude_none=True)} if usage else {})}) + "\n\n"
            return f"data: {message.model_dump_json(exclude_none=True)}\n\n"

        if body.get("stream"):
            async def stream():
                ended = False
                try:
                    async for piece, reason, usage in events():
                        yield chunk(piece, reason, usage)
                    yield "data: [DONE]\n\n"
                    ended = True
                finally:
                    engine.metrics["left"] += not ended
                    engine.cancel(request)  # a client that left frees its slot (a no-op once the row ended)
            return StreamingResponse(stream(), media_type="text/event-stream")

        async def watch():
            """A client that leaves before its whole answer frees the slot within a step."""
            while not await http.is_disconnected():
                await asyncio.sleep(0.05)
            engine.metrics["left"] += 1
            engine.cancel(request)
            request.events.put_nowait(("left",))

        watcher = asyncio.create_task(watch())
        try:
            pieces = [event async for event in events()]
        finally:
            watcher.cancel()
            engine.cancel(request)
        if not pieces or pieces[-1][1] is None:  # (the client left: nobody reads an answer)
            return Response(status_code=499)
        text, (_, reason, usage) = "".join(p for p, _, _ in pieces), pieces[-1]
        if chat:
            return ChatCompletion(id=ident, object="chat.completion", created=created, model=model_name, usage=usage,
                                  choices=[{"index": 0, "message": {"role": "assistant", "content": text},
                                            "finish_reason": reason}]).model_dump(exclude_none=True)
        return Completion(id=ident, object="text_completion", created=created, model=model_name, usage=usage,
                          choices=[{"index": 0, "text": text, "finish_reason": reason}]).model_dump(exclude_none=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await complete(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await complete(http, chat=False)

    return app


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of `hf-specformer serve`."""
    from ..targets import DEFAULT_TARGET, DTYPES

    parser = argparse.ArgumentParser(prog="hf-specformer serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", dest="target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients name (default: --model)")
    parser.add_argument("--drafter", default=None, help="SpecFormer drafter folder (default: the shipped one)")
    parser.add_argument("--companion", default=None, help="Speculative Verification companion folder")
    parser.add_argument("--plain", action="store_true", help="no speculation: plain steps, continuous batching")
    parser.add_argument("--max-batch-size", type=int, default=16, help="rows decoded at once (default: %(default)s)")
    parser.add_argument("--memory-budget-gib", type=float, default=None, help="fewer rows where they would not fit")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="longest prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=512, help="most new tokens a request may ask for")
    parser.add_argument("--max-waiting", type=int, default=64, help="requests waiting beyond the rows (then 429)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("HF_SPECFORMER_API_KEY"),
                        help="clients must send `Authorization: Bearer KEY` (default: $HF_SPECFORMER_API_KEY)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    parser.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return parser


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from ..targets import load_companion, load_drafter, target_from_args

    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_batch_size", "max_prompt_tokens", "max_tokens", "port"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("Serving on %s without --api-key: anyone who reaches this address may use the model.",
                       args.host)
    target, tokenizer = target_from_args(args)
    drafter = None if args.plain else load_drafter(args.drafter, target)
    companion = None if args.companion is None else load_companion(args.companion, target)
    engine = Engine(target, tokenizer, drafter, companion, args.max_batch_size, args.memory_budget_gib,
                    args.max_prompt_tokens, args.max_tokens, args.max_waiting)
    app = build_app(engine, args.served_model_name or args.target, args.api_key)
    engine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.drain_timeout)
    finally:
        engine.stop(args.drain_timeout)


if __name__ == "__main__":
    main()
