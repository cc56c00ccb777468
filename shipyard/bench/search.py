"""`shipyard bench search`: how well and how fast code search finds code by meaning (issue 17).

Retrieval, on real code: the example repository and projects downloaded from PyPI now (default `click` and
`requests`: their wheels, unpacked). Every function or method with a docstring of at least five words is a candidate
query; `--queries` of them per corpus are drawn with a fixed seed. The query is the docstring's first paragraph
(reST/markdown markup stripped, at most 40 words); the docstrings of the queried functions are blanked out of the
corpus copy that is indexed (line numbers kept), so a query cannot simply match its own text. A result is relevant
when it is a chunk of the function's file that overlaps the function's lines. Four rankers over the same chunks:

    semantic   the embedder alone (cosine)            bm25     Tantivy BM25 over split identifiers
    hybrid     both, fused by reciprocal rank          grep     chunks ranked by how many of the query's words
                                                                (>= 3 letters, not stop words) they contain,
                                                                case-insensitive, as `grep -i -F` per word would see

Figures: recall@10 and MRR@10 per ranker (per corpus and over all queries); target hybrid >= BM25 + 10 points.

Scale, on a large real project (default `django`, ~30k chunks): the index build's chunks per second (chunking,
embedding, BM25), hybrid query latency p50/p95 over `--latency-queries` queries (target p50 <= 25 ms at >= 20k
chunks), and the refresh after an edit to one file — the same edit timed on the small corpus and on the large one:
proportional to the file, the two should be close, not ~100x apart.

    shipyard bench search [-- --projects click,requests --scale django --queries 100 --embedder minilm]
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.markup import escape
from rich.progress import Progress, TimeElapsedColumn

from shipyard.bench._common import console, finish, status, table
from shipyard.rollout.demo import EXAMPLE_REPO
from shipyard.search.embed import SentenceEmbedder
from shipyard.search.index import CodeIndex, code_words
from shipyard.search.tree import LocalTree

STOP = frozenset([
    "the", "a", "an", "and", "or", "of", "to", "in", "for", "on", "is", "are", "be", "by", "with", "this",
    "that", "it", "its", "as", "at", "from", "if", "not", "return", "returns", "given", "into", "when",
    "which", "will", "can", "may", "should", "all", "any", "was", "were", "has", "have",
])
MODES = ("semantic", "hybrid", "bm25", "grep")


def download(project: str, dest: Path) -> Path:
    """The project's newest wheel from PyPI, unpacked: its source as installed."""
    wheels = dest / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d",
                    str(wheels), project], check=True, timeout=600)
    (wheel,) = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(project.lower().replace("-", "_"))]
    out = dest / project
    shutil.rmtree(out, ignore_errors=True)
    shutil.unpack_archive(wheel, out, "zip")
    return out


def clean_docstring(text: str) -> str:
    first = re.split(r"\n\s*\n", text.strip())[0]
    first = re.sub(r":\w+:`([^`]*)`|``([^`]*)``|`([^`]*)`", lambda m: next(g for g in m.groups() if g), first)
    first = re.sub(r"[*_>#]+", " ", first)
    return " ".join(first.split()[:40])


def functions(path: Path, rel: str) -> list[dict]:
    """Functions and methods with a docstring: qualified name, lines, docstring node lines, query text."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if not isinstance(child, ast.ClassDef) and doc and len(doc.split()) >= 5:
                    node0 = child.body[0]
                    out.append({"path": rel, "name": name, "start": child.lineno, "end": child.end_lineno,
                                "doc": (node0.lineno, node0.end_lineno), "query": clean_docstring(doc)})
                walk(child, name + ".")

    walk(tree, "")
    return out


def retrieval_corpus(src: Path, work: Path, n_queries: int, seed: int) -> tuple[Path, list[dict]]:
    """A copy of `src` with the drawn queries' docstrings blanked (line numbers kept), and the queries."""
    corpus = work / src.name
    shutil.rmtree(corpus, ignore_errors=True)  # a kept run's copy: made again (its index sees the same bytes)
    shutil.copytree(src, corpus, ignore=shutil.ignore_patterns("__pycache__", ".venv", "*.dist-info"))
    found = [f for p in sorted(corpus.rglob("*.py")) for f in functions(p, str(p.relative_to(corpus)))]
    drawn = random.Random(seed).sample(found, min(n_queries, len(found)))
    by_file: dict[str, list[dict]] = {}
    for f in drawn:
        by_file.setdefault(f["path"], []).append(f)
    for rel, fs in by_file.items():
        lines = (corpus / rel).read_text(errors="replace").split("\n")
        for f in fs:
            a, b = f["doc"]
            indent = re.match(r"\s*", lines[a - 1]).group(0)
            lines[a - 1:b] = [f"{indent}pass"] + [""] * (b - a)
        (corpus / rel).write_text("\n".join(lines))
    return corpus, drawn


def grep_rank(index: CodeIndex, query: str, k: int) -> list[int]:
    words = [w for w in dict.fromkeys(code_words(query)) if len(w) >= 3 and w not in STOP]
    scored = []
    for row, chunk in enumerate(index.chunks):
        if chunk is None:
            continue
        text = chunk.text.lower()
        hits = sum(w in text for w in words)
        if hits:
            scored.append((-hits, row))
    return [row for _, row in sorted(scored)[:k]]


def evaluate(index: CodeIndex, queries: list[dict], k: int = 10) -> dict[str, dict[str, float]]:
    out = {}
    for mode in MODES:
        recall, rr = [], []
        for q in queries:
            if mode == "grep":
                chunks = [index.chunks[r] for r in grep_rank(index, q["query"], k)]
            else:
                chunks = [h.chunk for h in index.search(q["query"], k, mode=mode)]
            ranks = [i for i, c in enumerate(chunks, 1)
                     if c.path == q["path"] and c.start <= q["end"] and c.end >= q["start"]]
            recall.append(1.0 if ranks else 0.0)
            rr.append(1.0 / ranks[0] if ranks else 0.0)
        out[mode] = {"recall@10": float(np.mean(recall)), "mrr": float(np.mean(rr)), "n": len(queries)}
    return out


def build(corpus: Path, directory: Path, embedder) -> tuple[CodeIndex, float | None]:
    """The corpus's index (a kept one brought up to date) and its build rate in chunks/s (None when reused)."""
    index = CodeIndex.open(directory, embedder)
    start = time.perf_counter()
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console) as bar:
        job = bar.add_task(escape(f"embedding {corpus.name}"), total=None)
        report = index.update(LocalTree(corpus), progress=lambda done, total: bar.update(job, completed=done,
                                                                                           total=total))
    seconds = time.perf_counter() - start
    index.save()
    status(f"{corpus.name}: {index.live_chunks()} chunks, {report.chunks_embedded} embedded now, from "
           f"{len(report.files_changed)} files in {seconds:.1f} s")
    return index, report.chunks_embedded / seconds if report.chunks_embedded >= index.live_chunks() else None


def edit_refresh(index: CodeIndex, corpus: Path, rel: str) -> dict[str, float]:
    """Append a function to one file and time the refresh: by scanning the tree (stamps) and by naming the file."""
    path = corpus / rel
    path.write_text(path.read_text() + "\n\ndef added_by_the_benchmark(x):\n    return x + 1\n")
    start = time.perf_counter()
    scanned = index.update(LocalTree(corpus))
    scan = time.perf_counter() - start
    path.write_text(path.read_text() + "\n\ndef added_again(x):\n    return x - 1\n")
    start = time.perf_counter()
    named = index.update(LocalTree(corpus), paths=[rel])
    known = time.perf_counter() - start
    assert scanned.files_changed == [rel] and named.files_changed == [rel], (scanned, named)
    return {"scan_ms": scan * 1000, "named_ms": known * 1000, "chunks_embedded": named.chunks_embedded}


def main() -> None:
    p = argparse.ArgumentParser(prog="shipyard bench search")
    p.add_argument("--projects", default="click,requests", help="PyPI projects for the retrieval set")
    p.add_argument("--scale", default="django", help="a PyPI project of >= 20k chunks for latency ('' to skip)")
    p.add_argument("--queries", type=int, default=100, help="queries drawn per corpus")
    p.add_argument("--latency-queries", type=int, default=100)
    p.add_argument("--embedder", default="minilm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, default=None, help="keep the corpora and indexes here (a second run with the "
                   "same directory reuses the indexes: only what changed is embedded again)")
    args = p.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="shipyard-bench-search-"))
    work.mkdir(parents=True, exist_ok=True)
    embedder = SentenceEmbedder(args.embedder)
    sources = [EXAMPLE_REPO] + [download(name, work / "pypi") for name in
                                                   filter(None, args.projects.split(","))]
    per_corpus, all_queries, small = {}, [], None
    for src in sources:
        corpus, queries = retrieval_corpus(src, work / "corpora", args.queries, args.seed)
        index, _ = build(corpus, work / "indexes" / src.name, embedder)
        per_corpus[src.name] = evaluate(index, queries)
        all_queries += [(src.name, q) for q in queries]
        if small is None and queries:  # the first corpus: its one-file refresh is compared with the large one's
            small = (index, corpus, queries[0]["path"])
    rows = []
    overall = {}
    for mode in MODES:
        n = sum(r[mode]["n"] for r in per_corpus.values())
        overall[mode] = {m: sum(r[mode][m] * r[mode]["n"] for r in per_corpus.values()) / max(n, 1)
                         for m in ("recall@10", "mrr")}
        rows.append([mode, *(f"{per_corpus[c][mode]['recall@10']:.3f} / {per_corpus[c][mode]['mrr']:.3f}"
                             for c in per_corpus), f"{overall[mode]['recall@10']:.3f} / {overall[mode]['mrr']:.3f}"])
    table(f"retrieval: recall@10 / MRR@10 ({len(all_queries)} docstring queries, docstrings removed)",
          ["ranker", *(f"{c} ({per_corpus[c]['hybrid']['n']})" for c in per_corpus), "all"], rows)
    gain = overall["hybrid"]["recall@10"] - overall["bm25"]["recall@10"]
    figures = {"queries": len(all_queries), "corpora": list(per_corpus),
               **{f"{m}_recall@10": round(overall[m]["recall@10"], 4) for m in MODES},
               **{f"{m}_mrr": round(overall[m]["mrr"], 4) for m in MODES},
               "hybrid_minus_bm25_recall@10": round(gain, 4), "target_gain": 0.10, "gain_met": gain >= 0.10,
               "per_corpus": per_corpus}
    small_refresh = edit_refresh(small[0], small[1], small[2]) if small else None
    if args.scale:
        big_src = download(args.scale, work / "pypi")
        index, rate = build(big_src, work / "indexes" / "scale", embedder)
        chunks = index.live_chunks()
        queries = [q["query"] for _, q in all_queries][:args.latency_queries] or ["parse the configuration"]
        index.search(queries[0], 10)  # warm
        times = []
        for q in queries:
            start = time.perf_counter()
            index.search(q, 10)
            times.append((time.perf_counter() - start) * 1000)
        target = next(str(p.relative_to(big_src)) for p in sorted(big_src.rglob("*.py")) if p.stat().st_size > 2000)
        big_refresh = edit_refresh(index, big_src, target)
        p50, p95 = float(np.percentile(times, 50)), float(np.percentile(times, 95))
        table(f"scale: {args.scale}", ["chunks", "build chunks/s", "query p50 ms", "query p95 ms"],
              [[chunks, "reused" if rate is None else f"{rate:.1f}", f"{p50:.1f}", f"{p95:.1f}"]])
        table("refresh after an edit to one file (ms)", ["corpus", "chunks", "scan the tree", "name the file",
                                                         "chunks re-embedded"],
              [[small[1].name, small[0].live_chunks(), f"{small_refresh['scan_ms']:.0f}",
                f"{small_refresh['named_ms']:.0f}", small_refresh["chunks_embedded"]],
               [args.scale, chunks, f"{big_refresh['scan_ms']:.0f}", f"{big_refresh['named_ms']:.0f}",
                big_refresh["chunks_embedded"]]])
        figures |= {"scale_project": args.scale, "scale_chunks": chunks,
                    "build_chunks_per_s": None if rate is None else round(rate, 2),
                    "query_p50_ms": round(p50, 2), "query_p95_ms": round(p95, 2), "target_p50_ms": 25,
                    "latency_met": p50 <= 25 and chunks >= 20_000,
                    "refresh_small": small_refresh, "refresh_large": big_refresh}
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    finish("search", figures)


if __name__ == "__main__":
    main()
