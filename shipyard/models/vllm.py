"""`VLLMEngine`: the `Engine` seam over a vLLM server that takes the trainer's weights every step.

**Sampling.** Requests go to vLLM's tokens-in, tokens-out route (`POST /inference/v1/generate`, vLLM ≥ 0.32, served
with `--enable-scale-out`): prompt ids in; sampled ids, their logprobs (`--logprobs-mode processed_logprobs`: after
temperature, before top-p, shipyard's convention) and the **weight-version spans** of the output out — vLLM says
which of its tokens each version drew. Each request carries a `request_id`; a request whose `cancelled` turns true is
aborted on the server (`POST /inference/v1/abort_requests`) and comes back with what it had, finish reason "abort".

**A push** (`update_weights(version, tensors)`), with the server's development routes (`VLLM_SERVER_DEV_MODE=1`):

1. the tensors are checked against the served checkpoint and written once per version (`weightdir.WeightDir`): a
   push that does not fit is refused before the server is touched (vLLM's reload is not all-or-nothing);
2. `POST /pause?mode=keep`: the scheduler freezes; requests in flight stay where they are;
3. `POST /collective_rpc` `shipyard_reload(DIR)` on every worker: vLLM's in-place `reload_weights`, then a tied head
   tied again (`shipyard.models.vllm_worker`: the server is started with `--worker-extension-cls` naming it);
4. `POST /update_weight_version` with the new version: from the next token on, vLLM labels tokens with it;
5. `POST /reset_prefix_cache`, then `POST /resume`.

**A LoRA push** (the weight directory's versions are adapters, `WeightDir(lora=...)`: a `[trainer.lora]` run pushes
the adapter alone) replaces step 3 by `POST /v1/load_lora_adapter` with the version's directory under one adapter
name (`ADAPTER_NAME`, `load_inplace`: the server's copy is replaced whole), on a server started with `--enable-lora`
and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`vllm_server`). From the first push on, requests name that adapter as
their model; before it they sample the base, which is what a fresh adapter (B = 0) computes.

**An NCCL push** (`[vllm] transfer = "nccl"`: GPU servers started with `--weight-transfer-config`, a trainer on a GPU;
full weights only) replaces steps 1 and 3: the tensors are checked without being written, and broadcast from the
trainer's GPU into the workers through vLLM's weight-transfer routes (`shipyard.models.nccl`), then a tied head is
tied again (`shipyard_retie`). The engine joins the server's transfer group when it connects.

Requests in flight during a push continue under the new weights (in-flight weight updates, as in PipelineRL: Piché
et al. 2025); their tokens carry the version that drew each (`Completion.token_versions`), exactly, from vLLM's
spans. **Prefix caching across versions is impossible**: every request is salted with the version current when it
started (`cache_salt`), so a request of version v+1 can never reuse blocks cached under v, whether or not the reset
above found blocks it could not free.

**Fence.** The client checks every answer against what it pushed: a span whose version is not a number (vLLM's
"default": a server restarted with its initial weights), newer than any version the server was told to label, older
than the version current when the request started (the push did not land) or than the span before it, or spans that
do not cover the tokens once each, are an `InfraError`, so the router takes the server out rather than train on
mislabelled samples. Nothing in an answer is trusted: token ids must be ints, logprobs finite and <= 0 (a NaN would
reach the importance ratios), or the answer is the server's fault (`ServerError`), like a body that is not JSON.

A push that fails on the server (after the client's checks passed), a 4xx of its routes included, leaves the server in
an unknown state: the engine is marked broken and answers `InfraError` from then on. The version a request is salted
and fenced with becomes the new one before `/resume`, so no request that runs after the push carries the old salt.

**Access.** vLLM guards only `/v1`, `/inference`… with `--api-key`; its development routes (reload, pause) are open
to anyone who reaches the port. So servers shipyard starts listen on a Unix socket in a directory only this user can
enter (`base_url = "unix:PATH"`), never on a TCP port; for servers a user runs elsewhere, keep their port on a
private network (docs/training.md, "GPU node").
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import httpx
import torch
from transformers import PreTrainedTokenizerBase

from shipyard.errors import UsageError
from shipyard.httpguard import bearer
from shipyard.models.engine import Completion, GenerationRequest, VersionConflict
from shipyard.models.errors import InfraError, ServerUnreachable
from shipyard.models.nccl import NOT_FOR_LORA, Collectives, NcclGroup, TorchNccl, TransferWedged
from shipyard.models.openai import RequestRejected, ServerError
from shipyard.models.weightdir import WeightDir

T = TypeVar("T")

CANCEL_POLL = 0.2  # seconds between checks of a request's `cancelled`
SALT = "shipyard-v"
MAX_TOKEN_ID = 1 << 31  # token ids are int32 in vLLM and the trainer (the tokenizer's decode overflows beyond)
ADAPTER_NAME = "shipyard-policy"  # the served adapter of a LoRA run
RESUME_AFTER_WEDGE = 10.0  # seconds a resume is tried after a wedged NCCL transfer
LOGPROB_SLACK = 1e-4  # a log-softmax's rounding above 0; a logprob above it is no log-probability


class NotAWeightServer(ServerUnreachable):
    """The server answers but cannot take weights (not vLLM, or started without the routes a push needs)."""


@dataclass
class PushStats:
    version: int
    bytes: int
    write_seconds: float
    reload_seconds: float  # pause, reload, version, cache reset, resume


def client_for(base_url: str, timeout: float, api_key: str | None = None) -> httpx.Client:
    """An HTTP client for `http://HOST:PORT` or `unix:PATH` (a server on a Unix socket)."""
    if base_url.startswith("unix:"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=base_url.removeprefix("unix:")),
                            base_url="http://vllm", timeout=timeout, headers=bearer(api_key))
    return httpx.Client(base_url=base_url.rstrip("/").removesuffix("/v1"), timeout=timeout, headers=bearer(api_key))


class VLLMEngine:
    def __init__(self, base_url: str, tokenizer: PreTrainedTokenizerBase, weights: WeightDir, *,
                 timeout: float = 600.0, max_concurrency: int = 64, api_key: str | None = None,
                 initial_version: int = 0, nccl_workers: int = 0, collectives: Collectives | None = None):
        self.base_url = base_url
        self.tokenizer = tokenizer
        self.weights = weights
        self.client = client_for(base_url, timeout, api_key)
        # Requests' posts run on `pool`, a batch's requests on `batches`: on one pool, a batch as large as the pool
        # would hold every thread waiting for posts that could never start.
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="shipyard-vllm")
        self.batches = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="shipyard-vllm-batch")
        self.broken: str | None = None
        self.last_push: PushStats | None = None
        self.labelled = initial_version  # the newest version the server was told to label tokens with
        self.adapter = False  # a LoRA run's adapter is loaded: requests name it
        self.nccl: NcclGroup | None = None  # full-weight pushes broadcast from the trainer's GPU (`nccl_workers` > 0)
        try:
            self.model = self._served_model()
            self.name = f"vllm:{base_url}#{self.model}"
            self._check_routes()
            self._set_version(initial_version)
            if nccl_workers:
                self._open_nccl(nccl_workers, timeout, collectives)
        except BaseException:
            self.close()
            raise
        self.policy_version = initial_version

    # -- start-up -------------------------------------------------------------------------------------------------

    def _check_sound(self) -> None:
        """A broken engine refuses work: `ServerError` (a managed server is restarted), or `TransferWedged` after an
        NCCL transfer that failed half way (the run must end: `shipyard.models.nccl`)."""
        if self.broken:
            raise (TransferWedged if self.nccl is not None and self.nccl.broken else ServerError)(self.broken)

    def _served_model(self) -> str:
        try:
            resp = self.client.get("/v1/models", timeout=10)
            resp.raise_for_status()
            entry = resp.json()["data"][0]
            model, owner = entry["id"], entry.get("owned_by")
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"cannot reach a vLLM server at {self.base_url} ({type(e).__name__}: {e})") from e
        except (ValueError, KeyError, IndexError, TypeError) as e:  # the JSON is any shape at all
            raise NotAWeightServer(f"{self.base_url}/v1/models did not list a model: not an OpenAI-style server") from e
        if owner != "vllm":
            raise NotAWeightServer(f"{self.base_url} serves {model!r} owned by {owner!r}, not vllm")
        return str(model)

    def _check_routes(self) -> None:
        """Fail at start-up, not at the first push, when the server lacks a route a run needs."""
        paused = self._send("GET", "/is_paused", timeout=10)
        if paused.status_code == 404:
            raise NotAWeightServer(f"the vLLM server at {self.base_url} has no development routes (/pause, "
                                   "/collective_rpc): start it with VLLM_SERVER_DEV_MODE=1 to push weights to it")
        if self.weights.lora is not None and self._send("POST", "/v1/load_lora_adapter", json={},
                                                        timeout=10).status_code == 404:
            raise NotAWeightServer(f"the vLLM server at {self.base_url} cannot load adapters at run time: start it "
                                   "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for a LoRA run")
        ready, answers = self._ask_workers("shipyard_ready")
        if not isinstance(answers, list) or not answers or any(a != "ready" for a in answers):
            raise NotAWeightServer(f"the vLLM server at {self.base_url} lacks shipyard's worker extension (its "
                                   f"/collective_rpc answered {ready.status_code}: {ready.text[:200]}): start it with "
                                   "--worker-extension-cls shipyard_vllm_worker.ShipyardWorker and "
                                   "shipyard/models/vllm_worker.py on its PYTHONPATH as shipyard_vllm_worker.py")
        if self.weights.lora is not None:
            self._check_lora(self.weights.lora.rank)
        probe = self._send("POST", "/inference/v1/generate", timeout=30,
                           json={"token_ids": [0], "sampling_params": {"max_tokens": 1}})
        if probe.status_code in (403, 404):
            raise NotAWeightServer(f"the vLLM server at {self.base_url} does not serve /inference/v1/generate "
                                   f"({probe.status_code}): start it with --enable-scale-out (vLLM >= 0.32)")

    def _open_nccl(self, workers: int, timeout: float, collectives: Collectives | None) -> None:
        """Join the server's weight-transfer group (`shipyard.models.nccl`), once the server says it has one: its
        rendezvous would wait for a server that cannot join."""
        if self.weights.lora is not None:
            raise UsageError(NOT_FOR_LORA)
        asked, backends = self._ask_workers("shipyard_transfer")
        if backends != ["nccl"] * workers:
            raise NotAWeightServer(f"the vLLM server at {self.base_url} cannot receive NCCL weight pushes on "
                                   f"{workers} worker(s) (its workers' transfer backends: {asked.text[:200]}): "
                                   "start it with --weight-transfer-config '{\"backend\": \"nccl\"}' and this "
                                   "shipyard's worker extension, with as many GPUs as vllm.gpus_per_server")
        def post(path: str, body: dict | None, wait: float | None) -> httpx.Response:
            return self._post(path, json=body, **({"timeout": wait} if wait else {}))

        self.nccl = NcclGroup(post, workers, self.base_url, collectives or TorchNccl(self.base_url), timeout)
        self.nccl.open()

    def _ask_workers(self, method: str) -> tuple[httpx.Response, object]:
        """A start-up question to the worker extension (`POST /collective_rpc`): the response, and its `results` (one
        answer per worker) — None when it answered no 200 or no JSON object with results; any shape otherwise."""
        resp = self._send("POST", "/collective_rpc", json={"method": method}, timeout=30)
        try:
            return resp, resp.json()["results"] if resp.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            return resp, None

    def _check_lora(self, rank: int) -> None:
        """A LoRA run's server must take adapters of `rank` (its `--max-lora-rank`): asked of the worker extension,
        since the runtime-adapter route answers with or without `--enable-lora`."""
        asked, ranks = self._ask_workers("shipyard_lora_rank")
        # vLLM's route answers each worker's scalar as a string ("16")
        if not isinstance(ranks, list) or not ranks or not all(type(r) in (str, int) and str(r).isdigit()
                                                               for r in ranks):
            raise NotAWeightServer(f"the vLLM server at {self.base_url} did not say which adapter ranks it takes (its "
                                   f"/collective_rpc answered {asked.status_code}: {asked.text[:200]}): its worker "
                                   "extension is not shipyard's of this version; start it with this shipyard's "
                                   "shipyard/models/vllm_worker.py")
        ranks = [int(r) for r in ranks]
        if min(ranks) == 0:
            raise NotAWeightServer(f"the vLLM server at {self.base_url} was started without --enable-lora: start it "
                                   f"with --enable-lora --max-lora-rank {rank} (or more) for a LoRA run")
        if min(ranks) < rank:
            raise NotAWeightServer(f"the vLLM server at {self.base_url} takes adapters of rank <= {min(ranks)} "
                                   f"(--max-lora-rank) and this run's are rank {rank}: start it with --max-lora-rank "
                                   f"{rank} or more, or lower trainer.lora.rank")

    # -- sampling -------------------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.client.request(method, path, **kwargs)
        except httpx.RequestError as e:  # unreachable, reset, timed out, or a body that does not decode
            raise ServerUnreachable(f"lost the vLLM server at {self.base_url}: {type(e).__name__}: {e}") from e

    def _post(self, path: str, **kwargs) -> httpx.Response:
        resp = self._send("POST", path, **kwargs)
        if resp.status_code != 200:
            message = f"{self.base_url}{path} answered {resp.status_code}: {resp.text[:500]}"
            if 400 <= resp.status_code < 500 and resp.status_code != 429:  # the request's fault: not the server's
                raise RequestRejected(message)
            raise ServerError(message)
        return resp

    def _one(self, req: GenerationRequest) -> Completion:
        self._check_sound()
        sp = req.sampling
        started = self.policy_version
        request_id = f"shipyard-{uuid.uuid4().hex}"
        params = {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed,
                  "stop_token_ids": list(sp.stop_token_ids), "logprobs": 0, "skip_special_tokens": False,
                  "ignore_eos": True}  # stops at `stop_token_ids` only, as every engine of shipyard does
        body = {"request_id": request_id, "token_ids": req.prompt_ids, "sampling_params": params,
                "cache_salt": f"{SALT}{started}", **({"model": ADAPTER_NAME} if self.adapter else {})}
        t0 = time.monotonic()
        future = self.pool.submit(self._post, "/inference/v1/generate", json=body)
        while req.cancelled is not None and not future.done():
            try:
                future.result(timeout=CANCEL_POLL)
            except TimeoutError:
                # Sent again each poll until the answer comes: an abort that reaches the server before the request
                # is registered there finds nothing to abort. vLLM names the request generate-tokens-<our id>.
                if req.cancelled():
                    self._post("/inference/v1/abort_requests", json={"request_ids": [f"generate-tokens-{request_id}"]})
            except InfraError:
                break
        resp = future.result()
        try:
            ids, lps, spans, finish = generation(resp.json())
        except ValueError as e:
            raise ServerError(f"{self.base_url}/inference/v1/generate answered 200 with a body that is not a "
                              f"generation ({e}): {resp.text[:200]}") from e
        if len(lps) != len(ids):
            raise ServerError(f"{self.base_url} returned {len(ids)} tokens with {len(lps)} logprobs")
        versions = self._token_versions(spans, len(ids), started)
        return Completion(ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True),
                          finish if finish in ("stop", "length", "abort") else "length", len(req.prompt_ids),
                          versions[0] if versions else started, time.monotonic() - t0,
                          versions if len(set(versions)) > 1 else [])

    def _token_versions(self, spans: list[tuple[str, int, int]], n: int, started: int) -> list[int]:
        """The version of each of `n` tokens from vLLM's spans, checked (module docstring: fence)."""
        out: list[int] = []
        for label, start, end in spans:
            version = int(label) if label.isascii() and label.isdigit() and len(label) < 19 else None
            if version is None or version > self.labelled:
                raise ServerError(f"the vLLM server at {self.base_url} labels tokens with weights version {label!r}, "
                                  "which shipyard did not push (restarted with its initial weights?)")
            if version < started:
                raise ServerError(f"the vLLM server at {self.base_url} sampled with weights version {version} "
                                  f"(tokens {start}..{end}) a request started at version {started}: a push did not "
                                  "land")
            if out and version < out[-1]:
                raise ServerError(f"the vLLM server at {self.base_url} labels tokens {start}..{end} of one request "
                                  f"with weights version {version}, older than version {out[-1]} before them")
            if start != len(out) or not start <= end <= n:
                self._uncovered(spans, n)
            out += [version] * (end - start)
        if len(out) != n:
            self._uncovered(spans, n)
        return out

    def _uncovered(self, spans: list[tuple[str, int, int]], n: int) -> None:
        raise ServerError(f"the vLLM server at {self.base_url} gave weight-version spans {spans[:8]} that do not cover "
                          f"its {n} tokens once each")

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        self._check_sound()
        if len(requests) == 1:
            return [self._one(requests[0])]
        return list(self.batches.map(self._one, requests))

    # -- weights --------------------------------------------------------------------------------------------------

    def _set_version(self, version: int) -> None:
        self.labelled = max(self.labelled, version)  # before the call: the server may label tokens before it answers
        self._post("/update_weight_version", json={"new_version": str(version)})

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """The push of the module docstring. Refused (`PushRejected`, `VersionConflict`) before the server is touched
        when the push does not fit or goes backwards; an `InfraError` after that leaves this engine broken."""
        if version <= self.policy_version:
            raise VersionConflict(f"weights version {version} is not above the served version {self.policy_version}")
        self._check_sound()
        t0 = time.monotonic()
        if self.nccl is not None:
            held = self.weights.hold(version, tensors)
            t1 = time.monotonic()
            sent = self._swap(version, lambda: self.nccl.send(held))
        else:
            path = self.weights.write(version, tensors)
            t1 = time.monotonic()
            self.load(version, path)
            sent = self.weights.last_bytes
        self.last_push = PushStats(version, sent, t1 - t0, time.monotonic() - t1)

    def load(self, version: int, path) -> None:
        """Steps 2–5 of a push: the server loads the version written in `path` (a full checkpoint or an adapter, as
        the weight directory writes them) and labels tokens with `version`. An `InfraError` leaves the engine broken."""
        if self.weights.lora is not None:
            self._swap(version, lambda: self._post("/v1/load_lora_adapter", json={
                "lora_name": ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}))
        else:
            self._swap(version, lambda: self._reload(path))

    def _swap(self, version: int, put: Callable[[], T]) -> T:
        """The server paused, `put()` giving it the weights of `version`, tokens labelled with it, the prefix cache
        reset, resumed (steps 2–5); what `put` returned. An `InfraError` leaves the engine broken."""
        try:
            self._post("/pause", params={"mode": "keep"})
            try:
                out = put()
                if self.nccl is not None:
                    self._retie()
                self._set_version(version)
                self._post("/reset_prefix_cache")
                self.policy_version = version  # before resuming: requests from now on are salted with it
                self.adapter = self.weights.lora is not None
            except BaseException as e:
                # tried, and the push's own error raised, not the resume's: vLLM answers its control calls in order,
                # so a server stuck in a transfer answers no resume (briefly tried then: the run ends)
                with contextlib.suppress(InfraError, RequestRejected):
                    self._post("/resume", **({"timeout": RESUME_AFTER_WEDGE} if isinstance(e, TransferWedged) else {}))
                raise
            self._post("/resume")
        except TransferWedged as e:  # ends the run (`shipyard.models.nccl`)
            self.broken = str(e)
            raise
        except (InfraError, RequestRejected) as e:  # a 4xx here is no request's fault: the server's state is unknown
            self.broken = (f"the vLLM server at {self.base_url} failed while loading weights version {version} "
                           f"({e}); its weights are unknown, so it takes no more requests")
            raise ServerError(self.broken) from e
        return out

    def _reload(self, path) -> None:
        """Step 3 of a full push: every worker reloads the checkpoint in `path` (`vllm_worker.shipyard_reload`)."""
        self._workers_did("shipyard_reload", str(path))

    def _retie(self) -> None:
        """After an NCCL push: a tied head tied to the received embedding again (`vllm_worker.shipyard_retie`)."""
        self._workers_did("shipyard_retie")

    def _workers_did(self, method: str, *args: str) -> None:
        """Every worker ran the extension's `method` (`shipyard_reload`, `shipyard_retie`): "retied" or "untied"."""
        done = self._post("/collective_rpc", json={"method": method, "args": list(args)})
        try:
            results = done.json()["results"]
        except (ValueError, KeyError, TypeError):
            results = None
        if not isinstance(results, list) or not results or any(r not in ("retied", "untied") for r in results):
            raise ServerError(f"the workers' {method} answered {done.text[:500]}")

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.close()
        self.batches.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def generation(body: object) -> tuple[list[int], list[float], list[tuple[str, int, int]], object]:
    """(token ids, logprobs, weight-version spans, finish reason) of an answer of /inference/v1/generate, every type
    checked (`ValueError` naming the first that is not as vLLM writes it): a broken server's JSON is any shape."""
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise ValueError("no choice")
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in ids):
        raise ValueError("token_ids are not a list of token ids")
    logprobs = choice.get("logprobs") or {}
    content = (logprobs.get("content") or []) if isinstance(logprobs, dict) else None
    lps = [e.get("logprob") for e in content if isinstance(e, dict)] if isinstance(content, list) else None
    if lps is None or len(lps) != len(content) or not all(type(x) in (int, float) and -math.inf < x <= LOGPROB_SLACK
                                                          for x in lps):
        raise ValueError("logprobs are not a list of finite logprobs <= 0")
    spans = choice.get("weight_versions") or []
    if not isinstance(spans, list) or not all(isinstance(s, dict) and isinstance(s.get("version"), str)
                                              and type(s.get("start")) is int and type(s.get("end")) is int
                                              for s in spans):
        raise ValueError("weight_versions are not spans of a version string and int bounds")
    return ids, [float(x) for x in lps], [(s["version"], s["start"], s["end"]) for s in spans], \
        choice.get("finish_reason")
