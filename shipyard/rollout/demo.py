"""The demo's data: the bundled example repository, the bug `shipyard demo` plants in a copy of it, and the task.

Kept in the library, not in the CLI, so benchmarks (`shipyard.bench.parse_rate`, `shipyard.bench.harness`) and tests
use the very same task and bug as the demo without importing `shipyard.cli` (nothing does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The example repository ships in the package: in a source checkout shipyard/examples links to the top-level
# examples/ (resolved here, so a checkout names the real folder); an installed wheel holds a copy.
EXAMPLE_REPO = (Path(__file__).resolve().parent.parent / "examples" / "pocketlib").resolve()
DEMO_TASK = ("The test suite of this repository fails. Run the tests with `python -m pytest -q`, find the bug in "
             "the library code (not in the tests) and fix it with search_replace. Then run the tests again.")
DEMO_BUG = ("pocketlib/roman.py", "        while number >= value:", "        while number > value:")  # path, good, bad
DEMO_REPLAY = EXAMPLE_REPO.parent / "replays" / "demo_fix.jsonl"  # a scripted episode that fixes the bug


def copy_example(dest: Path | None = None) -> Path:
    """A fresh copy of the example repository (in a new temporary directory unless `dest` is given); its path."""
    if not EXAMPLE_REPO.is_dir():
        raise FileNotFoundError(f"the example repository is missing at {EXAMPLE_REPO}")
    dest = dest or Path(tempfile.mkdtemp(prefix="shipyard-demo-")) / "pocketlib"
    shutil.copytree(EXAMPLE_REPO, dest, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dest


def plant_bug(repo: Path) -> Path:
    """Plant the demo's bug in `repo` (a copy of the example); the path of the file it changed."""
    rel, good, bad = DEMO_BUG
    path = repo / rel
    path.write_text(path.read_text().replace(good, bad, 1))
    return path


def run_tests(repo: Path) -> tuple[bool, str]:
    """Run the example's test suite in `repo` (on the host, as the user would): (passed, pytest's last line)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo,
                            capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    lines = result.stdout.strip().splitlines()
    return result.returncode == 0, lines[-1] if lines else f"exit code {result.returncode}"
