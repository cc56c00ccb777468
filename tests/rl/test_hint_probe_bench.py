"""`shipyard bench hint_probe` end to end on the tiny random model (the pipeline, not the figures)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_probe_reports_each_context():
    proc = subprocess.run([sys.executable, "-m", "shipyard.bench.hint_probe", "--model", "random:tiny",
                           "--greedy-tokens", "4", "--samples", "2", "--sample-tokens", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["contexts"]) == {"student (no hint)", "generic hint", "exact-call hint"}
    for seen in result["contexts"].values():
        assert seen["p_tag"] is None and len(seen["top"]) == 6 and seen["greedy_tagged_call"] is False
    assert result["tag_row_untrained"] is None  # the byte tokenizer spells the tag in pieces
    assert {form: f["turns"] for form, f in result["sampled"].items()} == {"token": 2, "spelled": 2}
