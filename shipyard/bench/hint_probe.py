"""`shipyard bench hint_probe`: can a hint make the self-teacher write the `<tool_call>` tag? (issue 16)

Targeted feedback distils the policy *with* a hint into the policy without it (`shipyard.train.distill`), so a hint
can teach only what the hinted policy itself would write. This probe looks at the one token that matters for the
wire format — the first of an assistant turn — in three contexts: the student's (the task, no hint), with the
generic format hint, and with the exact-call hint (`untagged_exact`: the student's own untagged call shown back in
its tags). For each: the most likely first tokens, the probability of the tag token, and the greedy turn.

It also reads the model's output row of the tag token against those of the tokenizer's added tokens: a row equal
(cosine > 0.999) to those of tokens no training text contains (`<|box_start|>`, `<|quad_end|>`, …) is its
initialisation, never trained, and the model gives the token a probability near zero in every context. A hint —
or any on-policy method — cannot raise what the teacher will not write; such a model needs the tags spelled in
ordinary tokens, a format warm-up on tagged examples, or untagged calls accepted (`untagged_calls = "accept"`).
The first is measured last: first turns sampled with the prompt's tags (the system prompt's example, the tool
block's format) as the tag token, as the chat template has them, and spelled in ordinary tokens the model can write.

    shipyard bench hint_probe [-- --model qwen2.5-coder-0.5b --path pocketlib/stats.py]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from shipyard.bench._common import console, finish, table
from shipyard.harness.parse import CLOSE, OPEN, ToolCallParser
from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat, tag_token_twins
from shipyard.models.resolve import load_hf
from shipyard.rl.hints import hint
from shipyard.tasks.taskset import load_task

STATEMENT = ("The function `median` in pocketlib/stats.py has lost its body. Implement it so that the test suite "
             "passes; run the suite with `python -m pytest -q`.")


def has_tagged_call(parser: ToolCallParser, text: str) -> bool:
    return any(c.error is None and not c.untagged for c in parser.parse(text).calls)


def first_token(model, tok, ids: list[int], tag: int | None, greedy_tokens: int) -> dict:
    with torch.inference_mode():
        p = model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)
        out = model.generate(torch.tensor([ids]), max_new_tokens=greedy_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    top = p.topk(6)
    return {"p_tag": None if tag is None else float(p[tag]), "top": [(tok.decode([int(i)]), round(float(v), 4))
                                            for v, i in zip(top.values, top.indices, strict=True)],
            "greedy": tok.decode(out[0, len(ids):], skip_special_tokens=False)}


def tag_id(tok) -> int | None:
    """The tag's token id, None when the tokenizer spells it in pieces."""
    ids = tok.encode(OPEN, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def tag_row(model, tok) -> dict:
    """The tag's output row against the added tokens' rows: how many share it (an untrained initialisation)."""
    same = tag_token_twins(model, tok)
    if same is None:
        return {"tag_row_untrained": None, "note": f"{OPEN} is no single token of this tokenizer"}
    rows, tag = model.get_output_embeddings().weight.detach().float(), tag_id(tok)
    ordinary = rows[:min(tok.get_added_vocab().values(), default=rows.shape[0])].norm(dim=-1)
    return {"tag_row_norm": round(float(rows[tag].norm()), 4), "ordinary_row_norm_median": round(float(
        ordinary.median()), 4), "added_tokens_with_the_same_row": same, "tag_row_untrained": len(same) >= 2}


def sample_tags(model, tok, parser: ToolCallParser, statements: list[str], samples: int, max_new_tokens: int,
                seed: int) -> dict:
    """First turns sampled (temperature 1) with the prompt's tags as the tag token and spelled: how many hold the
    tag's text, and how many of those a tagged call that parses."""
    out = {}
    for form in ("token", "spelled"):
        tagged = valid = total = 0
        chat = ChatFormat(tok, default_tools(), tags=form)
        for n, statement in enumerate(statements, 1):
            ids = chat.prompt_ids(statement)
            console.print(f"[dim]· sampling {samples} first turns, tags as {form} ({n}/{len(statements)})[/]")
            torch.manual_seed(seed)
            with torch.inference_mode():
                turns = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=True,
                                       temperature=1.0, num_return_sequences=samples, pad_token_id=tok.eos_token_id)
            for turn in turns:
                words = tok.decode(turn[len(ids):], skip_special_tokens=True)
                total += 1
                tagged += OPEN in words
                valid += has_tagged_call(parser, words)
        out[form] = {"turns": total, "with_the_tag": tagged, "tagged_calls_that_parse": valid}
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="shipyard bench hint_probe")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tasks", type=Path, default=None, help="a task set: the statement of --task (default: built in)")
    p.add_argument("--task", default="t1-pocketlib.stats-median")
    p.add_argument("--path", default="pocketlib/stats.py", help="the file the student's untagged call reads")
    p.add_argument("--greedy-tokens", type=int, default=40)
    p.add_argument("--samples", type=int, default=4, help="first turns sampled per task, tags as token and spelled")
    p.add_argument("--sample-tokens", type=int, default=60)
    args = p.parse_args()
    if min(args.samples, args.sample_tokens, args.greedy_tokens) < 1:
        p.error("--samples, --sample-tokens and --greedy-tokens must be at least 1")
    statement = load_task(args.tasks, args.task)[0].statement if args.tasks else STATEMENT
    model, tok = load_hf(args.model, dtype=torch.float32)
    tools = default_tools()
    chat, parser = ChatFormat(tok, tools, tags="token"), ToolCallParser(tools)
    tag = tag_id(tok)
    header = list(chat.assistant_header_ids())
    prompt = chat.prompt_ids(statement)
    call = json.dumps({"name": "read_file", "arguments": {"path": args.path}})
    contexts = {"student (no hint)": None, "generic hint": hint("untagged"),
                "exact-call hint": hint("untagged_exact", call=f"{OPEN}\n{call}\n{CLOSE}")}
    seen = {}
    for label, text in contexts.items():
        ids = prompt if text is None else prompt[:-len(header)] + list(chat.hint_ids(text)) + header
        seen[label] = first_token(model, tok, ids, tag, args.greedy_tokens)
        seen[label]["greedy_tagged_call"] = has_tagged_call(parser, seen[label]["greedy"])
    table(f"{args.model}: the first token of the turn", ["context", f"p({OPEN})", "most likely first tokens",
                                                          "greedy turn", "a tagged call"],
          [[label, "-" if s["p_tag"] is None else f"{s['p_tag']:.2e}",
            ", ".join(f"{t!r} {v:.2f}" for t, v in s["top"][:4]), repr(s["greedy"][:70]), s["greedy_tagged_call"]]
           for label, s in seen.items()])
    row = tag_row(model, tok)
    if row["tag_row_untrained"] is None:
        console.print(row["note"])
    else:
        console.print(f"output row of {OPEN}: norm {row['tag_row_norm']} (ordinary tokens' median "
                      f"{row['ordinary_row_norm_median']}); the same row (cosine > 0.999): "
                      f"{', '.join(row['added_tokens_with_the_same_row']) or 'none'}"
                      f" → {'untrained' if row['tag_row_untrained'] else 'trained'}")
    statements = [statement]
    if args.tasks:
        statements = [load_task(args.tasks, d.name)[0].statement for d in sorted(args.tasks.iterdir())
                      if (d / "task.json").is_file()]
    forms = sample_tags(model, tok, parser, statements, args.samples, args.sample_tokens, seed=0)
    table(f"first turns sampled ({args.samples} per task, {len(statements)} tasks, temperature 1), the prompt's tags "
          f"as the tag token or spelled in ordinary tokens", ["tags in the prompt", "turns", f"with {OPEN}",
                                                              "a tagged call that parses"],
          [[form, f["turns"], f["with_the_tag"], f["tagged_calls_that_parse"]] for form, f in forms.items()])
    finish("hint_probe", {"model": args.model, "contexts": seen, **row, "sampled": forms})


if __name__ == "__main__":
    main()
