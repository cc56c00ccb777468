"""`ReplayEngine`: one-string-per-line scripts as before, and scripts keyed by task chosen by a request's session."""

from __future__ import annotations

import json
import threading

import pytest

from shipyard.models.engine import GenerationRequest, SamplingParams, VersionConflict
from shipyard.models.errors import ReplayExhausted
from shipyard.models.replay import ReplayEngine, load_replay, load_scripts, session_task

_CONVERSATIONS: dict[tuple[int, str | None], list[int]] = {}


def ask(engine: ReplayEngine, session: str | None, max_tokens: int = 1000) -> str:
    """The session's next turn, its prompt extending the last as an agent's does (the completion, then a result)."""
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=(engine.tokenizer.eos_token_id,))
    prompt = _CONVERSATIONS.setdefault((id(engine), session), [1, 2, 3])
    done = engine.generate([GenerationRequest(list(prompt), sampling, session=session)])[0]
    assert done.policy_version == -1 and set(done.logprobs) <= {0.0}  # never mistaken for on-policy data
    prompt += [*done.token_ids, 9]
    return done.text


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_old_files_replay_one_script_in_order_without_sessions(tmp_path):
    engine = ReplayEngine.from_file(write(tmp_path / "r.jsonl", ["one", "two"]))
    assert load_replay(tmp_path / "r.jsonl") == ["one", "two"] and engine.scripts == {}
    assert [ask(engine, None), ask(engine, None)] == ["one", "two"]
    with pytest.raises(ReplayExhausted, match="all 2 recorded messages were replayed"):
        ask(engine, None)


def test_each_session_replays_its_task_script_from_the_start(tmp_path):
    path = write(tmp_path / "r.jsonl", [{"task": "add-1", "messages": ["a1", "a2"]},
                                        {"task": "add-12", "messages": ["b1", "b2"]}, "default"])
    default, keyed = load_scripts(path)
    assert default == ["default"] and keyed == {"add-1": ["a1", "a2"], "add-12": ["b1", "b2"]}
    engine = ReplayEngine.from_file(path)
    # rollout ids "<group>/<index>[~attempt]", the group id "<task>@<n>" (the scheduler's); interleaved as in parallel
    assert ask(engine, "add-12@0/0") == "b1"
    assert ask(engine, "add-1@0/0") == "a1"
    assert ask(engine, "add-1@0/1") == "a1"
    assert ask(engine, "add-12@0/0") == "b2"
    assert ask(engine, "add-1@0/0") == "a2"
    assert ask(engine, "add-1@0/0~1") == "a1"  # a retried attempt is a new conversation
    assert ask(engine, "add-1@eval/0") == "a1"
    assert ask(engine, "other@0/0") == "default"  # no keyed script: the default script
    with pytest.raises(ReplayExhausted, match="all 2 recorded messages were replayed \\(task 'add-12'"):
        ask(engine, "add-12@0/0")


def test_session_task_never_takes_a_prefix_of_a_longer_task_id():
    keys = {"add-1", "add-12", "add"}
    assert session_task("add-12@3/0", keys) == "add-12"
    assert session_task("add-1@3/0", keys) == "add-1"
    assert session_task("add-1", keys) == "add-1"
    assert session_task("add-123@3/0", keys) is None  # 'add-1' followed by '2' is another task's id
    assert session_task("add.x@0/0", keys) is None and session_task("ad@0/0", keys) is None


def test_keyed_only_engine_refuses_an_unknown_task_with_its_name(tmp_path):
    engine = ReplayEngine.from_file(write(tmp_path / "r.jsonl", [{"task": "t1", "messages": ["x"]}]))
    with pytest.raises(ReplayExhausted, match="no script for session 'nope@0/0'.*keyed scripts are for t1"):
        ask(engine, "nope@0/0")
    with pytest.raises(ReplayExhausted, match="no script for session None"):
        ask(engine, None)
    with pytest.raises(ValueError, match="holds keyed scripts"):
        load_replay(tmp_path / "r.jsonl")


@pytest.mark.parametrize("lines, problem", [
    ([{"task": "t", "messages": ["x"], "extra": 1}], r"r.jsonl:1: expected a JSON string .*keys 'extra', 'messages'"),
    ([{"task": "", "messages": ["x"]}], r"r.jsonl:1: 'task' must be a non-empty string"),
    ([{"task": "t", "messages": []}], r"r.jsonl:1: 'messages' must be a non-empty list of strings"),
    ([{"task": "t", "messages": ["x", 3]}], r"r.jsonl:1: 'messages' must be a non-empty list of strings"),
    (["ok", {"task": "t", "messages": ["x"]}, {"task": "t", "messages": ["y"]}], r"r.jsonl:3: a second script"),
    (["ok", 5], r"r.jsonl:2: expected a JSON string"),
    ([], r"r.jsonl holds no messages"),
])
def test_malformed_keyed_files_name_the_line(tmp_path, lines, problem):
    path = write(tmp_path / "r.jsonl", lines)
    with pytest.raises(ValueError, match=problem):
        ReplayEngine.from_file(path)


def test_deeply_nested_line_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(ValueError, match="r.jsonl:1: not valid JSON"):
        ReplayEngine.from_file(path)


def test_sessions_from_many_threads_each_get_their_whole_script():
    engine = ReplayEngine(scripts={f"t{i}": [f"t{i}-{j}" for j in range(20)] for i in range(4)})
    got: dict[str, list[str]] = {}

    def run(session: str) -> None:
        got[session] = [ask(engine, session) for _ in range(20)]

    threads = [threading.Thread(target=run, args=(f"t{i}@0/{k}",)) for i in range(4) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 12
    assert all(texts == [f"{s.split('@')[0]}-{j}" for j in range(20)] for s, texts in got.items())


def test_longest_counts_tokens_of_the_longest_message():
    engine = ReplayEngine(["ab"], scripts={"t": ["abcdef", "a"]})
    assert engine.longest() == len(engine.tokenizer.encode("abcdef", add_special_tokens=False))
    with pytest.raises(ValueError, match="needs messages or keyed scripts"):
        ReplayEngine([])


def test_a_weight_push_changes_nothing_and_the_samples_stay_off_policy():
    """`shipyard train` with a replay sampler pushes weights after every step: accepted (versions must grow), and
    every sample still says version -1, so the staleness bound, not the push, decides how long it may be trained on."""
    engine = ReplayEngine(["hello"])
    engine.update_weights(1, {})
    engine.update_weights(2, {})
    with pytest.raises(VersionConflict, match="^weights of version 2 pushed after version 2$"):
        engine.update_weights(2, {})
    assert engine.policy_version == -1


def test_a_session_rerun_replays_its_script_from_the_start():
    """A periodic eval reruns the same rollout ids: a prompt that does not extend the session's last one is a new
    conversation, not the old one's next turn (before: the script ran out on the second eval)."""
    engine = ReplayEngine(["first", "second"])

    def turn(prompt):
        req = GenerationRequest(prompt, SamplingParams(max_tokens=50), session="t@eval/0")
        return engine.generate([req])[0].text

    assert turn([5, 6]) == "first"
    assert turn([5, 6, 7, 8]) == "second"  # the conversation goes on: its prompt extends the last
    assert turn([5, 6]) == "first"  # the same session again, from its first prompt: a new conversation
    assert turn([5, 6, 9]) == "second"
