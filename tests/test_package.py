"""What an ordinary (non-editable) install gets: the wheel carries the benchmarks and the example repository they and
the demo use, and `shipyard bench` finds benchmarks as modules of the package, never as files beside it. CI installs
that wheel into a throwaway venv and runs `shipyard bench harness` from another directory (.ci/run)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from typer.testing import CliRunner

from shipyard.cli import app

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "shipyard" / "bench"


def test_the_wheel_carries_the_benchmarks_and_the_example_repository(tmp_path):
    src = tmp_path / "src"  # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("shipyard", "examples"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("shipyard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    benchmarks = {f"shipyard/bench/{p.name}" for p in BENCH.glob("*.py")}
    assert "shipyard/bench/_common.py" in benchmarks and "shipyard/bench/harness.py" in benchmarks
    assert benchmarks <= names, sorted(benchmarks - names)
    example = {f"shipyard/examples/{p.relative_to(ROOT / 'examples')}" for p in (ROOT / "examples").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert "shipyard/examples/pocketlib/pocketlib/roman.py" in example
    assert "shipyard/examples/replays/demo_fix.jsonl" in example
    assert example <= names, sorted(example - names)
    assert not [n for n in names if n.endswith(".pyc")]


def test_an_unknown_benchmark_lists_the_modules_of_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "nope"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    shipped = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
    assert f"no benchmark 'nope'; available: {', '.join(shipped)}" in " ".join(r.output.split())
