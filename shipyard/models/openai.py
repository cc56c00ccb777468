"""`OpenAIEngine`: the `Engine` seam over any OpenAI-compatible `/v1/completions` server.

Works with vLLM, SGLang and `shipyard serve`. Prompts go out as token ids (never as text, which the server
would re-tokenize); completions come back as token ids with the sampler's logprobs. Ids are read from the
choice's `token_ids` when the server returns them (shipyard, vLLM with `return_token_ids`), else from
`logprobs.tokens` written as `token_id:N` (vLLM's `return_tokens_as_token_ids`).

Each request of a batch is its own HTTP call, sent concurrently, so the server's continuous batching sees all
of them at once. Failures of the server (unreachable, a 5xx or 429 answer, a body that is not a completion) raise
`InfraError` subclasses (`ServerUnreachable`, `ServerError`), so that an `EngineRouter` retries the request on another
server and an episode ends as `infra_error` rather than as the model's failure; a 4xx other than 429 is the request's
fault and raises `RequestRejected`. Several servers: `make_engine("openai:URL1,URL2")` routes over one engine each
(`shipyard.models.router`). For vLLM, start the server with `--logprobs-mode processed_logprobs` so its logprobs follow
shipyard's convention (after temperature, before top-p).

**Weights.** `update_weights` pushes to `shipyard serve` (`POST /v1/weights`: the bf16 payload of
`shipyard.models.payload`, with the operator's token), after which its completions report the new version. Other
servers take no pushes through this engine: a vLLM server shipyard starts and pushes to is `engine.kind = "vllm"`
(`shipyard.models.vllm`); `make_engine(..., pushes=True)` — a training run — refuses, at connection, a server that
is not `shipyard serve`, instead of failing at the first push.

A server started with an API key (`shipyard serve --api-key`, vLLM's `--api-key`) gets it as a bearer token: the
`api_key` argument, else $SHIPYARD_API_KEY (or the file named by $SHIPYARD_API_KEY_FILE). Not $OPENAI_API_KEY: a
real OpenAI key should never go to whatever listens on a local port.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from transformers import PreTrainedTokenizerBase

from shipyard.errors import UsageError
from shipyard.httpguard import bearer, read_token
from shipyard.models.engine import Completion, GenerationRequest, VersionConflict
from shipyard.models.errors import InfraError, ServerUnreachable
from shipyard.models.payload import encode, error_message, push_http

API_KEY_ENV = "SHIPYARD_API_KEY"  # the key for a server started with an API key (`shipyard serve --api-key`)


class ServerError(InfraError, RuntimeError):
    """The server answered, but failed (5xx, 429 overloaded, a body that is not a completion, or — vLLM — tokens
    labelled with weights shipyard did not push)."""


class RequestRejected(RuntimeError):
    """The server refused the request itself (a 4xx other than 429): retrying it elsewhere would not help."""


def served_model(base_url: str, api_key: str | None = None) -> tuple[str, str]:
    """(the model a server serves — the first its `GET /models` lists —, who serves it: its `owned_by`, "shipyard"
    for `shipyard serve`, "vllm" for vLLM); `make_engine` loads the model's tokenizer."""
    base_url = base_url.rstrip("/")
    api_key = api_key or read_token(API_KEY_ENV, None)
    try:
        resp = httpx.get(f"{base_url}/models", timeout=10, headers=bearer(api_key))
        if resp.status_code == 401:
            raise ServerUnreachable(f"{base_url} needs an API key ({'a wrong one was' if api_key else 'none was'} "
                                    f"sent): set ${API_KEY_ENV} to the key the server was started with")
        resp.raise_for_status()
        entry = resp.json()["data"][0]
        return str(entry["id"]), str(entry.get("owned_by", ""))
    except httpx.HTTPError as e:
        raise ServerUnreachable(
            f"cannot reach an OpenAI-compatible server at {base_url} ({type(e).__name__}: {e}). Start one with "
            f"`shipyard serve --model M --port P` (then use openai:http://127.0.0.1:P/v1) or check the URL."
        ) from e
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        raise ServerUnreachable(f"{base_url}/models did not list a model; is this an OpenAI-compatible API?") from e


class PushUnsupported(UsageError):
    """A server that takes no weight pushes from shipyard, in a run that pushes."""


def push_unsupported(url: str, owned_by: str) -> str:
    if owned_by == "vllm":  # the same push as servers the run starts, configured as such
        return (f"the server at {url} is vLLM: a training run pushes to vLLM servers through engine.kind = \"vllm\"; "
                f"for servers you run, set [vllm] urls = [\"{url}\"] and weights_dir (a directory they read at the "
                "same path) and start them with shipyard's worker extension (docs/training.md, \"vLLM servers you "
                "run\")")
    return (f"the server at {url} (owned by {owned_by or 'an unnamed server'}) takes no weight pushes from shipyard: "
            "a training run needs `shipyard serve` behind openai:URL, or vLLM servers the run starts and pushes to "
            "(engine.kind = \"vllm\", docs/training.md)")


class OpenAIEngine:
    def __init__(self, base_url: str, model: str, tokenizer: PreTrainedTokenizerBase, timeout: float = 600.0,
                 max_concurrency: int = 64, api_key: str | None = None, owned_by: str = ""):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.owned_by = owned_by  # "shipyard": `shipyard serve`, which takes pushes (module docstring)
        self.name = f"openai:{self.base_url}#{model}"
        self.tokenizer = tokenizer
        self.policy_version = 0
        api_key = api_key or read_token(API_KEY_ENV, None)
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="shipyard-http")

    def _one(self, req: GenerationRequest) -> Completion:
        sp = req.sampling
        payload = {"model": self.model, "prompt": req.prompt_ids, "max_tokens": sp.max_tokens,
                   "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed, "stop": list(sp.stop),
                   "stop_token_ids": list(sp.stop_token_ids), "logprobs": 0, "return_tokens_as_token_ids": True,
                   "return_token_ids": True, "skip_special_tokens": True}
        try:
            resp = self.client.post("/completions", json=payload)
        except httpx.TransportError as e:
            raise ServerUnreachable(f"lost the server at {self.base_url}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            message = f"{self.base_url}/completions answered {resp.status_code}: {error_message(resp)}"
            if resp.status_code >= 500 or resp.status_code == 429:
                raise ServerError(message)
            raise RequestRejected(message)
        try:
            body = resp.json()
            choice = body["choices"][0]
            logprobs = choice.get("logprobs") or {}
            ids = choice.get("token_ids")
            if ids is None:
                ids = [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens", [])]
            lps = [float(x) if x is not None else 0.0 for x in logprobs.get("token_logprobs") or [0.0] * len(ids)]
            version = int(choice.get("policy_version", body.get("policy_version", self.policy_version)))
            versions = [int(v) for v in choice.get("token_versions") or ()]
            text, finish = str(choice["text"]), choice["finish_reason"]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise ServerError(f"{self.base_url}/completions answered 200 with a body that is not a completion "
                              f"({type(e).__name__}: {e})") from e
        return Completion(list(ids), lps, text, "stop" if finish == "stop" else "length", len(req.prompt_ids),
                          version, token_versions=versions)

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        return list(self.pool.map(self._one, requests))

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Push to `shipyard serve` (module docstring): all or nothing there (it decodes and checks the whole payload
        first); `VersionConflict` here for a version not above the served one."""
        if self.owned_by != "shipyard":
            raise PushUnsupported(push_unsupported(self.base_url, self.owned_by))
        if version <= self.policy_version:
            raise VersionConflict(f"weights version {version} is not above the served version {self.policy_version}")
        try:
            push_http(self.base_url, encode(dict(tensors), version))
        except ConnectionError as e:
            raise ServerUnreachable(str(e)) from e
        self.policy_version = version

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()
