import pytest
import torch

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.resolve import TINY, load_hf


@pytest.fixture(scope="module")
def tiny():
    return load_hf(TINY, dtype=torch.float32)


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    return LocalEngine(model, tok, max_batch=4)


def prompt(tok, text):
    return tok.encode(text, add_special_tokens=False)


def oracle_logprobs(model, prompt_ids, completion_ids, temperature):
    """log_softmax(logits / T) of each completion token, from one full forward pass (no cache)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    logits = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_full_forward(engine, tiny, temperature, top_p):
    model, tok = tiny
    p = prompt(tok, "def add(a, b):")
    c = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p,
                                                             seed=3))])[0]
    assert len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length"
    expected = oracle_logprobs(model, p, c.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_batched_equals_one_by_one(engine, tiny):
    _, tok = tiny
    prompts = [prompt(tok, t) for t in ("hi", "a much longer prompt here", "x = 1\n")]
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    batched = engine.generate([GenerationRequest(p, sp) for p in prompts])
    single = [engine.generate([GenerationRequest(p, sp)])[0] for p in prompts]
    for b, s in zip(batched, single, strict=True):
        assert b.token_ids == s.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=1e-4)


def test_seeded_sampling_is_deterministic(engine, tiny):
    _, tok = tiny
    p = prompt(tok, "seed test")
    run = lambda seed: engine.generate([GenerationRequest(p, SamplingParams(max_tokens=16, seed=seed))])[0].token_ids  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_prefix_cache_matches_fresh_prefill(tiny):
    model, tok = tiny
    cached, fresh = LocalEngine(model, tok, prefix_cache=True), LocalEngine(model, tok, prefix_cache=False)
    context = prompt(tok, "turn one")
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    for turn in range(3):
        a = cached.generate([GenerationRequest(context, sp)])[0]
        b = fresh.generate([GenerationRequest(context, sp)])[0]
        assert a.token_ids == b.token_ids, turn
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
        context = context + a.token_ids + prompt(tok, f" observation {turn} ")
    # A prompt that diverges from the cached one (a new episode) must also match.
    other = prompt(tok, "turn two")
    assert (cached.generate([GenerationRequest(other, sp)])[0].token_ids
            == fresh.generate([GenerationRequest(other, sp)])[0].token_ids)


def test_stop_token_and_stop_string(engine, tiny):
    _, tok = tiny
    p = prompt(tok, "stop test")
    free = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=20, temperature=0.0))])[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    c = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=20, temperature=0.0,
                                                             stop_token_ids=(stop_id,)))])[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[:first + 1]
    text = tok.decode(free.token_ids)
    stop = text[5:7]
    c = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))])[0]
    assert c.finish_reason == "stop" and stop not in c.text and text.startswith(c.text)


def test_update_weights(tiny):
    model, tok = tiny
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    engine = LocalEngine(clone, tok)
    p = prompt(tok, "weights")
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    before = engine.generate([GenerationRequest(p, sp)])[0]
    new = {k: torch.randn_like(v) for k, v in clone.state_dict().items() if k.endswith("mlp.up_proj.weight")}
    engine.update_weights(7, new)
    after = engine.generate([GenerationRequest(p, sp)])[0]
    assert after.policy_version == 7 and before.policy_version == 0
    assert after.logprobs != before.logprobs
    with pytest.raises(KeyError, match="does not have"):
        engine.update_weights(8, {"nope": torch.zeros(1)})
    key = next(iter(new))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(8, {key: torch.zeros(3)})


def test_bad_requests(engine):
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.generate([GenerationRequest([], SamplingParams())])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
