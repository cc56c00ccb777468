"""A managed vLLM server that dies is started again with the newest pushed weights (`ManagedServer`, `-m vllm`): the
request that met the dead server fails as an infrastructure error (its rollout is retried, not scored), the next one
is served by the restarted server at the pushed version with the pushed model's logprobs."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from vllm_venv import served_model, vllm_python

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.errors import InfraError
from shipyard.models.resolve import tiny_model
from shipyard.models.vllm_server import ManagedServer, VLLMConfig, managed_engine

pytestmark = pytest.mark.vllm

PROMPT = [3 + i % 250 for i in range(40)]


def greedy(engine):
    return engine.generate([GenerationRequest(list(PROMPT), SamplingParams(max_tokens=6, temperature=0))])[0]


def reference_logprobs(m, ids) -> list[float]:
    with torch.no_grad():
        logits = m.to(torch.bfloat16)(torch.tensor([PROMPT + list(ids)])).logits.float()
    lp = torch.log_softmax(logits, -1)[0, len(PROMPT) - 1:-1]
    return lp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_a_killed_server_comes_back_with_the_newest_weights(tmp_path):
    tok = served_model(tmp_path / "model")
    config = VLLMConfig(python=str(vllm_python()), max_model_len=256, kv_cache_gib=1.0)
    said = []
    with managed_engine(config, tmp_path / "model", tmp_path / "run", tok, status=said.append) as engine:
        assert isinstance(engine, ManagedServer)
        pushed = tiny_model(seed=1, hidden=256, layers=2)[0]
        engine.update_weights(1, pushed.state_dict())
        before = greedy(engine)
        first = engine.servers.procs[0]
        os.killpg(first.pid, signal.SIGKILL)  # the server and its engine core, as the OOM killer would
        first.wait()
        with pytest.raises(InfraError):
            greedy(engine)  # met the dead server: an infrastructure failure, retried by the scheduler
        assert engine.restarts == 1 and engine.servers.procs[0] is not first and engine.servers.procs[0].poll() is None
        after = greedy(engine)
        assert after.policy_version == engine.policy_version == 1  # the newest push, loaded into the new server
        assert after.token_ids == before.token_ids
        assert after.logprobs == pytest.approx(reference_logprobs(pushed, after.token_ids), abs=0.03)
        engine.update_weights(2, tiny_model(seed=2, hidden=256, layers=2)[0].state_dict())  # pushes go on
        assert greedy(engine).policy_version == 2
    assert any("vLLM server 0 exited with code" in line and "restarting it (1 of 3" in line for line in said)
    assert "restarting server 0" in (tmp_path / "run" / "vllm-0.log").read_text()
    assert engine.servers.procs == []  # stopped with the block
