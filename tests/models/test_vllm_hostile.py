"""`VLLMEngine`, `WeightDir` and `VLLMServers` against servers, files and processes that misbehave.

The server is `fake_vllm.FakeVLLM`, a real uvicorn server with vLLM's routes, told per test to answer badly: bodies
that are not generations, tokens that are not ids, logprobs that are not logprobs, weight-version spans with gaps,
overlaps, versions never pushed or going backwards, hangs, resets, 4xx/5xx. Every one must end as an error of the
right class — `ServerError`/`InfraError` when the server is at fault (the router takes it out), `RequestRejected`
when the request is — never a TypeError from the parser, and never a completion labelled with a version that did not
draw it. The launcher runs the same fake as vLLM's python (a wrapper script), in its own process group with a child
that ignores SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch
from fake_vllm import FakeVLLM
from fastapi.responses import Response, StreamingResponse
from safetensors.torch import load_file, save_file
from servers import alive, free_port, running_app, wait_for

from shipyard.errors import FileFormatError, UsageError, UserError
from shipyard.models.engine import GenerationRequest, SamplingParams, VersionConflict
from shipyard.models.errors import InfraError, ServerUnreachable
from shipyard.models.openai import RequestRejected
from shipyard.models.tokenizer import byte_tokenizer
from shipyard.models.vllm import NotAWeightServer, ServerError, VLLMEngine
from shipyard.models.vllm_server import ServerStartError, VLLMConfig, VLLMServers, managed_engine
from shipyard.models.weightdir import MAX_HEADER, PushRejected, WeightDir, checked, manifest

FAKE = Path(__file__).with_name("fake_vllm.py")
GEN = "/inference/v1/generate"
TOKENIZER = byte_tokenizer()
# A served checkpoint with every dtype a push writes, a scalar and an empty tensor.
STORED = {"embed.weight": torch.zeros(8, 4, dtype=torch.bfloat16), "head.bias": torch.zeros(8, dtype=torch.float16),
          "norm.weight": torch.zeros(4, dtype=torch.float32), "scale": torch.zeros((), dtype=torch.bfloat16),
          "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("served")
    save_file(STORED, str(path / "model.safetensors"))
    return path


def push(seed: int = 1) -> dict[str, torch.Tensor]:
    """fp32 weights of the served checkpoint's shapes, as the trainer has them."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g) for name, t in STORED.items()}


@pytest.fixture(scope="module")
def server():
    fake = FakeVLLM()
    with running_app(fake.app) as url:
        try:
            yield fake, url
        finally:
            fake.released.set()


@pytest.fixture
def fake(server) -> FakeVLLM:
    server[0].reset()
    return server[0]


@pytest.fixture
def connect(server, model_dir, tmp_path):
    """connect(**engine options) -> a VLLMEngine on the fake (closed after the test)."""
    made = []

    def make(url: str | None = None, **kwargs) -> VLLMEngine:
        made.append(VLLMEngine(url or server[1], TOKENIZER, WeightDir(tmp_path / "weights", manifest(model_dir)),
                               **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def reply(obj=None, status: int = 200, text: str | bytes | None = None, headers: dict | None = None):
    """A misbehaviour: answer `obj` as JSON (NaN and all), or `text` as it is."""
    async def answer(_body):
        content = text if text is not None else json.dumps(obj)
        return Response(content, status_code=status, headers=headers, media_type="application/json")
    return answer


def edited(fake: FakeVLLM, edit):
    """A misbehaviour: the normal generation with `edit(choice)` applied."""
    async def answer(body):
        out = fake.generation(body)
        edit(out["choices"][0])
        return Response(json.dumps(out), media_type="application/json")
    return answer


def sample(engine: VLLMEngine, n: int = 4, cancelled=None):
    return engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=n, temperature=1.0, seed=1),
                                              cancelled)])[0]


def spans(*triples):
    return lambda c: c.__setitem__("weight_versions", [{"version": v, "start": s, "end": e} for v, s, e in triples])


# -- sampling ---------------------------------------------------------------------------------------------------------

def test_a_well_behaved_server_gives_a_completion_of_its_version(fake, connect):
    engine = connect()
    c = sample(engine)
    assert c.token_ids == [8, 9, 10, 11] and c.logprobs == [-0.5] * 4 and c.policy_version == 0
    assert c.token_versions == [] and c.finish_reason == "length"
    body = dict(fake.calls)[GEN]
    assert body["cache_salt"] == "shipyard-v0" and body["sampling_params"]["logprobs"] == 0


def setitem(key, value):
    return lambda c: c.__setitem__(key, value)


def logprobs(*values):
    return setitem("logprobs", {"content": [{"logprob": v} for v in values]})


HOSTILE_BODIES = {
    "not json": lambda f: reply(text="<html>502 Bad Gateway</html>"),
    "a list": lambda f: reply([]),
    "no choices": lambda f: reply({"choices": []}),
    "a choice that is a string": lambda f: reply({"choices": ["abc"]}),
    "a null choice": lambda f: reply({"choices": [None]}),
    "choices a string": lambda f: reply({"choices": "abc"}),
    "no token ids": lambda f: edited(f, lambda c: c.pop("token_ids")),
    "token ids a string": lambda f: edited(f, setitem("token_ids", "8901")),  # four "ids", four logprobs, one span
    "token ids floats": lambda f: edited(f, setitem("token_ids", [8.7, 9, 10, 11])),
    "token ids strings": lambda f: edited(f, setitem("token_ids", ["8", 9, 10, 11])),
    "token ids booleans": lambda f: edited(f, setitem("token_ids", [True, 9, 10, 11])),
    "a negative token id": lambda f: edited(f, setitem("token_ids", [-1, 9, 10, 11])),
    "a huge token id": lambda f: edited(f, setitem("token_ids", [2 ** 70, 9, 10, 11])),
    "no logprobs": lambda f: edited(f, lambda c: c.pop("logprobs")),
    "fewer logprobs": lambda f: edited(f, logprobs(-0.5, -0.5, -0.5)),
    "logprobs a list": lambda f: edited(f, setitem("logprobs", [-0.5] * 4)),
    "content a dict": lambda f: edited(f, setitem("logprobs", {"content": {"a": 1}})),
    "a null logprob": lambda f: edited(f, logprobs(-0.5, None, -0.5, -0.5)),
    "a NaN logprob": lambda f: edited(f, logprobs(-0.5, float("nan"), -0.5, -0.5)),
    "an infinite logprob": lambda f: edited(f, logprobs(-0.5, float("-inf"), -0.5, -0.5)),
    "a positive logprob": lambda f: edited(f, logprobs(-0.5, 0.7, -0.5, -0.5)),
    "a logprob as a string": lambda f: edited(f, logprobs(-0.5, "-0.5", -0.5, -0.5)),
    "no weight versions": lambda f: edited(f, lambda c: c.pop("weight_versions")),
    "weight versions a dict": lambda f: edited(f, setitem("weight_versions", {"0": [0, 4]})),
    "a gap between spans": lambda f: edited(f, spans(("0", 0, 2), ("0", 3, 4))),
    "overlapping spans": lambda f: edited(f, spans(("0", 0, 3), ("0", 2, 4))),
    "a span that ends before it starts": lambda f: edited(f, spans(("0", 0, 4), ("0", 4, 2))),
    "spans short of the tokens": lambda f: edited(f, spans(("0", 0, 3))),
    "spans past the tokens": lambda f: edited(f, spans(("0", 0, 5))),
    "a span of a trillion tokens": lambda f: edited(f, spans(("0", 0, 10 ** 12))),
    "a span starting negative": lambda f: edited(f, spans(("0", -2, 4))),
    "span bounds as floats": lambda f: edited(f, spans(("0", 0.0, 4.0))),
    "a version that is a number": lambda f: edited(f, spans((0, 0, 4))),
    "a version null": lambda f: edited(f, spans((None, 0, 4))),
    "a negative version": lambda f: edited(f, spans(("-1", 0, 4))),
    "a version in superscript digits": lambda f: edited(f, spans(("²", 0, 4))),
    "vLLM's default version": lambda f: edited(f, spans(("default", 0, 4))),
    "a version never pushed": lambda f: edited(f, spans(("7", 0, 4))),
    "a version of 40 digits": lambda f: edited(f, spans(("9" * 40, 0, 4))),
}


@pytest.mark.parametrize("hostile", list(HOSTILE_BODIES), ids=list(HOSTILE_BODIES))
def test_a_200_that_is_not_a_sound_generation_is_the_servers_fault(fake, connect, hostile):
    engine = connect()
    fake.misbehave[GEN] = HOSTILE_BODIES[hostile](fake)
    with pytest.raises(ServerError) as e:
        sample(engine)
    assert engine.base_url in str(e.value)


@pytest.mark.parametrize("status, error", [(500, ServerError), (503, ServerError), (429, ServerError),
                                           (502, ServerError), (400, RequestRejected), (422, RequestRejected)])
def test_an_error_status_is_the_servers_or_the_requests(fake, connect, status, error):
    engine = connect()
    fake.misbehave[GEN] = reply({"error": "no"}, status=status)
    with pytest.raises(error, match=f"answered {status}"):
        sample(engine)


async def _hang_then_nothing(fake):
    await fake.hang()


def test_a_server_that_never_answers_times_out_as_an_infra_error(fake, connect):
    engine = connect(timeout=1.0)
    fake.misbehave[GEN] = lambda _body: _hang_then_nothing(fake)
    with pytest.raises(ServerUnreachable, match="lost the vLLM server"):
        sample(engine)


def test_a_connection_reset_mid_body_is_an_infra_error(fake, connect):
    async def half(_body):
        async def body():
            yield b'{"choices": [{"token_ids": [8, 9'
            raise ConnectionResetError("the server went away mid-body")
        return StreamingResponse(body(), headers={"content-length": "4000"})

    engine = connect()
    fake.misbehave[GEN] = half
    with pytest.raises(InfraError):
        sample(engine)


def test_a_body_that_does_not_decode_is_an_infra_error(fake, connect):
    engine = connect()
    fake.misbehave[GEN] = reply(text=b"this is not gzip", headers={"content-encoding": "gzip"})
    with pytest.raises(InfraError):
        sample(engine)


def test_a_cancelled_request_is_aborted_on_the_server(fake, connect):
    engine = connect()
    stop = threading.Event()
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("c", sample(engine, n=5000, cancelled=stop.is_set)))
    worker.start()
    assert wait_for(lambda: fake.running)
    stop.set()
    worker.join(timeout=60)
    request_id = dict(fake.calls)[GEN]["request_id"]
    assert out["c"].finish_reason == "abort" and fake.aborted == {f"generate-tokens-{request_id}"}


def test_more_requests_than_the_engines_concurrency_do_not_deadlock(fake, connect):
    """`generate` fans a batch out, and each request's post runs on a pool: with both on one pool of N threads, a
    batch of N requests held every thread waiting for posts that could never start."""
    engine = connect(max_concurrency=2)
    out = {}
    requests = [GenerationRequest([5, i], SamplingParams(max_tokens=2)) for i in range(5)]
    worker = threading.Thread(target=lambda: out.setdefault("c", engine.generate(requests)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "generate deadlocked"
    assert [c.token_ids[0] for c in out["c"]] == [1, 2, 3, 4, 5]


def in_flight(fake: FakeVLLM, engine: VLLMEngine, versions) -> dict:
    """A request that starts at the engine's version and is answered, with `versions` (span triples), only after a
    push of the next version has landed: as vLLM's in-flight weight updates (pause mode keep) answer."""
    go = threading.Event()

    async def later(body):
        while not go.is_set():
            await asyncio.sleep(0.01)
        out = fake.generation(body)
        spans(*versions)(out["choices"][0])
        return Response(json.dumps(out), media_type="application/json")

    fake.misbehave[GEN] = later
    out = {}

    def run():
        try:
            out["c"] = sample(engine)
        except Exception as e:  # the test asserts on it
            out["e"] = e

    worker = threading.Thread(target=run)
    worker.start()
    assert wait_for(lambda: GEN in fake.paths())
    engine.update_weights(engine.policy_version + 1, push(engine.policy_version + 1))
    go.set()
    worker.join(timeout=60)
    return out


def test_a_push_in_flight_labels_each_token_with_the_version_that_drew_it(fake, connect):
    engine = connect()
    engine.update_weights(1, push(1))
    out = in_flight(fake, engine, [("1", 0, 1), ("2", 1, 4)])
    assert out["c"].policy_version == 1 and out["c"].token_versions == [1, 2, 2, 2]


def test_versions_that_go_backwards_within_a_completion_are_the_servers_fault(fake, connect):
    engine = connect()
    engine.update_weights(1, push(1))
    out = in_flight(fake, engine, [("2", 0, 1), ("1", 1, 4)])
    assert isinstance(out.get("e"), ServerError), out


def test_a_version_older_than_the_requests_is_a_push_that_did_not_land(fake, connect):
    engine = connect()
    engine.update_weights(1, push(1))
    fake.misbehave[GEN] = edited(fake, spans(("0", 0, 4)))
    with pytest.raises(ServerError, match="a push did not land"):
        sample(engine)


# -- start-up ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("models", [
    reply(text="not json"), reply([]), reply({"data": []}), reply({"data": ["x"]}), reply({"data": [None]}),
    reply({"data": [{"owned_by": "vllm"}]}), reply({"data": [{"id": "m", "owned_by": "shipyard"}]}),
    reply({"data": "abc"}),
], ids=["not json", "a list", "no model", "a string", "null", "no id", "not vllm", "data a string"])
def test_a_server_that_is_not_vllm_is_refused_at_start_up(fake, connect, models):
    fake.misbehave["/v1/models"] = models
    with pytest.raises(NotAWeightServer):
        connect()


def test_a_server_without_development_routes_says_how_to_start_it(fake, connect):
    fake.misbehave["/is_paused"] = reply({"detail": "Not Found"}, status=404)
    with pytest.raises(NotAWeightServer, match="VLLM_SERVER_DEV_MODE=1"):
        connect()


@pytest.mark.parametrize("status", [403, 404])
def test_a_server_without_scale_out_says_how_to_start_it(fake, connect, status):
    fake.misbehave[GEN] = reply({"detail": "no"}, status=status)
    with pytest.raises(NotAWeightServer, match="--enable-scale-out"):
        connect()


@pytest.mark.parametrize("answer", [
    reply({"error": "no method shipyard_ready"}, status=500), reply({"results": []}),
    reply({"results": ["ready", "no"]}), reply(text="not json"), reply({"results": "ready"}),
], ids=["no method", "no worker", "one worker without it", "not json", "not a list"])
def test_a_server_without_shipyards_worker_extension_says_how_to_start_it(fake, connect, answer):
    fake.misbehave["/collective_rpc"] = answer
    with pytest.raises(NotAWeightServer, match="--worker-extension-cls shipyard_vllm_worker.ShipyardWorker"):
        connect()


@pytest.mark.parametrize("rank, refused", [(0, "without --enable-lora"), (8, "rank <= 8"), (16, None), (64, None)])
def test_a_lora_run_is_refused_a_server_that_cannot_take_its_adapters(fake, server, model_dir, tmp_path, rank,
                                                                     refused):
    from shipyard.models.lora import LoraConfig

    fake.lora_rank = rank  # the route to load adapters answers either way (400 to an empty body), as vLLM's does
    weights = WeightDir(tmp_path / "w", manifest(model_dir), LoraConfig(enabled=True, rank=16))
    if refused is None:
        VLLMEngine(server[1], TOKENIZER, weights).close()
        return
    with pytest.raises(NotAWeightServer, match=refused):
        VLLMEngine(server[1], TOKENIZER, weights)


@pytest.mark.parametrize("backend, refused", [("", "--weight-transfer-config"), ("ipc", "--weight-transfer-config"),
                                             ("nccl", "sees none")])
def test_an_nccl_run_is_refused_a_server_that_cannot_receive_broadcasts_before_any_rendezvous(fake, connect, backend,
                                                                                          refused):
    """An NCCL rendezvous waits for every rank: the server is asked for its transfer backend before one is begun.
    (With one, this machine's lack of a GPU is what refuses it; `test_vllm_nccl.py` pushes where GPUs are.)"""
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("a GPU would open the group")
    fake.transfer = backend
    with pytest.raises(UserError, match=refused):
        connect(nccl_workers=1)
    assert "/init_weight_transfer_engine" not in [path for path, _ in fake.calls]


def nccl_engine(fake, connect, timeout: float = 5.0) -> VLLMEngine:
    """An engine that pushes over a loopback NCCL group to the fake's workers (tests/models/fake_nccl.py)."""
    from fake_nccl import LoopbackNccl, TransferPeer

    fake.transfer, fake.peer = "nccl", TransferPeer()
    return connect(nccl_workers=1, collectives=LoopbackNccl(), timeout=timeout)


def test_an_nccl_push_is_broadcast_in_the_announced_order_between_pause_and_resume(fake, connect, model_dir):
    engine = nccl_engine(fake, connect)
    assert fake.paths()[-1] == "/init_weight_transfer_engine"
    fake.calls.clear()
    weights = push(1)
    engine.update_weights(1, weights)
    expected = checked(weights, manifest(model_dir))  # the served dtypes, the tied head once, in the checkpoint's order
    assert list(fake.peer.received) == list(expected)
    assert all(torch.equal(fake.peer.received[k], v) for k, v in expected.items())
    assert fake.paths() == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                            "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert fake.calls[4][1]["method"] == "shipyard_retie" and fake.version == "1"
    assert sample(engine).policy_version == 1
    assert engine.last_push.bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert not (engine.weights.root / "v1").exists()  # nothing written: the push is held in memory, once
    assert engine.weights.held[0] == 1 and engine.weights.hold(1, push(2)) is engine.weights.held[1]


async def _dies_after(fake, n: int | None, body):
    """The workers receive `n` tensors (None: all), then the server fails."""
    await asyncio.to_thread(fake.peer.receive, body, n)
    return Response(json.dumps({"error": "engine core died"}), status_code=500)


@pytest.mark.parametrize("case", ["refused before receiving", "died half way"])
def test_an_nccl_transfer_that_fails_half_way_ends_the_run_at_once_and_says_why(fake, connect, case):
    """The trainer's broadcasts wait for a peer that will not come: no retry, no restart — `TransferWedged`, at once
    (not after the timeout), and not hidden by the resume that follows (vLLM answers no resume while stuck)."""
    from shipyard.models.nccl import TransferWedged

    engine = nccl_engine(fake, connect, timeout=60)
    fake.misbehave["/update_weights"] = (reply({"detail": "bad update_info"}, status=400) if case.startswith("refused")
                                         else lambda body: _dies_after(fake, 2, body))
    with pytest.raises(TransferWedged, match="failed half way .*start the run again"):
        engine.update_weights(1, push(1))
    assert "/resume" in fake.paths() and "/finish_weight_update" not in fake.paths()
    with pytest.raises(TransferWedged, match="failed half way"):
        sample(engine)  # no sample from weights half loaded, and no restart (an InfraError) beside a stuck GPU
    with pytest.raises(TransferWedged):
        engine.update_weights(2, push(2))


def test_a_transfer_stuck_on_the_server_is_wedged_within_the_timeout_and_the_stuck_resume_does_not_hide_it(
        fake, connect, monkeypatch):
    """The workers stop receiving and the route never answers; vLLM's engine core, busy with it, answers no resume
    either (the fake's control calls are serialized as vLLM's are). Bounded: the timeout, then a short resume."""
    import time

    import shipyard.models.vllm as vllm_module
    from shipyard.models.nccl import TransferWedged

    async def stuck(body):
        await asyncio.to_thread(fake.peer.receive, body, 1)
        await fake.hang()

    monkeypatch.setattr(vllm_module, "RESUME_AFTER_WEDGE", 0.5)
    engine = nccl_engine(fake, connect, timeout=1.0)
    fake.misbehave["/update_weights"] = stuck
    t0 = time.monotonic()
    with pytest.raises(TransferWedged, match="nothing completed within 1 s"):
        engine.update_weights(1, push(1))
    assert time.monotonic() - t0 < 1.0 + 0.5 + 5


def test_a_server_that_answers_late_after_receiving_everything_is_an_infra_error_not_a_wedge(fake, connect):
    """The trainer's side completed (its GPU is clean) and the answer is late: the server's failure."""
    async def late(body):
        await asyncio.to_thread(fake.peer.receive, body)
        await fake.hang()

    engine = nccl_engine(fake, connect, timeout=1.0)
    fake.misbehave["/update_weights"] = late
    with pytest.raises(ServerError, match="failed after receiving the weights .*no answer within 1 s"):
        engine.update_weights(1, push(1))


def test_a_server_that_fails_after_receiving_everything_is_an_infra_error(fake, connect):
    """The trainer's side completed (its GPU is clean): the server's fault, which a managed server recovers from by a
    restart and the kept copy of the push."""
    engine = nccl_engine(fake, connect)
    fake.misbehave["/update_weights"] = lambda body: _dies_after(fake, None, body)
    with pytest.raises(ServerError, match="failed after receiving the weights"):
        engine.update_weights(1, push(1))
    assert engine.broken and engine.weights.held[0] == 1  # what a restarted server is given


@pytest.mark.parametrize("case", ["answers an error", "never answers"])
def test_a_server_that_cannot_join_the_group_is_a_start_up_error_saying_what_to_check(fake, connect, case):
    async def never(_body):
        await fake.hang()

    from fake_nccl import TransferPeer

    fake.peer = TransferPeer()
    fake.misbehave["/init_weight_transfer_engine"] = (reply({"error": "NCCL error: unhandled system error"},
                                                            status=500) if case == "answers an error" else never)
    with pytest.raises(UserError, match="could not join the weight-transfer group .*NCCL_SOCKET_IFNAME"):
        nccl_engine(fake, connect, timeout=1.0) if case == "never answers" else nccl_engine(fake, connect)


class _Restartable:
    """`VLLMServers` as `ManagedServer` sees it, over the in-process fake: a restart gives the fake fresh workers."""

    def __init__(self, fake, url: str, nccl: bool):
        from fake_nccl import TransferPeer

        self.fake, self.urls, self.logs, self.restarted = fake, [url], ["(log)"], 0
        self.procs = [type("Alive", (), {"poll": lambda self: None})()]
        self.config = VLLMConfig(urls=(url,), transfer="nccl" if nccl else "disk")
        self.peer = TransferPeer

    def restart(self, i: int) -> str:
        self.restarted += 1
        self.fake.version = "0"  # its initial weights
        if self.fake.peer is not None:
            self.fake.peer = self.peer()
        return self.urls[i]


def _managed(fake, server, model_dir, tmp_path, nccl: bool):
    from fake_nccl import LoopbackNccl, TransferPeer

    from shipyard.models.vllm_server import ManagedServer

    if nccl:
        fake.transfer, fake.peer = "nccl", TransferPeer()
    servers = _Restartable(fake, server[1], nccl)
    weights = WeightDir(tmp_path / "weights", manifest(model_dir))
    return ManagedServer(servers, 0, TOKENIZER, weights, collectives=LoopbackNccl() if nccl else None), servers


@pytest.mark.parametrize("nccl", [False, True], ids=["disk", "nccl"])
def test_a_restart_gives_the_newest_push_and_a_push_it_already_gave_is_not_made_again(fake, server, model_dir,
                                                                                     tmp_path, nccl):
    """A server found broken is restarted and given the newest version (a file, or the copy an NCCL run holds) before
    it serves; the router's push of that same version, reaching it after the restart, is no VersionConflict."""
    managed, servers = _managed(fake, server, model_dir, tmp_path, nccl)
    managed.update_weights(1, push(1))
    v2 = push(2)
    (managed.weights.hold if nccl else managed.weights.write)(2, v2)  # pushed to another server meanwhile
    managed.engine.broken = "a request found it broken"
    with pytest.raises(InfraError):
        managed.generate([GenerationRequest([5], SamplingParams(max_tokens=2))])  # recovers: restart, version 2
    assert servers.restarted == 1 and managed.policy_version == 2 and fake.version == "2"
    if nccl:
        assert torch.equal(fake.peer.received["norm.weight"], v2["norm.weight"])
    managed.update_weights(2, v2)  # the router reaches it: already there
    assert sample(managed).policy_version == 2
    managed.close()


def test_no_server_is_restarted_beside_a_wedged_transfer(fake, server, model_dir, tmp_path):
    from shipyard.models.nccl import TransferWedged

    managed, servers = _managed(fake, server, model_dir, tmp_path, nccl=True)
    fake.misbehave["/update_weights"] = reply({"detail": "bad"}, status=400)
    with pytest.raises(TransferWedged):
        managed.update_weights(1, push(1))
    managed._recover(managed.engine, wait=True)  # as a request that met the server failing would
    assert servers.restarted == 0
    with pytest.raises(TransferWedged):
        sample(managed)
    managed.close()


def test_nothing_listening_is_unreachable(connect):
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        connect(f"http://127.0.0.1:{free_port()}")


@pytest.mark.parametrize("route", ["/is_paused", GEN, "/update_weight_version"])
def test_a_server_that_hangs_up_during_the_start_up_checks_is_an_infra_error(fake, connect, route):
    async def hang_up(_body):
        async def body():
            yield b"{"
            raise ConnectionResetError("gone")
        return StreamingResponse(body(), headers={"content-length": "100"})

    fake.misbehave[route] = hang_up
    with pytest.raises(InfraError):
        connect()


# -- pushes -----------------------------------------------------------------------------------------------------------

def test_a_push_pauses_reloads_labels_resets_and_resumes_in_that_order(fake, connect, tmp_path):
    engine = connect()
    fake.calls.clear()
    weights = push(1)
    engine.update_weights(1, weights)
    assert fake.paths() == ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    calls = dict(fake.calls)
    assert calls["/pause"] == {"mode": "keep"} and calls["/update_weight_version"] == {"new_version": "1"}
    written = load_file(str(Path(calls["/collective_rpc"]["args"][0]) / "model.safetensors"))
    assert {n: t.dtype for n, t in written.items()} == {n: t.dtype for n, t in STORED.items()}
    assert torch.equal(written["norm.weight"], weights["norm.weight"])
    c = sample(engine)
    assert c.policy_version == 1 and dict(fake.calls)[GEN]["cache_salt"] == "shipyard-v1"
    assert engine.last_push.version == 1 and engine.last_push.bytes > 0


RELOAD_ANSWERS = {
    "not json": reply(text="Internal Server Error"),
    "a list": reply(["retied"]),
    "results a string": reply({"results": "retied"}),
    "results a number": reply({"results": 5}),
    "no results": reply({}),
    "a worker's error": reply({"results": ["untied", "error: Qwen2 ties its head but has no lm_head"]}),
    "a 400": reply({"error": "no method shipyard_reload"}, status=400),
    "a 500": reply({"error": "engine dead"}, status=500),
}


@pytest.mark.parametrize("answer", list(RELOAD_ANSWERS), ids=list(RELOAD_ANSWERS))
def test_a_reload_that_fails_leaves_the_engine_broken_and_the_server_resumed(fake, connect, answer):
    engine = connect()
    fake.misbehave["/collective_rpc"] = RELOAD_ANSWERS[answer]
    with pytest.raises(ServerError, match="weights are unknown"):
        engine.update_weights(1, push(1))
    assert fake.paths()[-1] == "/resume" and engine.policy_version == 0
    with pytest.raises(ServerError):
        sample(engine)
    with pytest.raises(ServerError):
        engine.update_weights(2, push(2))


@pytest.mark.parametrize("route", ["/pause", "/update_weight_version", "/reset_prefix_cache", "/resume"])
def test_any_step_of_a_push_failing_leaves_the_engine_broken(fake, connect, route):
    engine = connect()
    fake.misbehave[route] = reply({"error": "no"}, status=404)
    with pytest.raises(ServerError, match="weights are unknown"):
        engine.update_weights(1, push(1))
    assert route == "/pause" or fake.paths()[-1] == "/resume"  # once paused, resumed whatever failed
    with pytest.raises(ServerError):
        sample(engine)


def test_a_push_that_does_not_fit_never_touches_the_server(fake, connect):
    engine = connect()
    fake.calls.clear()
    bad = push(1)
    bad["norm.weight"] = torch.ones(5)
    with pytest.raises(PushRejected):
        engine.update_weights(1, bad)
    with pytest.raises(VersionConflict):
        engine.update_weights(0, push(1))
    assert fake.calls == [] and engine.broken is None


# -- what a push writes -----------------------------------------------------------------------------------------------

def test_tensors_of_any_layout_and_dtype_are_written_contiguous_in_the_stored_dtypes(model_dir):
    spec = manifest(model_dir)
    weights = push(1)
    weights["embed.weight"] = torch.randn(4, 8).t()  # a transposed view: not contiguous
    weights["head.bias"] = weights["head.bias"].to(torch.bfloat16)
    out = checked(weights, spec)
    assert {n: (t.dtype, tuple(t.shape), t.is_contiguous(), t.device.type) for n, t in out.items()} == \
        {n: (s.dtype, s.shape, True, "cpu") for n, s in spec.items()}
    assert torch.equal(out["embed.weight"], weights["embed.weight"].to(torch.bfloat16))


def test_a_tensor_without_data_is_refused_not_crashed_on(model_dir):
    weights = push(1)
    weights["norm.weight"] = torch.empty(4, device="meta")
    with pytest.raises(PushRejected, match="norm.weight"):
        checked(weights, manifest(model_dir))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tensors_on_a_gpu_are_written_from_the_cpu(model_dir):
    weights = {n: t.cuda() for n, t in push(1).items()}
    out = checked(weights, manifest(model_dir))
    assert all(t.device.type == "cpu" for t in out.values())


@pytest.mark.parametrize("extra", ["an empty tensor", "a view of the embedding", "a scalar"])
def test_only_a_true_second_name_of_a_stored_tensor_passes_as_a_tied_head(model_dir, extra):
    """A tied head is dropped because it *is* a stored tensor (same storage, offset, shape). Empty tensors all have
    data_ptr 0, and a view can start where the embedding starts: neither is the embedding."""
    weights = push(1)
    weights["lm_head.weight"] = weights["embed.weight"]
    assert set(checked(weights, manifest(model_dir))) == set(STORED)
    weights["ghost"] = {"an empty tensor": torch.empty(0), "a view of the embedding": weights["embed.weight"][:2],
                        "a scalar": torch.tensor(1.0)}[extra]
    with pytest.raises(PushRejected, match="1 unknown \\['ghost'\\]"):
        checked(weights, manifest(model_dir))


def test_two_stored_names_pushed_as_one_tensor_are_written(tmp_path):
    """A checkpoint that stores its head and its embedding (untied on disk) while the trainer ties them: both names
    point at one bf16 tensor, which safetensors refuses to save twice."""
    stored = {"embed.weight": torch.zeros(8, 4, dtype=torch.bfloat16), "head.weight": torch.zeros(8, 4,
                                                                                                  dtype=torch.bfloat16)}
    save_file(stored, str(tmp_path / "model.safetensors"))
    tied = torch.randn(8, 4).to(torch.bfloat16)
    path = WeightDir(tmp_path / "w", manifest(tmp_path)).write(1, {"embed.weight": tied, "head.weight": tied})
    written = load_file(str(path / "model.safetensors"))
    assert torch.equal(written["embed.weight"], tied) and torch.equal(written["head.weight"], tied)


def raw_safetensors(path: Path, header: bytes, size: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if size is None else size) + header)
    return path


@pytest.mark.parametrize("write, words", [
    (lambda p: p.write_bytes(b"abc"), "shorter than"),
    (lambda p: raw_safetensors(p, b"{}", size=MAX_HEADER + 1), "header of"),
    (lambda p: raw_safetensors(p, b'{"a": {"dtype": "BF16"', size=500), "not JSON"),
    (lambda p: raw_safetensors(p, b"{nope}"), "not JSON"),
    (lambda p: raw_safetensors(p, b"[1, 2]"), "not a safetensors header"),
    (lambda p: raw_safetensors(p, b'{"a": [1]}'), "not a safetensors header"),
    (lambda p: raw_safetensors(p, b'{"a": {"shape": [2]}}'), "not a safetensors header"),
    (lambda p: raw_safetensors(p, b'{"a": {"dtype": "BF16", "shape": ["x"]}}'), "not a safetensors header"),
    (lambda p: raw_safetensors(p, b'{"a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}'),
     "tensor a is stored as I64"),
], ids=["truncated", "huge header", "header cut short", "header not json", "header a list", "entry a list",
        "no dtype", "shape of strings", "integer tensor"])
def test_a_served_checkpoint_that_is_not_a_safetensors_file_is_a_clear_error(tmp_path, write, words):
    write(tmp_path / "model.safetensors")
    with pytest.raises(FileFormatError, match=words) as e:
        manifest(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(e.value)


# -- the weights directory --------------------------------------------------------------------------------------------

def test_the_weights_root_is_private(model_dir, tmp_path):
    store = WeightDir(tmp_path / "run" / "weights", manifest(model_dir))
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700


def test_a_weights_root_others_can_write_is_refused(model_dir, tmp_path):
    """Anyone who can write the root can swap a version's directory for weights of their own between its write and
    the server's read."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(UserError, match="writable by"):
        WeightDir(root, manifest(model_dir))


def test_cleanup_removes_stale_partials_and_never_follows_a_planted_link(model_dir, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    root = tmp_path / "weights"
    store = WeightDir(root, manifest(model_dir))
    (root / ".v3.partial").mkdir()  # a push killed mid-write, in an earlier run
    (root / ".v3.partial" / "model.safetensors").write_bytes(b"x" * 1000)
    (root / "v0").symlink_to(outside)
    store.write(5, push(5))
    assert (outside / "keep").read_text() == "mine"
    assert not (root / ".v3.partial").exists() and (root / "v5" / "model.safetensors").is_file()


def run_together(work, args) -> None:
    """`work(a)` for each of `args`, each on its own thread (they meet at a barrier inside `work`); all joined."""
    threads = [threading.Thread(target=work, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_threads_writing_one_version_write_it_once(model_dir, tmp_path):
    store = WeightDir(tmp_path / "w", manifest(model_dir))
    barrier = threading.Barrier(4)
    paths = []

    def write(seed):
        barrier.wait()
        paths.append(store.write(1, push(seed)))

    run_together(write, range(4))
    assert len(paths) == 4 and len(set(paths)) == 1 and sorted(os.listdir(store.root)) == ["v1"]


def test_threads_writing_different_versions_leave_the_newest(model_dir, tmp_path):
    store = WeightDir(tmp_path / "w", manifest(model_dir))
    barrier = threading.Barrier(4)
    outcomes = []

    def write(version):
        barrier.wait()
        try:
            outcomes.append(store.write(version, push(version)).name)
        except VersionConflict:
            outcomes.append("conflict")

    run_together(write, (1, 2, 3, 4))
    assert "v4" in outcomes and store.latest == 4 and sorted(os.listdir(store.root)) == ["v4"]


# -- the launcher -----------------------------------------------------------------------------------------------------

def fake_python(tmp_path: Path) -> Path:
    """A `vllm.python` that runs the fake with the launcher's command line."""
    script = tmp_path / "bin" / "python"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    script.chmod(0o755)
    return script


def test_a_python_that_is_a_directory_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(UsageError, match="not an executable python"):
        VLLMServers(VLLMConfig(python=tmp_path, max_model_len=64), tmp_path, tmp_path / "logs")


def test_managed_servers_are_private_isolated_and_die_whole_with_the_block(model_dir, tmp_path):
    config = VLLMConfig(python=fake_python(tmp_path), max_model_len=64, start_timeout=120)
    with managed_engine(config, model_dir, tmp_path / "run", TOKENIZER) as engine:
        socket = Path(engine.engine.base_url.removeprefix("unix:"))  # the managed server's VLLMEngine
        assert socket.is_socket() and stat.S_IMODE(socket.parent.stat().st_mode) == 0o700
        info = engine.engine.client.get("/fake/info").json()
        assert info["pythonpath"] == str(socket.parent / "python")  # nothing of the caller's PYTHONPATH
        assert os.listdir(info["pythonpath"]) == ["shipyard_vllm_worker.py"]
        assert info["worker"] == str(socket.parent / "python" / "shipyard_vllm_worker.py")
        assert info["pgid"] == info["pid"]  # its own process group: stopping it stops its children
        engine.update_weights(1, push(1))
        assert sample(engine).policy_version == 1
    assert wait_for(lambda: not alive(info["pid"]) and not alive(info["child"])), "a server process outlived its run"
    assert not socket.parent.exists()


def test_stop_is_idempotent_and_a_server_that_never_gets_healthy_fails_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "sick")
    servers = VLLMServers(VLLMConfig(python=fake_python(tmp_path), max_model_len=64, start_timeout=8), tmp_path,
                          tmp_path / "logs")
    with pytest.raises(ServerStartError, match="did not answer /health within 8 s"):
        servers.start()
    log = (tmp_path / "logs" / "vllm-0.log").read_text()
    child = int(log.split("child pid ")[1].split(":")[0])
    assert wait_for(lambda: not alive(child))
    servers.stop()
    servers.stop()
    assert servers.procs == []


def test_a_server_that_dies_while_starting_shows_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "exit")
    servers = VLLMServers(VLLMConfig(python=fake_python(tmp_path), max_model_len=64, start_timeout=120), tmp_path,
                          tmp_path / "logs")
    with pytest.raises(ServerStartError, match="(?s)exited with code 3.*CUDA out of memory"):
        servers.start()


def test_the_check_notes_a_vllm_python_that_is_a_directory(tmp_path):
    from shipyard.rl.config import load_config
    from shipyard.rl.plan import plan

    config = load_config(Path(__file__).parents[2] / "configs" / "vllm-cpu.toml", ["--vllm.python", str(tmp_path)])
    assert any("vLLM's venv" in line for line in plan(config).missing_here)

