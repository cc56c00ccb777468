"""Continuous batching in `LocalEngine` on the tiny random model (float32, CPU): many threads at once, sequences that
join and leave, caches across turns, shared group prefills, weight updates and cancellation mid-completion, and
failures that stay with the request that caused them. Every batched result is compared with the same request run
alone and with one plain full-context forward pass."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import EngineClosed, LocalEngine
from shipyard.models.resolve import tiny_model

WAIT = 60  # seconds any future may take: a hang fails the test instead of the run


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model()
    return model.float(), tok


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: byte b is token b


def solo(model, tok, req: GenerationRequest):
    """The request alone on a fresh engine with no cache reuse and a batch of one."""
    engine = LocalEngine(model, tok, max_batch=1, prefix_cache=False)
    try:
        return engine.generate([req])[0]
    finally:
        engine.close()


def full_forward_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token from one forward pass over the whole context, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    logits = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def same(a, b) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def requests_mix() -> list[GenerationRequest]:
    texts = ["hi", "a much longer prompt than the others, to force left padding", "x = 1\n", "def f(a, b):",
             "seeded sample", "nucleus"]
    samplings = [SamplingParams(max_tokens=20, temperature=0.0), SamplingParams(max_tokens=7, temperature=0.0),
                 SamplingParams(max_tokens=25, temperature=0.0), SamplingParams(max_tokens=12, temperature=1.0, seed=4),
                 SamplingParams(max_tokens=30, temperature=0.8, seed=9), SamplingParams(max_tokens=16, temperature=0.7,
                                                                                        top_p=0.9, seed=1)]
    return [GenerationRequest(ids(t), sp) for t, sp in zip(texts, samplings, strict=True)]


def test_threads_batch_together_and_each_matches_its_solo_run(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok, max_batch=8)
    reqs = requests_mix()
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(reqs))

    def episode(i: int) -> None:
        barrier.wait()
        results[i] = engine.generate([reqs[i]])[0]

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert engine.stats["max_running"] > 1, "the threads' sequences never decoded together"
    for i, req in enumerate(reqs):
        same(results[i], solo(model, tok, req))
        sp = req.sampling
        torch.testing.assert_close(torch.tensor(results[i].logprobs),
                                   full_forward_logprobs(model, req.prompt_ids, results[i].token_ids, sp.temperature),
                                   atol=1e-4, rtol=1e-4)
    assert engine.load() == 0
    engine.close()


def test_new_sequences_join_while_a_long_one_runs(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok, max_batch=4)
    long_req = GenerationRequest(ids("the long one"), SamplingParams(max_tokens=400, temperature=0.0))
    long = engine.submit(long_req)
    deadline = time.monotonic() + WAIT
    while engine.stats["decode_steps"] < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    shorts = [GenerationRequest(ids(f"short {i}"), SamplingParams(max_tokens=5, temperature=0.0)) for i in range(3)]
    short_results = [f.result(WAIT) for f in [engine.submit(r) for r in shorts]]
    assert not long.done(), "the short requests waited for the long one (static batching)"
    same(long.result(WAIT), solo(model, tok, long_req))
    for r, c in zip(shorts, short_results, strict=True):
        same(c, solo(model, tok, r))
    engine.close()


def test_session_cache_prefills_only_the_new_tokens(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok)
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    context = ids("system: you are an agent. user: fix the bug")
    first = engine.generate([GenerationRequest(context, sp, session="rollout-1")])[0]
    assert engine.stats["prefill_tokens"] == len(context)
    for turn in range(3):
        observation = ids(f" <tool_response>result {turn}</tool_response> ")
        context = context + first.token_ids + observation
        before = engine.stats["prefill_tokens"]
        req = GenerationRequest(context, sp, session="rollout-1")
        first = engine.generate([req])[0]
        # The last sampled token of the previous turn was never fed; everything before it was cached.
        assert engine.stats["prefill_tokens"] - before == len(observation) + 1, turn
        same(first, solo(model, tok, req))
    engine.close()


def test_group_of_identical_prompts_prefills_once_and_draws_distinct_samples(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok, max_batch=8)
    prompt = ids("a long shared task statement. " * 12)
    reqs = [GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=100 + k),
                              session=f"group-{k}") for k in range(8)]
    out = engine.generate(reqs)
    assert engine.stats["prefill_tokens"] == len(prompt) + 7  # one prefill; each sibling feeds its last token
    assert len({tuple(c.token_ids) for c in out}) == 8
    for req, c in zip(reqs, out, strict=True):
        same(c, solo(model, tok, req))
    separate = LocalEngine(model, tok, max_batch=8, prefix_cache=False)
    separate.generate(reqs)
    assert separate.stats["prefill_tokens"] == 8 * len(prompt)
    engine.close()
    separate.close()


def test_kept_caches_are_bounded_least_recently_used_first(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok, cache_tokens=130)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = {s: ids(f"{s} session " * 6) for s in ("a", "b", "c")}  # 60 + 3 fed tokens each: two fit
    for s, p in prompts.items():
        engine.generate([GenerationRequest(p, sp, session=s)])
    assert engine._store.tokens <= 130 and set(engine._store.entries) == {"b", "c"}
    before = engine.stats["prefill_tokens"]
    engine.generate([GenerationRequest(prompts["a"] + ids(" more"), sp, session="a")])
    assert engine.stats["prefill_tokens"] - before == len(prompts["a"]) + 5  # "a" was evicted: a full prefill
    engine.close()


def test_weight_update_lands_between_decode_steps(tiny):
    model, tok = tiny
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    engine = LocalEngine(clone.eval(), tok)
    new = {k: torch.randn_like(v) for k, v in clone.state_dict().items() if k.endswith("mlp.up_proj.weight")}
    polls = 0

    def poll() -> bool:  # polled at admission and before each token; the 10th poll pushes new weights
        nonlocal polls
        polls += 1
        if polls == 10:
            engine.update_weights(3, new)
        return False

    c = engine.generate([GenerationRequest(ids("spanning"), SamplingParams(max_tokens=20, temperature=0.0),
                                           cancelled=poll)])[0]
    assert c.policy_version == 0 and engine.policy_version == 3
    assert c.token_versions == [0] * 9 + [3] * 11
    after = engine.generate([GenerationRequest(ids("after"), SamplingParams(max_tokens=3, temperature=0.0))])[0]
    assert after.policy_version == 3 and after.token_versions == []
    engine.close()


def test_cancelled_request_stops_and_its_batch_mates_run_on(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok)
    polls = 0

    def give_up() -> bool:  # polled once at admission, then before each token
        nonlocal polls
        polls += 1
        return polls > 6

    mate = GenerationRequest(ids("batch mate"), SamplingParams(max_tokens=30, temperature=0.0))
    gone = GenerationRequest(ids("client left"), SamplingParams(max_tokens=300, temperature=0.0), cancelled=give_up)
    cancelled, finished = engine.generate([gone, mate])
    assert cancelled.finish_reason == "abort" and len(cancelled.token_ids) == 5
    same(finished, solo(model, tok, mate))
    engine.close()


def test_a_failing_request_fails_alone(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok)
    polls = 0

    def broken() -> bool:
        nonlocal polls
        polls += 1
        if polls == 4:
            raise RuntimeError("callback exploded")
        return False

    mates = [GenerationRequest(ids(f"mate {i}"), SamplingParams(max_tokens=15, temperature=0.0)) for i in range(3)]
    bad = engine.submit(GenerationRequest(ids("bad"), SamplingParams(max_tokens=15), cancelled=broken))
    good = [engine.submit(r) for r in mates]
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(GenerationRequest([5, 10**6], SamplingParams()))
    with pytest.raises(ValueError, match="non-empty"):
        engine.submit(GenerationRequest([], SamplingParams()))
    with pytest.raises(RuntimeError, match="exploded"):
        bad.result(WAIT)
    for r, f in zip(mates, good, strict=True):
        same(f.result(WAIT), solo(model, tok, r))
    assert engine.load() == 0
    engine.close()


def test_agenerate_and_cancelling_its_task(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok)

    async def main():
        reqs = [GenerationRequest(ids(f"async {i}"), SamplingParams(max_tokens=6, temperature=0.0)) for i in range(4)]
        out = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        endless = asyncio.ensure_future(engine.agenerate(
            GenerationRequest(ids("endless"), SamplingParams(max_tokens=100_000, temperature=0.0))))
        while engine.stats["decode_steps"] < 3:
            await asyncio.sleep(0.01)
        endless.cancel()
        with pytest.raises(asyncio.CancelledError):
            await endless
        return reqs, out

    reqs, out = asyncio.run(main())
    for r, c in zip(reqs, out, strict=True):
        same(c, solo(model, tok, r))
    deadline = time.monotonic() + WAIT
    while engine.load() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.load() == 0  # the cancelled sequence left the batch
    engine.close()


def test_close_fails_what_is_running(tiny):
    model, tok = tiny
    engine = LocalEngine(model, tok)
    running = engine.submit(GenerationRequest(ids("forever"), SamplingParams(max_tokens=100_000, temperature=0.0)))
    while engine.stats["decode_steps"] < 2:
        time.sleep(0.01)
    engine.close()
    with pytest.raises(EngineClosed, match=f"^engine {engine.name} was closed before this request finished$"):
        running.result(WAIT)
    with pytest.raises(EngineClosed, match=f"^engine {engine.name} is closed$"):
        engine.submit(GenerationRequest(ids("late"), SamplingParams()))


def test_running_batch_pads_rows_and_compacts_when_they_leave():
    from shipyard.models.kvbatch import RunningBatch

    def kv(n: int, fill: float):
        return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), -fill)) for _ in range(2)]

    batch = RunningBatch()
    batch.add([kv(5, 1.0)])
    batch.add([kv(12, 2.0), kv(3, 3.0)])
    assert batch.width == 12 and batch.lengths == [5, 12, 3]
    mask = batch.next_mask(torch.device("cpu"))
    assert mask.shape == (3, 13) and mask.sum(-1).tolist() == [6, 13, 4] and mask[0, -6:].all()
    torch.testing.assert_close(batch.row(2)[1][0], torch.full((1, 2, 3, 4), 3.0))
    batch.keep([2, 0])  # the 12-token row leaves: the columns only it used are cut
    assert batch.width == 5 and batch.lengths == [3, 5]
    torch.testing.assert_close(batch.row(1)[0][1], torch.full((1, 2, 5, 4), -1.0))
    assert batch.cache.layers[0].keys[0, :, :2].abs().sum() == 0  # the 3-token row's padding
    batch.keep([])
    assert len(batch) == 0 and batch.width == 0
