"""LoRA pushes to a real vLLM server (`-m vllm`): the trainer's adapter alone goes through `/v1/load_lora_adapter`;
the served logprobs become the adapted model's, a bad adapter is refused with the old one serving, and a push is a
small fraction of a full one's bytes."""

from __future__ import annotations

import pytest
import torch
from vllm_venv import served_model, vllm_python

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.lora import LoraConfig, adapter_tensors, attach
from shipyard.models.resolve import tiny_model
from shipyard.models.vllm import VLLMEngine
from shipyard.models.vllm_server import VLLMConfig, VLLMServers
from shipyard.models.weightdir import PushRejected, WeightDir, manifest

pytestmark = pytest.mark.vllm

PYTHON = vllm_python()
LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)
PROMPT = [3 + i % 250 for i in range(40)]


def adapted(seed: int):
    """The base (seed 0) with an adapter whose B is not zero (a trained adapter: it changes what the model computes)."""
    m = attach(tiny_model(seed=0, hidden=256, layers=2)[0], LORA)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return m


def reference_logprobs(m, ids) -> list[float]:
    with torch.no_grad():
        logits = m.to(torch.bfloat16)(torch.tensor([PROMPT + list(ids)])).logits.float()
    lp = torch.log_softmax(logits, -1)[0, len(PROMPT) - 1:-1]
    return lp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def greedy(engine, n: int = 8):
    return engine.generate([GenerationRequest(list(PROMPT), SamplingParams(max_tokens=n, temperature=0))])[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    tok = served_model(root / "model")
    config = VLLMConfig(python=str(PYTHON), max_model_len=512, kv_cache_gib=1.0)
    with VLLMServers(config, root / "model", root / "logs", lora=LORA) as servers:
        servers.start()
        e = VLLMEngine(servers.urls[0], tok, WeightDir(root / "weights", manifest(root / "model"), LORA,
                                                         base=str(root / "model")))
        yield e
        e.close()


def test_an_adapter_push_serves_the_adapted_model(engine):
    base = greedy(engine)  # before any push: the base, which is what a fresh adapter (B = 0) computes
    assert base.logprobs == pytest.approx(reference_logprobs(tiny_model(seed=0, hidden=256, layers=2)[0],
                                                             base.token_ids), abs=0.03)
    for version, seed in ((1, 1), (2, 2)):
        pushed = adapted(seed)
        tensors = adapter_tensors(pushed.state_dict())
        engine.update_weights(version, tensors)
        c = greedy(engine)
        assert c.policy_version == version
        assert c.logprobs == pytest.approx(reference_logprobs(pushed, c.token_ids), abs=0.03)
        assert c.logprobs != pytest.approx(reference_logprobs(tiny_model(seed=0, hidden=256, layers=2)[0],
                                                              c.token_ids), abs=0.03)  # the adapter counts
    full = sum(t.numel() * 2 for t in tiny_model(seed=0, hidden=256, layers=2)[0].state_dict().values())
    assert 0 < engine.last_push.bytes < full / 4  # rank 8 over a 256-wide toy; at 0.5B and rank 16 it is ~1/50


def test_a_bad_adapter_is_refused_and_the_old_one_keeps_serving(engine):
    good = adapter_tensors(adapted(5).state_dict())
    if engine.weights.adapter_names is None:  # run alone: a first push fixes the adapter's tensors
        engine.update_weights(engine.policy_version + 1, good)
    before = greedy(engine)
    version = engine.policy_version
    half = {k: v for k, v in good.items() if ".lora_B." not in k or "layers.0.self_attn.q_proj" not in k}
    wrong_rank = {k: (torch.zeros(4, v.shape[1]) if ".lora_A." in k else v) for k, v in good.items()}
    nan = {**good, next(iter(good)): torch.full_like(next(iter(good.values())), float("nan"))}
    fewer = {k: v for k, v in good.items() if "layers.1." not in k}
    for bad in (half, wrong_rank, nan, fewer):
        with pytest.raises(PushRejected):
            engine.update_weights(version + 1, bad)
    after = greedy(engine)
    assert engine.policy_version == version and after.policy_version == version
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)
