"""An optional critic: any `Engine` reads an episode and may add a hint the detectors cannot write.

The detectors (`shipyard.rl.hints`) see what the harness recorded; a critic model can judge what a rule cannot — a
plan that reads the wrong file, an edit that misses the point of the failing test. It gets a compact transcript (the
task statement, each turn's text cut to `turn_chars`, each call with its outcome) and answers with at most
`max_hints` lines `TURN <n>: <hint>`; anything else in its answer is ignored. Its hints go through the same gate as the
detectors' and a stricter one, because the critic writes free text: a hint that names an identifier of the deleted
code anywhere in it (`TaskFacts.leaks`), quotes code (a backtick, three or more consecutive symbol characters), is
longer than `max_chars` or points at a turn without sampled tokens is dropped. Its findings are of kind `critic`.

The critic is called once per rollout, greedily; its engine is separate from the policy's (a larger model, or a
server through `OpenAIEngine`), so it costs inference but never changes the policy's weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from shipyard.harness.trajectory import Trajectory
from shipyard.harness.wire import ChatFormat, Tags
from shipyard.models.engine import Engine, GenerationRequest, SamplingParams
from shipyard.rl.hints import Finding, TaskFacts

CRITIC_PROMPT = """You review the episode of a coding agent that had to solve a task with tools. Find the turns where \
the agent's behaviour should have been different and, for each, write one short hint that describes the better \
behaviour (how to work), never the solution: no code, no names from the code to write. Answer with at most {n} \
lines, each exactly `TURN <number>: <hint>`, or `NONE`."""
ANSWER = re.compile(r"^\s*TURN\s+(\d+)\s*:\s*(.+?)\s*$", re.MULTILINE)
CODE = re.compile(r"`|[^\w\s,.;:!?'\"()\-]{3,}")


@dataclass
class Critic:
    engine: Engine
    max_hints: int = 2
    max_new_tokens: int = 200
    turn_chars: int = 600
    max_chars: int = 300
    tags: Tags = "token"  # how the transcript's call tags reach the critic (its model's `wire_defaults`)

    def __post_init__(self) -> None:
        self.chat = ChatFormat(self.engine.tokenizer, [], CRITIC_PROMPT.format(n=self.max_hints), self.tags)

    def transcript(self, traj: Trajectory, statement: str) -> str:
        parts = [f"TASK:\n{statement.strip()}\n"]
        for turn in traj.turns:
            text = turn.text if len(turn.text) <= self.turn_chars else turn.text[:self.turn_chars] + " …"
            calls = "; ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)[:160]}) -> "
                              f"{c.error_kind or 'ok'}" for c in turn.calls) or "no call (final answer)"
            parts.append(f"TURN {turn.index}:\n{text}\nCALLS: {calls}\n")
        parts.append(f"The episode ended: {traj.stop_reason}.")
        return "\n".join(parts)

    def review(self, traj: Trajectory, statement: str, facts: TaskFacts) -> tuple[list[Finding], int]:
        """(the critic's findings that pass the gate, how many it wrote that did not)."""
        request = GenerationRequest(self.chat.prompt_ids(self.transcript(traj, statement)),
                                    SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0,
                                                   stop_token_ids=self.chat.stop_token_ids))
        [completion] = self.engine.generate([request])
        answer = completion.text
        if completion.finish_reason != "stop":  # cut off: its last line may be half a hint
            answer = answer[:answer.rfind("\n") + 1]
        out, rejected = [], 0
        for number, text in ANSWER.findall(answer)[:self.max_hints]:
            turn = int(number)
            usable = 0 <= turn < len(traj.turns) and bool(traj.turns[turn].completion_ids)
            if not usable or len(text) > self.max_chars or CODE.search(text) or facts.leaks(text):
                rejected += 1
                continue
            out.append(Finding(turn, "critic", text, f"critic {self.engine.name}"))
        return out, rejected
