"""The example library is a real project: its own suite passes and is big enough for task synthesis."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pocketlib"


def test_example_suite_passes_with_at_least_40_tests(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                       cwd=EXAMPLE, capture_output=True, text=True, env={"PYTHONDONTWRITEBYTECODE": "1",
                                                                          "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    passed = int(re.search(r"(\d+) passed", r.stdout).group(1))
    assert passed >= 40
    assert len(list((EXAMPLE / "pocketlib").glob("*.py"))) >= 5


def test_example_is_lint_clean():
    from ruff.__main__ import find_ruff_bin

    r = subprocess.run([str(find_ruff_bin()), "check", "--no-cache", "."], cwd=EXAMPLE, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
