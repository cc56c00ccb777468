"""`shipyard serve` and `OpenAIEngine` against each other: a real uvicorn server on 127.0.0.1."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from servers import free_port

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.openai import ServerUnreachable
from shipyard.models.resolve import TINY, load_hf, make_engine
from shipyard.models.server import ServeConfig, create_app


@pytest.fixture(scope="module")
def served(serve_app):
    model, tok = load_hf(TINY, dtype=torch.float32)
    engine = LocalEngine(model, tok, max_batch=8)
    return engine, serve_app(create_app(engine, TINY, ServeConfig(max_batch=8))) + "/v1"


def test_client_matches_local_engine(served):
    engine, url = served
    client = make_engine(f"openai:{url}")
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
    client = make_engine(f"openai:{url}")
    engine.stats["max_running"] = 0
    reqs = [GenerationRequest(client.tokenizer.encode(f"prompt {i}", add_special_tokens=False),
                              SamplingParams(max_tokens=32, temperature=0.0)) for i in range(6)]
    with ThreadPoolExecutor(2) as pool:  # two callers, three requests each
        results = list(pool.map(lambda chunk: client.generate(chunk), [reqs[:3], reqs[3:]]))
    assert sum(len(r) for r in results) == 6
    assert engine.stats["max_running"] > 1  # decoded together
    for req, got in zip(reqs, results[0] + results[1], strict=True):
        assert got.token_ids == engine.generate([req])[0].token_ids
    client.close()


def test_short_request_is_answered_while_a_long_one_decodes(served):
    """Continuous batching behind the server: a short request joins the running batch instead of waiting for it."""
    engine, url = served
    client = make_engine(f"openai:{url}")
    long_req = GenerationRequest([65] * 8, SamplingParams(max_tokens=400, temperature=0.0, stop_token_ids=()))
    short_req = GenerationRequest([66] * 8, SamplingParams(max_tokens=4, temperature=0.0))
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.generate, [long_req])
        steps = engine.stats["decode_steps"]
        deadline = time.monotonic() + 30
        while engine.stats["decode_steps"] < steps + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        short = client.generate([short_req])[0]
        assert len(short.token_ids) == 4 and not long.done()
        assert len(long.result(timeout=120)[0].token_ids) == 400
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
        make_engine(f"openai:http://127.0.0.1:{free_port()}/v1")
