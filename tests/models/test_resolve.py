import hashlib
from pathlib import Path

import pytest
import torch

from shipyard.errors import InputNotFound
from shipyard.models.bundled import BundledModel, gguf_path
from shipyard.models.dtype import default_dtype
from shipyard.models.local import LocalEngine
from shipyard.models.replay import ReplayEngine
from shipyard.models.resolve import TINY, ModelNotFound, load_hf, make_engine


def test_local_directory_round_trip(tmp_path):
    model, tok = load_hf(TINY, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    engine = make_engine(str(tmp_path / "m"))
    assert type(engine) is LocalEngine  # a local directory runs in-process
    loaded = engine.model.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded[k].float(), v.to(default_dtype("cpu")).float())  # bf16 where native


def test_errors_are_actionable(tmp_path):
    with pytest.raises(ModelNotFound, match="offline.*bundled model: qwen2.5-coder-0.5b"):
        load_hf("some-org/some-model-that-is-not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="without config.json"):
        load_hf(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFound, match="does not exist"):
        load_hf(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        load_hf(str(tmp_path / "weights.bin"))


def test_replay_engine_from_name(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('"hello"\n\n"world"\n')
    engine = make_engine(f"replay:{f}")
    assert isinstance(engine, ReplayEngine) and engine.messages == ["hello", "world"]
    f.write_text('"ok"\n{"role": "assistant"}\n')
    with pytest.raises(ValueError, match=r"r.jsonl:2: expected a JSON string"):
        make_engine(f"replay:{f}")
    f.write_text("not json\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1: not valid JSON"):
        make_engine(f"replay:{f}")
    with pytest.raises(InputNotFound, match=f"^replay file {tmp_path / 'none.jsonl'} does not exist$"):
        make_engine(f"replay:{tmp_path / 'none.jsonl'}")


def fake_distribution(site: Path, name: str, payload: bytes) -> None:
    """An installed distribution carrying one data file, as pip would lay it out."""
    pkg = name.replace("-", "_")
    (site / pkg / "data").mkdir(parents=True)
    (site / pkg / "data" / "part.bin").write_bytes(payload)
    info = site / f"{pkg}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"{pkg}/data/part.bin,,\n{pkg}-1.0.dist-info/METADATA,,\n")


def test_bundled_model_assembled_from_installed_packages(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_distribution(site, "shipyard-test-part1", b"GGUF-first-")
    fake_distribution(site, "shipyard-test-part2", b"second")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path / "home"))
    whole = b"GGUF-first-second"
    spec = BundledModel("test-model", "test", ("shipyard-test-part1==1.0", "shipyard-test-part2==1.0"),
                        "*/data/part.bin", hashlib.sha256(whole).hexdigest(), len(whole))
    path = gguf_path(spec)
    assert path.read_bytes() == whole and path.parent == tmp_path / "home" / "models" / "test-model"
    assert gguf_path(spec) == path  # cached
    wrong = BundledModel("test-model-2", "test", spec.packages, spec.data_glob, "0" * 64, len(whole))
    with pytest.raises(RuntimeError, match="refusing to load unverified weights"):
        gguf_path(wrong)
    assert not (tmp_path / "home" / "models" / "test-model-2" / "model.gguf").exists()


def test_bundled_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path))
    # pip looks only in an empty local folder: the failure path runs for real without touching the network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    spec = BundledModel("nope", "x", ("shipyard-no-such-package-xyz==0.0.1",), "*.bin", "", 1)
    with pytest.raises(RuntimeError, match="could not download shipyard-no-such-package-xyz==0.0.1"):
        gguf_path(spec)
