"""Weight sync: bf16 and MXFP8 payloads, to an engine in this process and to a real `shipyard serve` on
127.0.0.1; the sampler runs on bit-identical weights to the MXFP8 trainer."""


import httpx
import pytest
import torch
from safetensors.torch import load
from servers import free_port

from shipyard.models.local import LocalEngine
from shipyard.models.payload import decode, encode, metadata
from shipyard.models.resolve import tiny_model
from shipyard.models.server import ServeConfig, create_app
from shipyard.train.mx import MXLinear, convert_to_mxfp8, fake_quantize
from shipyard.train.sync import mx_weight_names, push_http, sync
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer


def test_bf16_payload_round_trip():
    model, _ = tiny_model()
    state = model.state_dict()
    payload = encode(state, 7)
    assert metadata(payload)["version"] == "7" and metadata(payload)["format"] == "bf16"
    version, tensors = decode(payload)
    assert version == 7 and set(tensors) == set(state)
    assert all(torch.equal(tensors[k], v.bfloat16()) for k, v in state.items())


def test_mxfp8_payload_is_smaller_and_dequantizes_like_the_trainer():
    model, _ = tiny_model()
    names = mx_weight_names(model)
    assert {"model.layers.0.mlp.up_proj.weight", "lm_head.weight", "model.embed_tokens.weight"} <= names
    state = model.state_dict()
    bf16, mx = encode(state, 1), encode(state, 1, "mxfp8", names)
    _, tensors = decode(mx)
    for name in names:
        assert torch.equal(tensors[name], fake_quantize(state[name]).bfloat16()), name
    quantized = sum({state[n].data_ptr(): state[n].numel() for n in names}.values())  # the tied head counts once
    data = {k: sum(t.numel() * t.element_size() for t in load(p).values()) for k, p in (("bf16", bf16), ("mx", mx))}
    assert data["bf16"] - data["mx"] == quantized * (2 - 33 / 32)  # 8.25 instead of 16 bits per quantized value
    assert len(mx) < len(bf16)
    assert metadata(mx)["aliases"] == '{"lm_head.weight": "model.embed_tokens.weight"}'
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="not a shipyard weight payload"):
        decode(b"garbage")
    with pytest.raises(ValueError, match="format"):
        encode(state, 1, "fp4")


def test_sampler_runs_bit_identical_weights_to_the_mxfp8_trainer():
    model, tok = tiny_model(seed=2)
    trainer = Trainer(model.float(), TrainConfig(optim=OptimConfig(lr=1e-3), mxfp8=True), pad_id=tok.pad_token_id)
    engine_model, _ = tiny_model(seed=9)
    convert_to_mxfp8(engine_model.float())
    engine = LocalEngine(engine_model, tok)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    state = trainer.full_state_dict()
    stats = sync(state, 1, fmt="mxfp8", mx_names=mx_weight_names(trainer.model), engine=engine)
    assert engine.policy_version == 1 and stats.bytes > 0 and stats.seconds > 0
    for name, m in trainer.model.named_modules():
        if isinstance(m, MXLinear):
            got = engine.model.get_submodule(name).weight
            assert torch.equal(fake_quantize(got), fake_quantize(state[f"{name}.weight"])), name
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = engine.model(input_ids=ids).logits
    assert float((want - got).abs().max()) < 0.05 * float(want.abs().max())  # bf16-rounded non-MX tensors only


TOKEN = "sync-test-token"  # the server's weights token


@pytest.fixture(scope="module")
def server(serve_app):
    model, tok = tiny_model()
    engine = LocalEngine(model.float(), tok)
    return engine, serve_app(create_app(engine, "tiny", ServeConfig(token=TOKEN))) + "/v1"


def test_push_over_http_updates_the_served_model(server):
    engine, url = server
    new, _ = tiny_model(seed=5)
    state = new.state_dict()
    reply = push_http(url, encode(state, 3, "mxfp8", mx_weight_names(new)), token=TOKEN)
    assert reply["version"] == 3 and reply["tensors"] == len(state)
    assert httpx.get(url.removesuffix("/v1") + "/health").json()["policy_version"] == 3
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(engine.model.state_dict()[name], fake_quantize(state[name]).bfloat16().float())
    stats = sync(state, 4, url=url, token=TOKEN)
    assert engine.policy_version == 4 and stats.format == "bf16"
    with pytest.raises(RuntimeError, match="400.*not a shipyard weight payload"):
        push_http(url, b"\x00" * 16, token=TOKEN)
    with pytest.raises(RuntimeError, match="400.*does not have"):
        push_http(url, encode({"nope.weight": torch.zeros(2, 2)}, 5), token=TOKEN)
    with pytest.raises(ConnectionError, match="shipyard serve"):
        push_http(f"http://127.0.0.1:{free_port()}/v1", encode(state, 6), timeout=5)
