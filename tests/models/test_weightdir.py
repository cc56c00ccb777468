"""The filesystem half of a push to vLLM (`shipyard.models.weightdir`): a push is checked whole against the served
checkpoint before a byte is written, because vLLM's reload loads what it is given (a partial file made a mix of two
versions; a wrong shape killed the engine: the module docstring)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from shipyard.models.engine import VersionConflict
from shipyard.models.lora import LoraConfig, adapter_tensors, attach
from shipyard.models.resolve import tiny_model
from shipyard.models.weightdir import PushRejected, WeightDir, checked, manifest


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tied tiny Qwen2 saved as the servers would load it (bf16), and its manifest."""
    model, _tok = tiny_model(seed=0)
    path = tmp_path_factory.mktemp("served")
    model.to(torch.bfloat16).save_pretrained(path)
    return path, manifest(path)


def state(seed: int = 1) -> dict[str, torch.Tensor]:
    return tiny_model(seed=seed)[0].state_dict()


def refused(store: WeightDir, tensors: dict[str, torch.Tensor], words: str) -> None:
    """The push is refused, saying `words`, and nothing was written."""
    with pytest.raises(PushRejected) as e:
        store.write(1, tensors)
    assert words in str(e.value)
    assert list(store.root.iterdir()) == [] and store.latest is None


def test_the_manifest_is_the_checkpoints_tensors_without_loading_them(served):
    path, spec = served
    stored = load_file(str(path / "model.safetensors"))
    assert {n: (tuple(t.shape), t.dtype) for n, t in stored.items()} == {n: (s.shape, s.dtype) for n, s in spec.items()}
    assert "lm_head.weight" not in spec  # tied: stored once, as the embedding


def test_a_tied_heads_second_name_is_dropped_and_every_tensor_cast_to_the_stored_dtype(served):
    _, spec = served
    weights = state()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    out = checked(weights, spec)
    assert set(out) == set(spec) and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in out.values())
    assert torch.equal(out["model.norm.weight"], weights["model.norm.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("break_it, words", [
    (lambda w: w.pop("model.norm.weight"), "1 of its tensors missing ['model.norm.weight']"),
    (lambda w: w.__setitem__("model.extra.weight", torch.zeros(3)), "1 unknown ['model.extra.weight']"),
    (lambda w: w.__setitem__("lm_head.weight", torch.zeros_like(w["lm_head.weight"])), "1 unknown ['lm_head.weight']"),
    (lambda w: w.__setitem__("model.norm.weight", torch.ones(7)), "shape (7,); the served checkpoint's is (64,)"),
    (lambda w: w["model.layers.0.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")), "non-finite"),
    (lambda w: w["model.layers.0.mlp.up_proj.weight"].__setitem__((0, 0), 3.4e38), "non-finite"),  # inf in bf16
    (lambda w: w.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int64)), "not a floating-point"),
])
def test_a_push_that_does_not_fit_is_refused_before_anything_is_written(served, tmp_path, break_it, words):
    _, spec = served
    weights = {k: v.clone() for k, v in state().items()}  # the head a separate tensor now: an unknown name if kept
    weights.pop("lm_head.weight")
    if "lm_head" in words:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    break_it(weights)
    refused(WeightDir(tmp_path / "w", spec), weights, words)


def test_versions_are_written_once_and_only_the_latest_is_kept(served, tmp_path):
    _, spec = served
    store = WeightDir(tmp_path / "w", spec)
    first = store.write(1, state(1))
    assert store.write(1, state(2)) == first  # a second engine's call for the same version: the same copy
    assert load_file(str(first / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    second = store.write(2, state(2))
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v2"] and second.name == "v2"
    assert store.last_bytes == (second / "model.safetensors").stat().st_size
    with pytest.raises(VersionConflict):
        store.write(1, state(1))


def test_a_directory_without_safetensors_has_no_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        manifest(tmp_path)


# LoRA: the adapter alone, checked against the base checkpoint it adapts --------------------------------------------
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def adapter(seed: int = 1) -> dict[str, torch.Tensor]:
    model = attach(tiny_model(seed=0)[0], LORA)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    return adapter_tensors(model.state_dict())


def test_an_adapter_is_written_as_peft_saves_one(served, tmp_path):
    import json

    path, spec = served
    store = WeightDir(tmp_path / "w", spec, LORA, base=str(path))
    tensors = adapter(1)
    target = store.write(1, tensors)
    files = load_file(str(target / "adapter_model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert files[f"base_model.model.{q}.lora_A.weight"].shape == (4, 64) and len(files) == len(tensors) == 2 * 7 * 2
    assert all(t.dtype == torch.bfloat16 for t in files.values())  # the served base's dtype
    assert torch.equal(files[f"base_model.model.{q}.lora_B.weight"], tensors[f"{q}.lora_B.default.weight"]
                       .to(torch.bfloat16))
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(path)
    assert store.last_bytes == sum(f.stat().st_size for f in target.iterdir())


@pytest.mark.parametrize("break_it, words", [
    (lambda a: a.clear(), "holds no tensor"),
    (lambda a: a.pop("model.layers.0.mlp.up_proj.lora_B.default.weight"), "only one of LoRA's two matrices"),
    (lambda a: a.__setitem__("model.layers.0.mlp.up_proj.lora_A.default.weight", torch.zeros(8, 64)),
     "rank 4 over the served layer's (128, 64) needs (4, 64)"),
    (lambda a: a.__setitem__("model.norm.lora_A.default.weight", torch.zeros(4, 64)), "not a LoRA matrix of a linear"),
    (lambda a: a.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64)), "not a LoRA matrix"),
    (lambda a: a.__setitem__("lm_head.lora_A.default.weight", torch.zeros(4, 64)), "not a LoRA matrix"),
    (lambda a: a["model.layers.1.mlp.down_proj.lora_B.default.weight"].__setitem__((0, 0), float("inf")),
     "non-finite"),
    (lambda a: a.__setitem__("model.layers.0.mlp.up_proj.lora_A.default.weight", torch.zeros(4, 64,
                                                                                            dtype=torch.int32)),
     "floating-point"),
])
def test_an_adapter_that_does_not_fit_is_refused_before_anything_is_written(served, tmp_path, break_it, words):
    _, spec = served
    tensors = {k: v.clone() for k, v in adapter().items()}
    break_it(tensors)
    refused(WeightDir(tmp_path / "w", spec, LORA), tensors, words)


def test_every_adapter_push_names_the_first_ones_tensors(served, tmp_path):
    _, spec = served
    store = WeightDir(tmp_path / "w", spec, LORA)
    store.write(1, adapter(1))
    fewer = {k: v for k, v in adapter(2).items() if "layers.1." not in k}
    with pytest.raises(PushRejected, match="names 14 tensors, not the 28 of the first push"):
        store.write(2, fewer)
    assert store.latest == 1 and store.write(2, adapter(2)).name == "v2"


def test_only_the_versions_it_wrote_are_removed(served, tmp_path):
    """A weights_dir someone chose may hold other things: only v<N> and .v<N>.partial directories are ever removed."""
    _, spec = served
    root = tmp_path / "w"
    root.mkdir(mode=0o700)
    for name in ("vicuna-7b", "v2-notes", ".v3.partial.keep"):
        (root / name).mkdir()
    (root / "v4.txt").write_text("mine")
    (root / ".v9.partial").mkdir()  # a killed run's half-written version: removed
    store = WeightDir(root, spec)
    store.write(1, state(1))
    store.write(2, state(2))
    assert sorted(os.listdir(root)) == [".v3.partial.keep", "v2", "v2-notes", "v4.txt", "vicuna-7b"]
