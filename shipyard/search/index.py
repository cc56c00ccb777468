"""A persisted, incrementally refreshed code-search index: embeddings for meaning, BM25 for words, fused by rank.

    files (FileSource) ──stamp/hash changed?──> chunk (tree-sitter) ──> embed (Embedder) ──> vectors-N.npy, chunks-N
                                                                    └──> BM25 documents (Tantivy segments, bm25/)

**Search.** A query is embedded and scored against every live chunk vector by dot product (exact; the vectors are
unit length, so this is cosine similarity) — a 20k × 384 matrix-vector product takes about a millisecond — or, above
`ann_threshold` live chunks, by a faiss HNSW graph (Malkov & Yashunin 2018, arXiv:1603.09320). The same query goes to
BM25 (Robertson & Zaragoza 2009) over the chunk's path, symbol and text, with identifiers split into their words
(`parseRomanNumeral` → parse, roman, numeral, parseromannumeral) so a natural-language query meets code. The two
rankings are fused by reciprocal rank (Cormack, Clarke & Büttcher 2009: score = Σ 1 / (60 + rank)), which needs no
calibration between a cosine and a BM25 score.

**Refresh in time proportional to the change.** Each file's stamp (size, mtime) and SHA-256 are kept; `update` re-reads
only files whose stamp moved, and re-chunks and re-embeds only those whose hash changed. Their old chunks are marked
dead (their vector rows stay until a compaction, skipped by every search) and the new ones appended; BM25 deletes the
file's documents by term and adds the new ones as a new Tantivy segment — Tantivy, like Lucene, keeps corpus
statistics across segments and merges them in the background, so no step rebuilds the whole corpus. A compaction
(rewrite the vectors without the dead rows) runs when a quarter of the rows are dead: amortised, constant per change.
Above `ann_threshold`, the HNSW graph grows by the new rows and masks the dead ones rather than being rebuilt.

**Crash safety.** A save writes its data files under new names (`chunks-N.jsonl`, `vectors-N.npy`) and then replaces
`index.json`, which names them, atomically: a crash anywhere leaves the previous save whole. BM25 commits carry a
generation number that the save records; an index opened with BM25 ahead of its saved chunks rebuilds BM25.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shipyard.search import Mode
from shipyard.search.chunks import Chunk, chunk_file
from shipyard.search.embed import Embedder
from shipyard.search.tree import FileSource, Stamp, indexable_name

SCHEMA = "shipyard.search/1"
MARKER = "\0generation"  # BM25's document holding its commit generation (no real path has a NUL byte)
RRF_K = 60


class IndexError_(ValueError):
    """An index directory that cannot be used as asked (another schema or embedder, or not an index)."""


@dataclass
class IndexConfig:
    max_tokens: int | None = None  # a chunk's token cap; None: what the embedder reads
    ann_threshold: int = 50_000  # live chunks above which the semantic side searches a faiss HNSW graph
    compact_fraction: float = 0.25  # dead vector rows that trigger a compaction
    candidates: int = 100  # how deep each side's ranking goes into the fusion


@dataclass
class Hit:
    chunk: Chunk
    score: float  # the fused (or the single side's) score, higher is better
    semantic_rank: int | None = None  # 1-based rank on each side, None when not in its top candidates
    bm25_rank: int | None = None


@dataclass
class UpdateReport:
    files_checked: int = 0
    files_changed: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    chunks_embedded: int = 0
    seconds: float = 0.0


def code_words(text: str) -> list[str]:
    """Lower-case words of code and prose: identifiers split at case changes, underscores and digits, and kept whole."""
    out = []
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+", text):
        parts = [p.lower() for p in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+", word)]
        out.extend(parts)
        if len(parts) > 1:
            out.append(word.lower().strip("_"))
    return out


def embedding_text(chunk: Chunk) -> str:
    return f"{chunk.path} {chunk.symbol or ''}\n{chunk.text}"


def ancestors(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


class CodeIndex:
    """See the module docstring. `CodeIndex.open(directory, embedder)`; `update(source)`; `search(query)`; `save()`."""

    def __init__(self, directory: Path, embedder: Embedder, config: IndexConfig | None = None):
        self.directory = Path(directory)
        self.embedder = embedder
        self.config = config or IndexConfig()
        self.max_tokens = min(self.config.max_tokens or embedder.max_tokens, embedder.max_tokens)
        self.chunks: list[Chunk | None] = []  # by row; None: dead
        self.vectors = np.zeros((0, embedder.dim), dtype=np.float32)
        self.rows = 0  # rows of `vectors` in use (the array grows by doubling)
        self.files: dict[str, dict[str, Any]] = {}  # path → {"size", "mtime_ns", "sha256", "rows"}
        self.generation = 0  # BM25 commits so far
        self.saves = 0  # saves so far: names the data files
        self.dead = 0  # rows whose chunk is gone (None), until a compaction
        self._bm25 = None
        self._writer = None
        self._ann = None

    # ---- persistence -------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path, embedder: Embedder, config: IndexConfig | None = None) -> CodeIndex:
        """The index in `directory`, or a new empty one there. `IndexError_` when it was made by another embedder."""
        index = cls(directory, embedder, config)
        meta_path = index.directory / "index.json"
        if not meta_path.exists():
            if index.directory.exists() and any(index.directory.iterdir()):
                raise IndexError_(f"{directory} is not a search index (no index.json) and not empty")
            return index
        meta = json.loads(meta_path.read_text())
        if meta.get("schema") != SCHEMA:
            raise IndexError_(f"{directory} holds index schema {meta.get('schema')!r}, not {SCHEMA!r}: rebuild it")
        if (meta["embedder"], meta["dim"], meta["max_tokens"]) != (embedder.name, embedder.dim, index.max_tokens):
            raise IndexError_(f"{directory} was built with embedder {meta['embedder']!r} (dim {meta['dim']}, "
                              f"{meta['max_tokens']} tokens per chunk), not {embedder.name!r}: rebuild it")
        data = meta.get("data", {})
        names = (data.get("chunks", ""), data.get("vectors", ""))
        if not (re.fullmatch(r"chunks-\d+\.jsonl", names[0]) and re.fullmatch(r"vectors-\d+\.npy", names[1])):
            raise IndexError_(f"{directory}/index.json does not name its data files: rebuild it")
        chunks_file, vectors_file = (index.directory / name for name in names)
        if not (chunks_file.is_file() and vectors_file.is_file()):
            raise IndexError_(f"{directory} is incomplete (its data files are missing): rebuild it")
        with open(chunks_file) as f:
            index.chunks = [Chunk(**json.loads(line)) if line.strip() != "null" else None for line in f]
        index.vectors = np.load(vectors_file)
        index.rows = len(index.chunks)
        index.dead = sum(c is None for c in index.chunks)
        if index.vectors.shape != (index.rows, embedder.dim):
            raise IndexError_(f"{directory} is inconsistent (vectors {index.vectors.shape}, {index.rows} chunks): "
                              "rebuild it")
        index.saves = meta["saves"]
        index.files = meta["files"]
        index.generation = meta["generation"]
        if index._bm25_generation() != index.generation:  # BM25 committed after the last save (a crash): redo it
            index._bm25_replace([], [(r, c) for r, c in enumerate(index.chunks) if c is not None], everything=True)
            index._save_meta()
        return index

    def save(self) -> None:
        """Compact if a quarter of the rows are dead, then write the chunks, vectors and file bookkeeping. The data
        files are named for this save and `index.json`, replaced last and atomically, names them: a crash at any point
        leaves the previous save whole (BM25, committed as it changes, carries the generation that belongs with it)."""
        if self.dead_fraction() > self.config.compact_fraction:
            self.compact()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.saves += 1
        chunks, vectors = f"chunks-{self.saves}.jsonl", f"vectors-{self.saves}.npy"
        with open(self.directory / chunks, "w") as f:
            for chunk in self.chunks:
                f.write(("null" if chunk is None else json.dumps(asdict(chunk))) + "\n")
        with open(self.directory / vectors, "wb") as f:
            np.save(f, self.vectors[:self.rows])
        self._save_meta({"chunks": chunks, "vectors": vectors})
        for old in [*self.directory.glob("chunks-*.jsonl"), *self.directory.glob("vectors-*.npy")]:
            if old.name not in (chunks, vectors):
                old.unlink(missing_ok=True)

    def _save_meta(self, data: dict[str, str] | None = None) -> None:
        path = self.directory / "index.json"
        if data is None:  # keep naming the saved data files
            data = json.loads(path.read_text())["data"]
        meta = {"schema": SCHEMA, "embedder": self.embedder.name, "dim": self.embedder.dim,
                "max_tokens": self.max_tokens, "generation": self.generation, "saves": self.saves, "data": data,
                "files": self.files}
        (self.directory / "index.json.new").write_text(json.dumps(meta))
        os.replace(self.directory / "index.json.new", path)  # last: it says the rest is whole

    def close(self) -> None:
        """Let go of BM25's writer (and its lock on the directory); searching still works."""
        self._writer = None

    # ---- BM25 (Tantivy) ----------------------------------------------------------------------------------------

    def _bm25_index(self):
        if self._bm25 is None:
            import tantivy

            schema = tantivy.SchemaBuilder()
            schema.add_text_field("words", stored=False, tokenizer_name="whitespace")
            schema.add_text_field("file", stored=False, tokenizer_name="raw")
            schema.add_text_field("dirs", stored=False, tokenizer_name="raw")
            schema.add_integer_field("row", stored=True, indexed=True, fast=True)
            path = self.directory / "bm25"
            path.mkdir(parents=True, exist_ok=True)
            self._bm25 = tantivy.Index(schema.build(), path=str(path))
        return self._bm25

    def _bm25_replace(self, removed_files: Iterable[str], added: Sequence[tuple[int, Chunk]], *,
                      everything: bool = False) -> None:
        """Delete the documents of `removed_files` (or all, with `everything`), add `added`, commit with the next
        generation number (a marker document: `open` rebuilds BM25 when it does not match the saved chunks')."""
        import tantivy

        index = self._bm25_index()
        if self._writer is None:
            self._writer = index.writer(heap_size=64 << 20, num_threads=1)
        writer = self._writer
        if everything:
            writer.delete_all_documents()
        for path in [*removed_files, MARKER]:
            writer.delete_documents_by_term("file", path)
        for row, chunk in added:
            words = " ".join(code_words(f"{chunk.path} {chunk.symbol or ''} {chunk.text}"))
            writer.add_document(tantivy.Document(words=words, file=chunk.path, dirs=ancestors(chunk.path) or [""],
                                                 row=row))
        self.generation += 1
        writer.add_document(tantivy.Document(words="", file=MARKER, dirs=MARKER, row=self.generation))
        writer.commit()
        index.reload()

    def _bm25_generation(self) -> int | None:
        import tantivy

        index = self._bm25_index()
        searcher = index.searcher()
        hits = searcher.search(tantivy.Query.term_query(index.schema, "file", MARKER), 1).hits
        return searcher.doc(hits[0][1])["row"][0] if hits else None

    def _bm25_search(self, query: str, n: int, dirs: Sequence[str] | None) -> list[tuple[int, float]]:
        import tantivy

        words = sorted(set(code_words(query)))
        if not words:
            return []
        index = self._bm25_index()
        occur = tantivy.Occur
        text = tantivy.Query.boolean_query([(occur.Should, tantivy.Query.term_query(index.schema, "words", w))
                                            for w in words])
        if dirs:
            where = tantivy.Query.boolean_query([(occur.Should, tantivy.Query.term_query(index.schema, "dirs", d))
                                                 for d in dirs])
            text = tantivy.Query.boolean_query([(occur.Must, text), (occur.Must, where)])
        searcher = index.searcher()
        return [(searcher.doc(address)["row"][0], score) for score, address in searcher.search(text, n).hits]

    # ---- refresh -----------------------------------------------------------------------------------------------

    def update(self, source: FileSource, paths: Iterable[str] | None = None,
               progress: Callable[[int, int], None] | None = None) -> UpdateReport:
        """Bring the index up to date with `source`: every file, or only `paths` (those known to have changed)."""
        start = time.monotonic()
        report = UpdateReport()
        if paths is None:
            listed = source.files()
            candidates = {p: s for p, s in listed.items() if self._stamp(p) != s}
            report.files_removed = sorted(set(self.files) - set(listed))
        else:
            listed = {}
            candidates = {p: None for p in paths if indexable_name(p)}
        report.files_checked = len(listed) or len(candidates)
        changed: dict[str, tuple[Stamp, bytes, str]] = {}  # path → (stamp, bytes, SHA-256)
        for path, stamp in candidates.items():
            data = source.read(path)
            if data is None:
                if path in self.files:
                    report.files_removed.append(path)
                continue
            digest = hashlib.sha256(data).hexdigest()
            if path in self.files and self.files[path]["sha256"] == digest:
                if stamp is not None:  # touched, not changed: remember the new stamp
                    self.files[path].update(size=stamp.size, mtime_ns=stamp.mtime_ns)
                continue
            changed[path] = (stamp or Stamp(len(data), 0), data, digest)
        report.files_changed = sorted(changed)
        new_chunks: list[Chunk] = []
        owners: list[str] = []
        for path, (_, data, _) in changed.items():
            file_chunks = chunk_file(path, data.decode("utf-8", "replace"), self.max_tokens, self.embedder.count)
            new_chunks += file_chunks
            owners += [path] * len(file_chunks)
        vectors = self._embed(new_chunks, progress)
        gone = [*report.files_removed, *(p for p in changed if p in self.files)]
        for path in gone:
            self._kill(path)
        added = self._append(new_chunks, vectors)
        for path, (stamp, _, digest) in changed.items():
            self.files[path] = {"size": stamp.size, "mtime_ns": stamp.mtime_ns, "sha256": digest, "rows": []}
        for (row, _), path in zip(added, owners, strict=True):
            self.files[path]["rows"].append(row)
        if gone or added:
            self._bm25_replace(gone, added)
        if self._ann is not None and added:  # the graph grows by the new rows; dead ones are masked at search
            self._ann.add_with_ids(vectors, np.array([row for row, _ in added], dtype=np.int64))
        report.chunks_embedded = len(new_chunks)
        report.seconds = time.monotonic() - start
        return report

    def _stamp(self, path: str) -> Stamp | None:
        entry = self.files.get(path)
        return Stamp(entry["size"], entry["mtime_ns"]) if entry else None

    def _embed(self, chunks: Sequence[Chunk], progress: Callable[[int, int], None] | None) -> np.ndarray:
        batch = 256
        parts = []
        for i in range(0, len(chunks), batch):
            parts.append(self.embedder.embed([embedding_text(c) for c in chunks[i:i + batch]]))
            if progress is not None:
                progress(min(i + batch, len(chunks)), len(chunks))
        return np.concatenate(parts) if parts else np.zeros((0, self.embedder.dim), dtype=np.float32)

    def _kill(self, path: str) -> None:
        for row in self.files.pop(path)["rows"]:
            self.chunks[row] = None
            self.dead += 1

    def _append(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> list[tuple[int, Chunk]]:
        need = self.rows + len(chunks)
        if need > len(self.vectors):  # grow by doubling: appending costs the new rows, amortised
            grown = np.zeros((max(need, 2 * len(self.vectors), 64), self.embedder.dim), dtype=np.float32)
            grown[:self.rows] = self.vectors[:self.rows]
            self.vectors = grown
        self.vectors[self.rows:need] = vectors
        added = list(enumerate(chunks, self.rows))
        self.chunks.extend(chunks)
        self.rows = need
        return added

    def dead_fraction(self) -> float:
        return self.dead / self.rows if self.rows else 0.0

    def compact(self) -> None:
        """Drop the dead rows (vectors, chunks) and renumber; BM25 is rebuilt from scratch with the new row numbers,
        so nothing of a removed file is left in any of the index's files."""
        live = [row for row, chunk in enumerate(self.chunks) if chunk is not None]
        renumber = {old: new for new, old in enumerate(live)}
        self.vectors = np.ascontiguousarray(self.vectors[live])
        self.chunks = [self.chunks[row] for row in live]
        self.dead = 0
        self.rows = len(live)
        for entry in self.files.values():
            entry["rows"] = [renumber[r] for r in entry["rows"]]
        self._writer = self._bm25 = None  # the writer's lock goes with it
        shutil.rmtree(self.directory / "bm25", ignore_errors=True)  # no deleted document survives in a segment
        self._bm25_replace([], list(enumerate(self.chunks)))
        self._ann = None

    # ---- search ------------------------------------------------------------------------------------------------

    def live_chunks(self) -> int:
        return self.rows - self.dead

    def _allowed(self, dirs: Sequence[str] | None) -> np.ndarray:
        if not dirs:  # every live row: the chunks no file owns any more are the dead ones
            return np.fromiter((c is not None for c in self.chunks), bool, self.rows) if self.dead else \
                np.ones(self.rows, dtype=bool)
        allowed = np.zeros(self.rows, dtype=bool)
        for path, entry in self.files.items():
            if any(path.startswith(d + "/") for d in dirs):
                allowed[entry["rows"]] = True
        return allowed

    def _semantic(self, query: str, n: int, dirs: Sequence[str] | None) -> list[tuple[int, float]]:
        if not self.rows:
            return []
        import torch

        q = self.embedder.embed([query])[0]
        if self.live_chunks() > self.config.ann_threshold:
            return self._ann_search(q, n, dirs)
        # With torch, not numpy's BLAS: the embedder's OpenMP threads are still spinning right after the query was
        # embedded, and a second thread pool contending with them made this product 10x slower (measured, 2 cores).
        with torch.inference_mode():
            scores = torch.mv(torch.from_numpy(self.vectors[:self.rows]), torch.from_numpy(q)).numpy()
        scores[~self._allowed(dirs)] = -np.inf
        n = min(n, int(np.isfinite(scores).sum()))
        top = np.argpartition(-scores, n - 1)[:n] if n else np.array([], dtype=int)
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(r), float(scores[r])) for r in top]

    def _ann_search(self, q: np.ndarray, n: int, dirs: Sequence[str] | None) -> list[tuple[int, float]]:
        import faiss

        if self._ann is None:
            live = np.array([r for r, c in enumerate(self.chunks) if c is not None], dtype=np.int64)
            self._ann = faiss.IndexIDMap2(faiss.IndexHNSWFlat(self.embedder.dim, 32, faiss.METRIC_INNER_PRODUCT))
            self._ann.add_with_ids(self.vectors[live], live)
        allowed = self._allowed(dirs)
        params = faiss.SearchParametersHNSW(sel=faiss.IDSelectorBitmap(np.packbits(allowed, bitorder="little")),
                                            efSearch=max(64, 2 * n))
        scores, rows = self._ann.search(q[None, :], n, params=params)
        return [(int(r), float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]

    def search(self, query: str, k: int = 10, *, mode: Mode = "hybrid", dirs: Sequence[str] | None = None) -> list[Hit]:
        """The `k` best chunks for `query` (optionally only under `dirs`, relative directories), best first."""
        dirs = [d.strip("/") for d in dirs or () if d.strip("/") not in ("", ".")] or None
        depth = max(k, self.config.candidates)
        semantic = self._semantic(query, depth, dirs) if mode != "bm25" else []
        lexical = self._bm25_search(query, depth, dirs) if mode != "semantic" else []
        if mode != "hybrid":
            ranked = semantic or lexical
            return [Hit(self.chunks[r], s, *((i, None) if mode == "semantic" else (None, i)))
                    for i, (r, s) in enumerate(ranked[:k], 1) if self.chunks[r] is not None]
        fused: dict[int, Hit] = {}
        for side, ranking in (("semantic_rank", semantic), ("bm25_rank", lexical)):
            for rank, (row, _) in enumerate(ranking, 1):
                if self.chunks[row] is None:
                    continue
                hit = fused.setdefault(row, Hit(self.chunks[row], 0.0))
                hit.score += 1.0 / (RRF_K + rank)
                setattr(hit, side, rank)
        return sorted(fused.values(), key=lambda h: (-h.score, h.chunk.path, h.chunk.start))[:k]
