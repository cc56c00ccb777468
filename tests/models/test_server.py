"""`shipyard serve` and `OpenAIEngine` against each other: a real uvicorn server on 127.0.0.1."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from servers import free_port

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.openai import OpenAIEngine, ServerUnreachable
from shipyard.models.resolve import TINY, load_hf
from shipyard.models.server import ServeConfig, create_app


class CountingEngine(LocalEngine):
    """A LocalEngine that records the size of every batch it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def generate(self, requests):
        self.batches.append(len(requests))
        return super().generate(requests)


@pytest.fixture(scope="module")
def served(serve_app):
    model, tok = load_hf(TINY, dtype=torch.float32)
    engine = CountingEngine(model, tok, max_batch=8)
    return engine, serve_app(create_app(engine, TINY, ServeConfig(max_batch=8))) + "/v1"


def test_client_matches_local_engine(served):
    engine, url = served
    client = OpenAIEngine.connect(url)
    assert client.model == TINY
    p = client.tokenizer.encode("hello server", add_special_tokens=False)
    for sp in (SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.8, seed=5)):
        remote = client.generate([GenerationRequest(p, sp)])[0]
        local = engine.generate([GenerationRequest(p, sp)])[0]
        assert remote.token_ids == local.token_ids and remote.finish_reason == local.finish_reason
        torch.testing.assert_close(torch.tensor(remote.logprobs), torch.tensor(local.logprobs), atol=1e-4, rtol=1e-4)
    client.close()


def test_concurrent_requests_are_batched(served):
    engine, url = served
    client = OpenAIEngine.connect(url)
    engine.batches.clear()
    reqs = [GenerationRequest(client.tokenizer.encode(f"prompt {i}", add_special_tokens=False),
                              SamplingParams(max_tokens=4, temperature=0.0)) for i in range(6)]
    with ThreadPoolExecutor(2) as pool:  # two callers, three requests each
        results = list(pool.map(lambda chunk: client.generate(chunk), [reqs[:3], reqs[3:]]))
    assert sum(len(r) for r in results) == 6
    assert max(engine.batches) > 1 and sum(engine.batches) == 6
    client.close()


def test_openai_wire_format(served):
    _, url = served
    body = httpx.post(f"{url}/completions", json={"model": TINY, "prompt": "hi", "max_tokens": 3, "logprobs": 0,
                                                  "return_tokens_as_token_ids": True, "temperature": 0}).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    assert [f"token_id:{t}" for t in choice["token_ids"]] == choice["logprobs"]["tokens"]
    assert len(choice["logprobs"]["token_logprobs"]) == 3
    assert httpx.get(f"{url}/models").json()["data"][0]["id"] == TINY


def test_bad_requests_get_clear_errors(served):
    _, url = served
    r = httpx.post(f"{url}/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and "serves 'random:tiny'" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/completions", json={"prompt": [10**9], "max_tokens": 1})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 422
    r = httpx.post(f"{url}/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 400 and "streaming" in r.json()["error"]["message"]


def test_unreachable_server_message():
    with pytest.raises(ServerUnreachable, match="shipyard serve"):
        OpenAIEngine.connect(f"http://127.0.0.1:{free_port()}/v1")
