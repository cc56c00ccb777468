"""`openai:` engines in a run that pushes weights: `shipyard serve` takes them through the engine interface
(`OpenAIEngine.update_weights` → `POST /v1/weights`), and a server that takes none is refused when the run connects,
not at its first push (before: `NotImplementedError` after the first trainer step, the batch lost)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from shipyard.models.engine import GenerationRequest, SamplingParams, VersionConflict
from shipyard.models.local import LocalEngine
from shipyard.models.openai import PushUnsupported
from shipyard.models.resolve import make_engine, tiny_model
from shipyard.models.server import ServeConfig, create_app

TOKEN = "push-test-token"


@pytest.fixture(scope="module")
def serve_url(serve_app):
    model, tok = tiny_model()
    return serve_app(create_app(LocalEngine(model.float(), tok), "tiny", ServeConfig(token=TOKEN))) + "/v1"


@pytest.fixture(scope="module")
def other_url(serve_app):
    """A server that lists a model owned by vLLM and has no route shipyard could push to."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]}

    return serve_app(app) + "/v1"


def test_a_push_reaches_shipyard_serve_through_the_engine(serve_url, monkeypatch):
    monkeypatch.setenv("SHIPYARD_SERVE_TOKEN", TOKEN)
    engine = make_engine(f"openai:{serve_url}", tokenizer="random:tiny", pushes=True)
    try:
        new, _ = tiny_model(seed=3)
        engine.update_weights(1, new.state_dict())
        assert engine.policy_version == 1
        assert httpx.get(serve_url.removesuffix("/v1") + "/health").json()["policy_version"] == 1
        c = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))])[0]
        assert c.policy_version == 1
        with pytest.raises(VersionConflict):
            engine.update_weights(1, new.state_dict())
    finally:
        engine.close()


def test_a_server_that_takes_no_pushes_is_refused_when_a_run_connects(other_url):
    with pytest.raises(PushUnsupported, match=r"is vLLM: .*engine.kind = \"vllm\".*\[vllm\] urls = \[\""):
        make_engine(f"openai:{other_url}", tokenizer="random:tiny", pushes=True)
    engine = make_engine(f"openai:{other_url}", tokenizer="random:tiny")  # an eval pushes nothing: fine
    try:
        with pytest.raises(PushUnsupported):
            engine.update_weights(1, tiny_model()[0].state_dict())
    finally:
        engine.close()
