"""`shipyard serve`: any engine behind an OpenAI-compatible `/v1/completions` endpoint.

The request and response follow the OpenAI completions API with the vLLM extensions an RL client needs:
`prompt` may be token ids, `stop_token_ids` ends on given ids, and every choice carries `token_ids` and
(with `logprobs`) the sampled tokens' logprobs; `return_tokens_as_token_ids` writes tokens as `token_id:N`
like vLLM. So `OpenAIEngine` is tested against a real server, and other harnesses can use a shipyard model.

`POST /v1/weights` loads a versioned weight payload (bf16 or MXFP8 safetensors bytes, `shipyard.models.payload`):
the trainer's push. Completions report the `policy_version` they were sampled with.

Concurrent requests are batched. A `LocalEngine` batches continuously by itself: every sequence is submitted to it
at once and joins the running decode batch as soon as a slot is free (`LocalEngine(max_batch=…)`), so a short request
never waits for a long one to finish. Other engines (`replay:`, `openai:`) get what is queued as one `engine.generate`
call from a worker thread (up to `max_batch`, after waiting `batch_window` seconds for stragglers).

Any client on the port is untrusted (docs/security.md), so:

* **Authentication** (`shipyard.httpguard`): `/v1/weights` — and every path not listed below — needs the operator's
  token (generated at start unless given); `/v1/completions` and `/v1/models` need `api_key` only when one is set
  (like vLLM's `--api-key`); `/health` is open.
* **Bounded work.** Bodies are size-limited (small for completions, `max_weights_body` for weights). `max_tokens`
  is refused over `max_tokens` or when prompt + max_tokens exceeds the model's context (vLLM's rule: refuse, never
  clamp silently — a client must know what it gets), and a request holds at most `max_sequences` sequences.
  These caps bound the work one request can cause; sequences waiting for a slot beyond `max_queue` make the
  server answer 503.
* **No work for what would be refused.** Tokenizing costs time in proportion to the text (8 MB: ~10 s), so prompt
  sizes are checked before it: a text prompt longer than (context − max_tokens) × `chars_per_token` characters
  cannot fit and is refused untokenized (`chars_per_token`: the tokenizer's longest token, at most
  `MAX_CHARS_PER_TOKEN`), an id list longer than context − max_tokens likewise; the prompts of a request are then
  tokenized in order and the first one over the context ends it. Big tokenizations run off the event loop, at most
  `TOKENIZE_SLOTS` at once, and small ones never queue behind them.
* **Isolation.** Every field is validated by one pydantic schema (and the vocabulary / context checks) before
  anything is queued; a `LocalEngine` fails only the sequence that raised, and if another engine's `generate` still
  raises for a batch, each request is retried alone, so only the faulty one fails.
* **Cancellation.** A client that disconnects has its queued requests dropped and its running ones stopped at the
  next decode step (`GenerationRequest.cancelled`). On SIGTERM (`run`) every generation stops between two steps,
  in-flight clients get 503, and the process exits within about a second.
* **Weights** are decoded and checked completely before any tensor changes (`decode`, `update_weights` are
  all-or-nothing), one push at a time. A push must carry every weight of the model (a partial one would be labelled
  as a new version while most of the model stays old: 400 naming the missing tensors) and a version above the
  served one (409 otherwise: versions never go backwards).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from shipyard import httpguard
from shipyard.models.engine import (
    MAX_SEED,
    MIN_TEMPERATURE,
    Completion,
    Engine,
    GenerationRequest,
    SamplingParams,
    VersionConflict,
)
from shipyard.models.local import LocalEngine
from shipyard.models.payload import decode

log = logging.getLogger(__name__)

UNKNOWN_CONTEXT = 32768  # the context of an engine that does not say (replay:, openai:), without --max-model-len
MAX_CHARS_PER_TOKEN = 32  # the character bound assumes no token is longer (a longer average is not a real prompt)
TOKENIZE_SLOTS = 2  # requests tokenizing big prompts at once; the default executor has cores + 4 threads
SMALL_PROMPTS = 1 << 16  # characters + ids of a request that tokenizes without waiting for a slot (~10 ms)


@dataclass
class ServeConfig:
    token: str | None = None  # bearer token for /v1/weights (and /docs etc.); None: one is generated (app.state.token)
    api_key: str | None = None  # when set, /v1/completions and /v1/models need it
    max_tokens: int = 4096  # most tokens one completion may ask for
    max_model_len: int | None = None  # most prompt + completion tokens; None: the engine's context length
    max_batch: int = 8  # sequences decoded together (a LocalEngine's max_batch), or per generate call
    batch_window: float = 0.01  # seconds the worker waits for stragglers before starting a batch
    max_sequences: int = 64  # prompts × n in one request
    max_queue: int = 1024  # sequences waiting for the worker; beyond: 503
    max_body: int = 8 << 20  # bytes of a completions (or any non-weights) request body
    max_weights_body: int = 4 << 30  # bytes of a weight payload (a 0.5B model in bf16 is ~1 GB)


Stop = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class SamplingRequest(BaseModel):
    """The fields the completions and chat endpoints share, validated alike."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, max_length=1000)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Stop | list[Stop] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    n: int = Field(1, ge=1, le=64)
    stop_token_ids: list[int] | None = Field(None, max_length=256)
    logprobs: int | None = Field(None, ge=0, le=1)
    return_tokens_as_token_ids: bool = False


class ShuttingDown(RuntimeError):
    pass


class Overloaded(RuntimeError):
    pass


class Gone(RuntimeError):
    """The request's client disconnected before its turn came."""


class Batcher:
    """Hands the requests of many HTTP handlers to the engine: straight to a `LocalEngine`'s continuous batching
    (`submit`), or, for other engines, as `engine.generate` batches from one worker thread.

    `stopping` is a plain attribute so a signal handler can set it: then queued requests fail with `ShuttingDown` and
    the requests `create_app` makes report themselves cancelled, so running sequences end at their next step."""

    def __init__(self, engine: Engine, max_batch: int = 8, batch_window: float = 0.01, max_queue: int = 1024):
        self.engine, self.max_batch, self.batch_window, self.max_queue = engine, max_batch, batch_window, max_queue
        self.stopping = False
        self.queue: queue.Queue[tuple[GenerationRequest, Future] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="shipyard-batcher", daemon=True)
        if not isinstance(engine, LocalEngine):
            self.thread.start()

    def waiting(self) -> int:
        """Sequences waiting for the engine (queued, not yet decoding)."""
        if isinstance(self.engine, LocalEngine):
            return max(0, self.engine.load() - self.engine.max_batch)
        return self.queue.qsize()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            batch = [item]
            deadline = time.monotonic() + self.batch_window
            while len(batch) < self.max_batch:
                try:
                    nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)
                    break
                batch.append(nxt)
            live = []
            for req, fut in batch:
                if not fut.set_running_or_notify_cancel():
                    continue  # its client left while it waited
                if self.stopping:
                    fut.set_exception(ShuttingDown("the server is shutting down"))
                elif req.cancelled is not None and req.cancelled():
                    fut.set_exception(Gone("the client has gone"))
                else:
                    live.append((req, fut))
            if live:
                self._run(live)
        while True:  # closed: fail whatever is left
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(ShuttingDown("the server is shutting down"))

    def _run(self, batch: list[tuple[GenerationRequest, Future]]) -> None:
        """Generate a batch; if the engine raises, retry each request alone so only the faulty one fails."""
        try:
            results = self.engine.generate([req for req, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the engine returned {len(results)} completions for {len(batch)} requests")
        except Exception as e:
            if len(batch) == 1:
                batch[0][1].set_exception(e)
                return
            log.warning("a batch of %d failed (%s: %s); retrying its requests one by one", len(batch),
                        type(e).__name__, e)
            for item in batch:
                self._run([item])
            return
        for (_, fut), result in zip(batch, results, strict=True):
            fut.set_result(result)

    def submit(self, requests: list[GenerationRequest]) -> list[asyncio.Future]:
        """Queue requests (from the event loop's thread); their futures. Raises `ShuttingDown` or `Overloaded`."""
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        waiting = self.waiting()
        if waiting + len(requests) > self.max_queue:
            raise Overloaded(f"{waiting} sequences are waiting (limit {self.max_queue})")
        if isinstance(self.engine, LocalEngine):
            return [asyncio.wrap_future(self.engine.submit(req)) for req in requests]
        futures = []
        for req in requests:
            fut: Future = Future()
            self.queue.put((req, fut))
            futures.append(asyncio.wrap_future(fut))
        return futures

    def close(self) -> None:
        self.stopping = True  # a LocalEngine's running sequences see it at their next step (their `cancelled`)
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(timeout=1)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return httpguard.error_response(status, kind, message, headers)


def create_app(engine: Engine, served_name: str, config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    if isinstance(engine, LocalEngine):
        engine.max_batch = config.max_batch  # sequences decoded together (read by the engine at every step)
    batcher = Batcher(engine, max_batch=config.max_batch, batch_window=config.batch_window,
                      max_queue=config.max_queue)
    context = (config.max_model_len or (engine.max_model_len if isinstance(engine, LocalEngine) else None)
               or UNKNOWN_CONTEXT)
    per_token = chars_per_token(engine.tokenizer)
    weights_lock = asyncio.Lock()
    tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="shipyard model server", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.token = config.token or httpguard.new_token()
    open_to_key = {"/v1/completions": config.api_key, "/v1/models": config.api_key,
                   "/v1/chat/completions": config.api_key}  # the chat route: shipyard.harness.chat_api
    httpguard.install(app, token=app.state.token, max_body=config.max_body, open_paths=("/health",),
                      path_tokens=open_to_key, path_max_body={"/v1/weights": config.max_weights_body})

    @app.exception_handler(StarletteHTTPException)  # FastAPI's and the router's own (404, 405)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn; no traceback sent
        return _error(500, f"internal error ({type(exc).__name__}); see the server's log")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served_name, "policy_version": engine.policy_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "shipyard"}]}

    @app.post("/v1/weights")
    async def weights(request: Request) -> dict[str, Any]:
        if not isinstance(engine, LocalEngine):
            raise HTTPException(400, f"this server's engine ({engine.name}) has no weights to update; push to a "
                                     "`shipyard serve` of a local model")
        async with weights_lock:  # one payload in memory at a time
            body = await request.body()
            start = time.perf_counter()
            try:
                version, count = await asyncio.to_thread(_load_weights, engine, body)
            except VersionConflict as e:
                raise HTTPException(409, str(e)) from None
            except (ValueError, KeyError) as e:
                raise HTTPException(400, str(e.args[0]) if isinstance(e, KeyError) else str(e)) from None
        return {"version": version, "tensors": count, "bytes": len(body),
                "seconds": round(time.perf_counter() - start, 4)}

    async def generate(request: Request, prompts: list[list[int]], n: int, sampling: Callable[[int | None],
                       SamplingParams], seed: int | None) -> list[Completion] | None:
        """`n` completions of each prompt through the batcher (choice k draws with seed + k), or None when the client
        disconnected first; the request's errors as HTTP errors. Shared by /v1/completions and the chat endpoint."""
        gone = threading.Event()
        cancelled = lambda: gone.is_set() or batcher.stopping  # noqa: E731
        requests = []
        for p in prompts:
            for k in range(n):
                try:
                    params = sampling(None if seed is None else (seed + k) % (MAX_SEED + 1))
                except ValueError as e:
                    raise HTTPException(400, str(e)) from None
                requests.append(GenerationRequest(p, params, cancelled))
        try:
            futures = batcher.submit(requests)
        except ValueError as e:  # the engine's own checks (a LocalEngine: ids in its model's vocabulary)
            raise HTTPException(400, f"the engine refused this request: {e}") from None
        except ShuttingDown:
            raise HTTPException(503, "the server is shutting down; send the request to another server") from None
        except Overloaded as e:
            raise HTTPException(503, f"the server is overloaded ({e}); retry later", {"Retry-After": "1"}) from None
        results = await _until_disconnected(request, futures, gone)
        if results is not None and any(c.finish_reason == "abort" for c in results):
            raise HTTPException(503, "the server is shutting down and stopped this generation; retry elsewhere")
        return results

    app.state.generate = generate
    app.state.context = context
    app.state.serve_config = config

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.stream:
            raise HTTPException(400, "streaming is not supported by shipyard serve; set stream=false")
        if body.model not in (None, served_name):
            raise HTTPException(404, f"model '{body.model}' is not served here; this server serves '{served_name}'")
        texts = _split_prompts(body.prompt)
        sequences = len(texts) * body.n
        if sequences > config.max_sequences:  # checked before tokenizing anything
            raise HTTPException(400, f"this request asks for {sequences} sequences (prompts × n); this server's limit "
                                     f"is {config.max_sequences} per request: split it")
        _check_limits(engine, body, texts, config, context, per_token)
        if sum(len(p) for p in texts) <= SMALL_PROMPTS:
            prompts = await asyncio.to_thread(_tokenize, engine, texts, body.max_tokens, context)
        else:
            async with tokenize_slots:
                prompts = await asyncio.to_thread(_tokenize, engine, texts, body.max_tokens, context)
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        stop_ids = tuple(body.stop_token_ids or ()) or _default_stop_ids(engine)
        results = await generate(request, prompts, body.n, lambda seed: SamplingParams(
            body.max_tokens, body.temperature, body.top_p, stops, stop_ids, seed), body.seed)
        if results is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        return _response(engine, served_name, body, prompts, results)

    return app


async def _until_disconnected(request: Request, futures: list[asyncio.Future],
                              gone: threading.Event) -> list[Completion] | None:
    """The completions, or None when the client disconnected first; either way no generation of this request
    outlives the handler (queued ones are cancelled, running ones see `gone` at their next step)."""
    gathered = asyncio.gather(*futures)

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            return None
        try:
            return gathered.result()
        except (ShuttingDown, Gone):
            raise HTTPException(503, "the server is shutting down; send the request to another server") from None
        except ValueError as e:
            raise HTTPException(400, f"the engine refused this request: {e}") from None
        except Exception as e:
            log.exception("generation failed")
            raise HTTPException(500, f"generation failed ({type(e).__name__}: {e})") from None
    finally:
        watcher.cancel()
        gone.set()  # the client left, or the handler ended (a failed sequence's siblings need not run on)
        gathered.cancel()  # queued sequences never start


def _load_weights(engine: LocalEngine, body: bytes) -> tuple[int, int]:
    version, tensors = decode(body)
    engine.update_weights(version, tensors, complete=True)
    return version, len(tensors)


def chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for, at most `MAX_CHARS_PER_TOKEN`: its longest vocabulary
    entry (added and special tokens included, as text may spell them). A byte-level token's entry has a character per
    byte and a SentencePiece piece one per character, so a text of more than `n` × this many characters encodes to
    more than `n` tokens. (A tokenizer that drops or merges characters — a normalizer, a fused unknown token — can
    encode a longer text to fewer tokens: such a valid prompt is refused, and can be sent as ids.)"""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(1, min(longest, MAX_CHARS_PER_TOKEN))


def _check_limits(engine: Engine, body: CompletionRequest, texts: list[str | list[int]], config: ServeConfig,
                  context: int, per_token: int) -> None:
    """Everything that can be checked before tokenizing, in time independent of the prompts' size."""
    if body.max_tokens > config.max_tokens:
        raise HTTPException(400, f"max_tokens={body.max_tokens} is over this server's limit of {config.max_tokens} "
                                 "(shipyard serve --max-tokens-limit); ask for fewer")
    room = context - body.max_tokens  # the most tokens a prompt may have
    if room < 1:
        raise HTTPException(400, f"max_tokens={body.max_tokens} leaves no room for a prompt in the model's context "
                                 f"of {context} tokens; ask for at most {context - 1} tokens")
    for p in texts:
        if isinstance(p, str) and len(p) > room * per_token:
            raise HTTPException(400, f"a prompt of {len(p)} characters cannot fit: with max_tokens={body.max_tokens}"
                                     f" the model's context of {context} tokens leaves {room} for the prompt, and "
                                     f"this tokenizer's tokens are at most {per_token} characters long, so prompts "
                                     f"are refused untokenized past {room * per_token} characters; shorten it (or "
                                     "send it as token ids if its tokens really are longer)")
        if isinstance(p, list) and len(p) > room:
            raise _too_long(len(p), body.max_tokens, context)
    vocab = len(engine.tokenizer)
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
    if bad:
        raise HTTPException(400, f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")


def _response(engine: Engine, served_name: str, body: CompletionRequest, prompts: list[list[int]],
              results: list[Completion]) -> dict[str, Any]:
    tok = engine.tokenizer
    choices = []
    for i, c in enumerate(results):
        choice: dict[str, Any] = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                                  "token_ids": c.token_ids, "logprobs": None, "policy_version": c.policy_version}
        if c.token_versions:  # the completion spans a weight update: the version of each token
            choice["token_versions"] = c.token_versions
        if body.logprobs is not None:
            tokens = ([f"token_id:{t}" for t in c.token_ids] if body.return_tokens_as_token_ids
                      else tok.convert_ids_to_tokens(c.token_ids))
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                                  "text_offset": None}
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts) * body.n
    completion_tokens = sum(len(c.token_ids) for c in results)
    # The version the samples were drawn with (the oldest, should a weight push land between two batches), not
    # the engine's version now.
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served_name, "choices": choices, "policy_version": min(c.policy_version for c in results),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _default_stop_ids(engine: Engine) -> tuple[int, ...]:
    eos = engine.tokenizer.eos_token_id
    return (eos,) if eos is not None else ()


def _split_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a text or an id list. The schema makes a list homogeneous (all ids, texts or id
    lists), so its first item tells which: no pass over the ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HTTPException(400, "prompt is empty")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def _too_long(tokens: int, max_tokens: int, context: int) -> HTTPException:
    ask = f" or ask for at most {context - tokens} tokens" if tokens < context else ""
    return HTTPException(400, f"a prompt of {tokens} tokens plus max_tokens={max_tokens} is over the model's context "
                             f"of {context} tokens; shorten the prompt to at most {context - max_tokens} tokens{ask}")


def _tokenize(engine: Engine, texts: list[str | list[int]], max_tokens: int, context: int) -> list[list[int]]:
    """Token ids of each prompt (ids checked against the vocabulary), in order; the first prompt over the context
    ends the request, so no more than one over-long prompt is ever tokenized."""
    out = []
    vocab = len(engine.tokenizer)
    for p in texts:
        if isinstance(p, str):
            ids = engine.tokenizer.encode(p)
        else:
            ids = p
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise HTTPException(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise HTTPException(400, "a prompt encodes to zero tokens")
        if len(ids) + max_tokens > context:
            raise _too_long(len(ids), max_tokens, context)
        out.append(ids)
    return out


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT first telling the batcher to stop (so the in-flight generations end at their next
    decode step and uvicorn's wait for open connections is short)."""

    def __init__(self, config: uvicorn.Config, batcher: Batcher):
        super().__init__(config)
        self.batcher = batcher

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.batcher.stopping = True  # a plain store: safe in a signal handler
        super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, *, max_connections: int = 256, graceful_seconds: float = 1.0) -> None:
    """Serve `app` (from `create_app`) until SIGTERM/SIGINT; then exit within about `graceful_seconds`."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", limit_concurrency=max_connections,
                            timeout_graceful_shutdown=graceful_seconds)
    _Server(config, app.state.batcher).run()
