"""`shipyard train-embedder`: fine-tune the search embedder on what agent sessions found useful in hindsight.

Cursor trains its embedder from agent sessions: the content an agent retrieved and then actually used is a positive
for what it was looking for. Here, from saved rollouts (a run's `trajectories/step-*.jsonl`, `shipyard eval
--rollouts` files) of tasks in a task set:

* **Sessions**: only rollouts that earned reward (reward > 0): their reading and editing led to a passing patch.
* **Queries**: each `codebase_search` query the agent made, and the task's statement (the request the session served:
  what makes the pairs usable from sessions that never called the tool).
* **Positives**: the chunks of the task's snapshot (chunked as the index chunks it) that the agent used *after* the
  query: the lines a `read_file` call showed when it asked for a range, or a whole file of at most
  `MAX_WHOLE_FILE_LINES` lines; the lines a `search_replace` changed (where its `old_string` is in the snapshot); the
  files `write_file` replaced.
* **Loss**: in-batch negatives (InfoNCE, van den Oord et al. 2018; as sentence-transformers'
  MultipleNegativesRankingLoss, Henderson et al. 2017): each query's positive against the other pairs' positives of
  the batch, cosine similarity × 20.
* **Evaluation** on held-out tasks (split by task, never seen in training): for each query, its task's snapshot
  indexed and searched as `codebase_search` does (semantic side); recall@10 = the share of queries with a positive
  in the top 10, for the base embedder and the tuned one.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shipyard.errors import FileFormatError, UsageError
from shipyard.harness.trajectory import Trajectory
from shipyard.search.chunks import Chunk, chunk_file
from shipyard.search.embed import Embedder, SentenceEmbedder
from shipyard.search.index import CodeIndex, embedding_text
from shipyard.search.tree import LocalTree

MAX_WHOLE_FILE_LINES = 400


@dataclass(frozen=True)
class Pair:
    task_id: str
    query: str
    positive: Chunk


def _overlapping(chunks: Sequence[Chunk], first: int, last: int) -> list[Chunk]:
    return [c for c in chunks if c.start <= last and c.end >= first]


def session_pairs(traj: Trajectory, task_id: str, snapshot: Path, embedder: Embedder) -> list[Pair]:
    """The (query, chunk used later) pairs of one rewarded session (see the module docstring)."""
    tree = LocalTree(snapshot)
    cache: dict[str, tuple[list[str], list[Chunk]]] = {}

    def chunks_of(path: str) -> tuple[list[str], list[Chunk]]:
        if path not in cache:
            try:
                data = tree.read(path)
            except ValueError:
                data = None
            text = data.decode("utf-8", "replace") if data is not None else ""
            chunks = chunk_file(path, text, embedder.max_tokens, embedder.count) if text else []
            cache[path] = (text.split("\n"), chunks)
        return cache[path]

    queries: list[tuple[int, str]] = [(-1, traj.task)]
    used: list[tuple[int, Chunk]] = []
    for turn in traj.turns:
        for call in turn.calls:
            args = call.arguments or {}
            if call.error is not None or not isinstance(args, dict):
                continue
            path = args.get("path")
            if call.name == "codebase_search" and isinstance(args.get("query"), str):
                queries.append((turn.index, args["query"]))
            elif not isinstance(path, str):
                continue
            elif call.name == "read_file":
                lines, chunks = chunks_of(path)
                offset, limit = args.get("offset", 1), args.get("limit")
                if limit is None and len(lines) > MAX_WHOLE_FILE_LINES:
                    continue  # a whole large file says little about which part mattered
                first = offset if isinstance(offset, int) and offset > 0 else 1
                last = first + limit - 1 if isinstance(limit, int) and limit > 0 else len(lines)
                used += [(turn.index, c) for c in _overlapping(chunks, first, last)]
            elif call.name == "search_replace" and isinstance(args.get("old_string"), str) and args["old_string"]:
                lines, chunks = chunks_of(path)
                at = "\n".join(lines).find(args["old_string"])
                if at >= 0:
                    first = "\n".join(lines)[:at].count("\n") + 1
                    used += [(turn.index, c) for c in _overlapping(chunks, first,
                                                                  first + args["old_string"].count("\n"))]
            elif call.name == "write_file":
                lines, chunks = chunks_of(path)
                if len(lines) <= MAX_WHOLE_FILE_LINES:
                    used += [(turn.index, c) for c in chunks]
    pairs = {(q, c) for asked, q in queries for when, c in used if when > asked}
    return [Pair(task_id, q, c) for q, c in sorted(pairs, key=lambda p: (p[0], p[1].path, p[1].start))]


def pairs_from_rollouts(files: Iterable[Path], tasks_dir: Path, embedder: Embedder) -> list[Pair]:
    """The pairs of every rewarded rollout in `files` (JSON lines of `Rollout.to_json`) whose task is in `tasks_dir`."""
    out: list[Pair] = []
    for file in files:
        with open(file) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    reward, task_id, traj = record.get("reward"), record["task_id"], record.get("trajectory")
                except (json.JSONDecodeError, KeyError, AttributeError) as e:
                    raise FileFormatError(f"{file} line {number} is not a saved rollout ({e}): give a run's "
                                          "trajectories/step-*.jsonl or a `shipyard eval --rollouts` file") from None
                snapshot = Path(tasks_dir) / task_id / "snapshot"
                if not reward or reward <= 0 or traj is None or not snapshot.is_dir():
                    continue
                out += session_pairs(Trajectory.from_dict(traj), task_id, snapshot, embedder)
    return out


def split_by_task(pairs: Sequence[Pair], held_out: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out): whole tasks held out, about `held_out` of them (at least one when there are two or more)."""
    tasks = sorted({p.task_id for p in pairs})
    random.Random(seed).shuffle(tasks)
    n = min(len(tasks) - 1, max(1, round(held_out * len(tasks)))) if len(tasks) > 1 else 0
    test = set(tasks[:n])
    return [p for p in pairs if p.task_id not in test], [p for p in pairs if p.task_id in test]


def recall_at(embedder: Embedder, pairs: Sequence[Pair], tasks_dir: Path, k: int = 10) -> float | None:
    """Share of the held-out queries with a positive among the `k` best semantic hits of their task's snapshot, as the
    index ranks them (a throwaway `CodeIndex` per task)."""
    by_query: dict[tuple[str, str], set[tuple[str, int]]] = {}
    for p in pairs:
        by_query.setdefault((p.task_id, p.query), set()).add((p.positive.path, p.positive.start))
    if not by_query:
        return None
    hits = []
    with tempfile.TemporaryDirectory(prefix="shipyard-recall-") as scratch:
        for task_id in sorted({t for t, _ in by_query}):
            index = CodeIndex.open(Path(scratch) / task_id, embedder)
            index.update(LocalTree(Path(tasks_dir) / task_id / "snapshot"))
            for (t, query), positives in by_query.items():
                if t == task_id:
                    top = {(h.chunk.path, h.chunk.start) for h in index.search(query, k, mode="semantic")}
                    hits.append(bool(top & positives))
            index.close()
    return sum(hits) / len(hits)


def batches(pairs: Sequence[Pair], batch_size: int, rng: random.Random) -> list[list[Pair]]:
    """Shuffled batches in which no query and no positive appears twice: with in-batch negatives, a second positive
    of the same query (or the same chunk for another query) would be scored as a negative."""
    pending = list(pairs)
    rng.shuffle(pending)
    out = []
    while pending:
        batch, queries, chunks, rest = [], set(), set(), []
        for p in pending:
            if len(batch) < batch_size and p.query not in queries and p.positive not in chunks:
                batch.append(p)
                queries.add(p.query)
                chunks.add(p.positive)
            else:
                rest.append(p)
        out.append(batch)
        pending = rest
    return out


def train(base: str, pairs: Sequence[Pair], out: Path, *, epochs: int = 2, batch_size: int = 16, lr: float = 2e-5,
          seed: int = 0, device: str = "cpu") -> SentenceEmbedder:
    """Fine-tune a fresh copy of the embedder `base` names on `pairs` with in-batch negatives; saved to `out` (a
    sentence-transformers model directory: `--embedder OUT`)."""
    import torch
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    if not pairs:
        raise UsageError("no training pairs: the rollouts hold no rewarded session of a task in the task set")
    torch.manual_seed(seed)
    model = SentenceEmbedder(base, device=device).model
    model.train()
    loss_fn = MultipleNegativesRankingLoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    for _ in range(epochs):
        for batch in batches(pairs, batch_size, rng):
            if len(batch) < 2:
                continue  # no negative to learn against
            texts = ([p.query for p in batch], [embedding_text(p.positive) for p in batch])
            features = [{k: v.to(model.device) if isinstance(v, torch.Tensor) else v
                         for k, v in model.preprocess(t).items()} for t in texts]
            loss = loss_fn(features, None)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save(str(out))
    return SentenceEmbedder(str(out), device=device)


def train_embedder(rollouts: Sequence[Path], tasks_dir: Path, out: Path, *, base: str = "minilm", epochs: int = 2,
                   batch_size: int = 16, lr: float = 2e-5, held_out: float = 0.25, seed: int = 0,
                   device: str = "cpu") -> dict:
    """Pairs from `rollouts`, split by task, the base embedder's held-out recall@10, training, the tuned one's; the
    report (also written to OUT/train-embedder.json)."""
    embedder = SentenceEmbedder(base, device=device)
    pairs = pairs_from_rollouts(rollouts, tasks_dir, embedder)
    train_pairs, test_pairs = split_by_task(pairs, held_out, seed)
    if not train_pairs or not test_pairs:
        raise UsageError(f"{len(pairs)} pairs from {len({p.task_id for p in pairs})} tasks: training and evaluation "
                         "each need rewarded sessions of at least one task (more rollouts, or `shipyard eval "
                         "--model replay:gold --rollouts FILE` for the task set's gold sessions)")
    before = recall_at(embedder, test_pairs, tasks_dir)
    tuned = train(base, train_pairs, out, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, device=device)
    after = recall_at(tuned, test_pairs, tasks_dir)
    report = {"base": base, "out": str(out), "pairs": len(pairs), "train_pairs": len(train_pairs),
              "test_pairs": len(test_pairs), "train_tasks": len({p.task_id for p in train_pairs}),
              "test_tasks": sorted({p.task_id for p in test_pairs}),
              "test_queries": len({(p.task_id, p.query) for p in test_pairs}), "epochs": epochs, "lr": lr,
              "recall@10_base": before, "recall@10_tuned": after}
    (out / "train-embedder.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
