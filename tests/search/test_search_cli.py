"""`shipyard search`: an index per repository in $SHIPYARD_HOME (private), refreshed on each use; clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tiny_embedder import tiny_embedder_dir


def shipyard(*args, home):
    env = {**os.environ, "SHIPYARD_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "shipyard.cli", "search", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_search_indexes_once_then_refreshes_what_changed(repo, tmp_path):
    model = str(tiny_embedder_dir(tmp_path / "embedder"))
    home = tmp_path / "home"
    first = shipyard("percentile", "--repo", str(repo), "--embedder", model, "--mode", "bm25", "--json", home=home)
    assert first.returncode == 0, first.stderr
    results = json.loads(first.stdout)["results"]
    assert any(r["symbol"] == "percentile" for r in results)
    assert "15 files (re)indexed" in first.stderr
    (index_root,) = (home / "search").iterdir()
    assert oct((home / "search").stat().st_mode & 0o777) == "0o700"
    stats = repo / "pocketlib" / "stats.py"
    stats.write_text(stats.read_text() + "\ndef geometric_mean(values):\n    return 0\n")
    again = shipyard("geometric_mean", "--repo", str(repo), "--embedder", model, "--dir", "pocketlib", home=home)
    assert again.returncode == 0, again.stderr
    assert "1 files (re)indexed" in again.stderr and "pocketlib/stats.py" in again.stdout
    assert [p.name for p in (home / "search").iterdir()] == [index_root.name]


def test_bad_input_is_one_line(repo, tmp_path):
    home = tmp_path / "home"
    for args, message in ((["q", "--repo", str(tmp_path / "missing")], "is not a directory"),
                          (["q", "--repo", str(repo), "--embedder", str(tmp_path / "nope")], "not a model directory"),
                          (["q", "--repo", str(repo), "--mode", "fuzzy"], "Invalid value for '--mode'")):
        r = shipyard(*args, home=home)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
