"""`EngineRouter` over real engines: two `LocalEngine`s on the tiny model for stickiness and least-loaded placement,
and `OpenAIEngine`s against real `shipyard serve` apps (uvicorn on 127.0.0.1) that shut down or refuse, for
failover."""

from __future__ import annotations

import threading

import pytest
import torch
from servers import running_app, wait_for

from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.errors import InfraError
from shipyard.models.local import LocalEngine
from shipyard.models.openai import ServerError
from shipyard.models.replay import ReplayEngine
from shipyard.models.resolve import TINY, make_engine, tiny_model
from shipyard.models.router import EngineRouter, NoEngineLeft
from shipyard.models.server import ServeConfig, create_app

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model()
    return model.float(), tok


def ids(text: str) -> list[int]:
    return list(text.encode())




def test_sessions_stick_and_new_ones_go_to_the_least_loaded(tiny):
    model, tok = tiny
    a, b = LocalEngine(model, tok, name="a"), LocalEngine(model, tok, name="b")
    router = EngineRouter([a, b])
    context = ids("system prompt. task: x")
    first = router.generate([GenerationRequest(context, GREEDY, session="x")])[0]
    assert a.stats["prefills"] == 1 and b.stats["prefills"] == 0  # both idle: the first engine
    stop = threading.Event()
    busy = router.submit(GenerationRequest(ids("long"), SamplingParams(max_tokens=100_000, temperature=0.0),
                                           cancelled=stop.is_set, session="long"))
    try:
        assert wait_for(lambda: a.stats["prefills"] == 2)  # idle again: "long" went to a too
        # x's next turn goes back to a, its cache, although b is idle; it prefills only the new tokens.
        before = a.stats["prefill_tokens"]
        context = context + first.token_ids + ids(" observation")
        router.generate([GenerationRequest(context, GREEDY, session="x")])
        assert a.stats["prefill_tokens"] - before == len(ids(" observation")) + 1 and b.stats["prefills"] == 0
        # A new session goes to the least loaded engine: b.
        router.generate([GenerationRequest(ids("another rollout"), GREEDY, session="y")])
        assert b.stats["prefills"] == 1
        assert router.inflight == [1, 0] and router.load() == 1
    finally:
        stop.set()
    assert busy.result(30).finish_reason == "abort"
    router.close()


def clones(tiny, kind: type[LocalEngine] = LocalEngine) -> list[LocalEngine]:
    """Engines "a" and "b", each on its own copy of the tiny model (a push to one must not reach the other)."""
    model, tok = tiny
    engines = []
    for name in ("a", "b"):
        clone = type(model)(model.config)
        clone.load_state_dict(model.state_dict())
        engines.append(kind(clone.eval(), tok, name=name))
    return engines


def test_update_weights_fans_out(tiny):
    engines = clones(tiny)
    router = EngineRouter(engines)
    new = tiny_model(seed=5)[0].state_dict()
    router.update_weights(4, new)
    assert [e.policy_version for e in engines] == [4, 4] and router.policy_version == 4
    for e in engines:
        torch.testing.assert_close(e.model.state_dict()["model.norm.weight"], new["model.norm.weight"])
    out = router.generate([GenerationRequest(ids("after the update"), GREEDY)])[0]
    assert out.policy_version == 4
    router.close()


def test_a_shut_down_server_fails_over_to_another_engine(tiny):
    model, tok = tiny
    local = LocalEngine(model, tok, name="local")
    served = LocalEngine(model, tok, name="served")
    with running_app(create_app(served, TINY, ServeConfig())) as url:
        remote = make_engine(f"openai:{url}/v1")
        router = EngineRouter([remote, local], cooldown=3600)
        req = GenerationRequest(ids("a rollout's first turn"), GREEDY, session="r")
        first = router.generate([req])[0]
        assert served.stats["prefills"] == 1 and local.stats["prefills"] == 0
    # The server is gone: the session's next turn is retried on the local engine, with the same result.
    second = router.generate([req])[0]
    assert second.token_ids == first.token_ids and local.stats["prefills"] == 1
    assert router.live() == [1] and "ServerUnreachable" in router.failures[0]
    local.close()
    with pytest.raises(NoEngineLeft, match="2 engines") as caught:  # the local engine closed as well
        router.generate([GenerationRequest(ids("nobody left"), GREEDY)])
    assert isinstance(caught.value, InfraError)  # the class's place is the contract: rollouts mask InfraError
    router.close()


def test_a_server_answering_503_is_an_infra_error_and_fails_over(tiny):
    model, tok = tiny
    served = LocalEngine(model, tok, name="served")
    app = create_app(served, TINY, ServeConfig())
    with running_app(app) as url:
        remote = make_engine(f"openai:{url}/v1")
        app.state.batcher.stopping = True  # shutting down: every completion gets 503
        with pytest.raises(ServerError, match="503"):
            remote.generate([GenerationRequest(ids("refused"), GREEDY)])
        local = LocalEngine(model, tok, name="local")
        router = EngineRouter([remote, local])
        out = router.generate([GenerationRequest(ids("refused"), GREEDY)])[0]
        assert len(out.token_ids) == 6 and router.live() == [1]
        remote.close()
    local.close()


def test_make_engine_with_several_urls_builds_a_router(tiny):
    model, tok = tiny
    engines = [LocalEngine(model, tok, name=f"e{i}") for i in range(2)]
    with running_app(create_app(engines[0], TINY, ServeConfig())) as u1, \
            running_app(create_app(engines[1], TINY, ServeConfig())) as u2:
        router = make_engine(f"openai:{u1}/v1,{u2}/v1")
        assert isinstance(router, EngineRouter) and len(router.engines) == 2
        out = router.generate([GenerationRequest(ids(f"request {i}"), GREEDY, session=f"s{i}") for i in range(4)])
        assert [len(c.token_ids) for c in out] == [6] * 4
        assert sum(e.stats["prefills"] for e in engines) == 4
        router.close()


class DroppedPush(LocalEngine):
    """A real engine whose weight pushes fail with `InfraError` while `dropping` is set (a server that was
    restarting, or unreachable for a moment, when the trainer pushed), and wait for `release` while `holding` is set
    (a slow reload), saying so by `held`. `pushes` counts the pushes it was asked for."""

    dropping = holding = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held, self.release, self.pushes = threading.Event(), threading.Event(), 0

    def update_weights(self, version, tensors, complete=False):
        self.pushes += 1
        if self.holding:
            self.held.set()
            assert self.release.wait(30)
        if self.dropping:
            raise InfraError(f"{self.name} missed the push of version {version}")
        super().update_weights(version, tensors, complete)


def test_an_engine_that_missed_a_push_serves_nothing_until_a_later_push_reaches_it(tiny):
    engines = clones(tiny, DroppedPush)
    a, b = engines
    router = EngineRouter(engines, cooldown=0.0)  # back at once by the clock: only its version keeps it out
    router.generate([GenerationRequest(ids("a session on a"), GREEDY, session="s")])
    a.dropping = True
    router.update_weights(1, tiny_model(seed=5)[0].state_dict())
    assert (a.policy_version, b.policy_version, router.policy_version) == (0, 1, 1)
    assert "missed the push of version 1" in router.failures[0] and router.live() == [1]
    # Every request, the session that was on a included, is served by b with the new weights: no sample of the old
    # policy comes back labelled as if the trainer's version had drawn it, and none is drawn by a behind engine.
    before = a.stats["prefills"]
    out = router.generate([GenerationRequest(ids(f"after {i}"), GREEDY, session="s" if i == 0 else f"n{i}")
                           for i in range(4)])
    assert {c.policy_version for c in out} == {1} and a.stats["prefills"] == before
    # The next push reaches a again (it is tried although it failed the last one), and it serves again.
    a.dropping = False
    router.update_weights(2, tiny_model(seed=6)[0].state_dict())
    assert (a.policy_version, b.policy_version) == (2, 2) and router.live() == [0, 1]
    router.generate([GenerationRequest(ids("new"), GREEDY, session=f"m{i}") for i in range(2)])
    assert a.stats["prefills"] > before
    # A push that no engine takes is an error now, not a silent run on old weights that fails steps later.
    a.dropping = b.dropping = True
    with pytest.raises(NoEngineLeft, match="no engine .* took weights version 3") as caught:
        router.update_weights(3, tiny_model(seed=7)[0].state_dict())
    assert "a missed" in str(caught.value) and "b missed" in str(caught.value)
    with pytest.raises(NoEngineLeft, match="behind"):
        router.generate([GenerationRequest(ids("nobody current"), GREEDY)])
    router.close()


def test_engines_whose_first_version_is_below_zero_are_not_behind_before_a_push():
    """A replay engine has no weights (`policy_version` -1): it has missed no push, so it serves."""
    engines = [ReplayEngine(["hi"], name=n) for n in ("a", "b")]
    router = EngineRouter(engines)
    assert router.live() == [0, 1] and router.policy_version == -1
    assert router.generate([GenerationRequest([1, 2], GREEDY, session="s")])[0].text == "hi"
    router.close()


def test_engines_serve_while_a_push_goes_round_and_one_in_cooldown_does_not_hold_it_up(tiny):
    a, b = engines = clones(tiny, DroppedPush)
    router = EngineRouter(engines, cooldown=3600)
    a.holding = True
    push = threading.Thread(target=router.update_weights, args=(1, tiny_model(seed=5)[0].state_dict()))
    push.start()
    try:
        assert a.held.wait(30)  # a is loading version 1, b has not been reached: both still serve version 0
        out = router.generate([GenerationRequest(ids(f"mid-push {i}"), GREEDY, session=f"p{i}") for i in range(2)])
        assert [c.policy_version for c in out] == [0, 0]
    finally:
        a.release.set()
        push.join(30)
    assert (a.policy_version, b.policy_version) == (1, 1)
    # b fails a push and is down for an hour: the next push skips it (a hung server would hold up the rest), and it
    # stays out of the rotation for as long as it lacks the weights.
    a.holding, b.dropping = False, True
    router.update_weights(2, tiny_model(seed=6)[0].state_dict())
    b.dropping = False
    router.update_weights(3, tiny_model(seed=7)[0].state_dict())
    assert (a.pushes, b.pushes) == (3, 2) and router.missed == [None, 3] and router.live() == [0]
    assert router.policy_version == 3
    router._down_until[1] = 0.0  # its cooldown over: still behind, so still out
    assert router.live() == [0]
    # A push refused for a reason of its own (not the infrastructure's) propagates at once and leaves the engines as
    # they were: they go on serving the version they hold.
    with pytest.raises(KeyError, match="does not have"):
        router.update_weights(4, {"not.a.weight": torch.zeros(1)})
    assert router.live() == [0] and router.generate([GenerationRequest(ids("still"), GREEDY)])[0].policy_version == 3
    router.close()
