"""`shipyard serve`: any engine behind an OpenAI-compatible `/v1/completions` endpoint.

The request and response follow the OpenAI completions API with the vLLM extensions an RL client needs:
`prompt` may be token ids, `stop_token_ids` ends on given ids, and every choice carries `token_ids` and
(with `logprobs`) the sampled tokens' logprobs; `return_tokens_as_token_ids` writes tokens as `token_id:N`
like vLLM. So `OpenAIEngine` is tested against a real server, and other harnesses can use a shipyard model.

`POST /v1/weights` loads a versioned weight payload (bf16 or MXFP8 safetensors bytes, see `shipyard.train.sync`):
the trainer's push. Completions report the `policy_version` they were sampled with.

Concurrent requests are batched: a worker thread takes whatever is queued (up to `max_batch`, after waiting
`batch_window` seconds for stragglers) and runs it as one `engine.generate` call.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from shipyard.models.engine import Completion, Engine, GenerationRequest, SamplingParams


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=1)
    return_tokens_as_token_ids: bool = False
    stream: bool = False


class Batcher:
    """Collects requests from many HTTP handlers into `engine.generate` batches on one worker thread."""

    def __init__(self, engine: Engine, max_batch: int = 8, batch_window: float = 0.01):
        self.engine, self.max_batch, self.batch_window = engine, max_batch, batch_window
        self.queue: queue.Queue[tuple[GenerationRequest, Future] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="shipyard-batcher", daemon=True)
        self.thread.start()

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
            try:
                results = self.engine.generate([req for req, _ in batch])
            except Exception as e:  # the error belongs to every request of the batch
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                fut.set_result(result)

    async def submit(self, req: GenerationRequest) -> Completion:
        fut: Future = Future()
        self.queue.put((req, fut))
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error",
                                                               "code": status}})


def create_app(engine: Engine, served_name: str, max_batch: int = 8) -> FastAPI:
    batcher = Batcher(engine, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="shipyard model server", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served_name, "policy_version": engine.policy_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "shipyard"}]}

    @app.post("/v1/weights")
    async def weights(request: Request) -> dict[str, Any]:
        from shipyard.train.sync import decode

        body = await request.body()
        start = time.perf_counter()
        try:
            version, tensors = decode(body)
            await asyncio.to_thread(engine.update_weights, version, tensors)
        except (ValueError, KeyError) as e:
            raise HTTPException(400, str(e).strip('"')) from None
        return {"version": version, "tensors": len(tensors), "bytes": len(body),
                "seconds": round(time.perf_counter() - start, 4)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        if body.stream:
            raise HTTPException(400, "streaming is not supported by shipyard serve; set stream=false")
        if body.model not in (None, served_name):
            raise HTTPException(404, f"model '{body.model}' is not served here; this server serves '{served_name}'")
        prompts = _prompts(engine, body.prompt)
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        stop_ids = tuple(body.stop_token_ids or ()) or _default_stop_ids(engine)
        requests = []
        for p in prompts:
            for k in range(body.n):
                seed = None if body.seed is None else body.seed + k
                requests.append(GenerationRequest(p, SamplingParams(body.max_tokens, body.temperature, body.top_p,
                                                                    stops, stop_ids, seed)))
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        tok = engine.tokenizer
        choices = []
        for i, c in enumerate(results):
            choice: dict[str, Any] = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                                      "token_ids": c.token_ids, "logprobs": None}
            if body.logprobs is not None:
                tokens = ([f"token_id:{t}" for t in c.token_ids] if body.return_tokens_as_token_ids
                          else tok.convert_ids_to_tokens(c.token_ids))
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                                      "text_offset": None}
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        completion_tokens = sum(len(c.token_ids) for c in results)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_name, "choices": choices, "policy_version": engine.policy_version,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    return app


def _default_stop_ids(engine: Engine) -> tuple[int, ...]:
    eos = engine.tokenizer.eos_token_id
    return (eos,) if eos is not None else ()


def _prompts(engine: Engine, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPException(400, "prompt is empty")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    vocab = len(engine.tokenizer)
    for p in prompt:
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise HTTPException(400, "a prompt encodes to zero tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise HTTPException(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        out.append(ids)
    return out
