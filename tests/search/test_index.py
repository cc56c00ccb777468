"""The search index: build, hybrid search, refresh of changed files only, persistence, crash consistency."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from shipyard.search.index import CodeIndex, IndexConfig, IndexError_, code_words
from shipyard.search.tree import LocalTree


class Counting:
    """An `Embedder` that counts the texts it embeds (over a real one)."""

    def __init__(self, inner):
        self.inner, self.texts = inner, 0
        self.name, self.dim, self.max_tokens = inner.name, inner.dim, inner.max_tokens

    def embed(self, texts):
        self.texts += len(texts)
        return self.inner.embed(texts)

    def count(self, lines):
        return self.inner.count(lines)


def build(repo, directory, embedder, **config):
    index = CodeIndex.open(directory, embedder, IndexConfig(**config))
    index.update(LocalTree(repo))
    return index


def locations(hits):
    return [h.chunk.location for h in hits]


def test_code_words_split_identifiers_for_prose_queries():
    assert code_words("parseRomanNumeral(x_value) HTTPServer 42") == [
        "parse", "roman", "numeral", "parseromannumeral", "x", "value", "x_value", "http", "server", "httpserver", "42"]


def test_minilm_finds_code_by_meaning(repo, tmp_path, minilm):
    index = build(repo, tmp_path / "ix", minilm)
    for mode in ("semantic", "hybrid"):
        hits = index.search("convert an integer into roman numerals", 3, mode=mode)
        assert hits[0].chunk.symbol == "to_roman", locations(hits)
    assert index.search("arithmetic average of a list of numbers", 1, mode="semantic")[0].chunk.symbol == "mean"


def test_bm25_and_hybrid_rank_by_words_and_filter_by_directory(repo, tmp_path, tiny_embedder):
    index = build(repo, tmp_path / "ix", tiny_embedder)
    hits = index.search("percentile", 3, mode="bm25")
    assert "percentile" in [h.chunk.symbol for h in hits]
    assert [h.bm25_rank for h in hits] == [1, 2, 3] and {h.semantic_rank for h in hits} == {None}
    assert hits[0].score >= hits[1].score >= hits[2].score
    hybrid = index.search("percentile", 5)
    assert "percentile" in [h.chunk.symbol for h in hybrid] and all(h.score > 0 for h in hybrid)
    for mode in ("semantic", "bm25", "hybrid"):
        hits = index.search("mean", 20, mode=mode, dirs=["tests/"])
        assert hits and all(h.chunk.path.startswith("tests/") for h in hits), mode
        assert index.search("mean", 5, mode=mode, dirs=["no/such/dir"]) == []
    assert index.search("", 5) == [] or all(h.semantic_rank for h in index.search("", 5))


def test_an_edit_re_embeds_only_the_changed_file(repo, tmp_path, tiny_embedder):
    embedder = Counting(tiny_embedder)
    index = build(repo, tmp_path / "ix", embedder)
    total = embedder.texts
    assert total == index.live_chunks() > 50
    stats = repo / "pocketlib" / "stats.py"
    stats.write_text(stats.read_text() + "\n\ndef harmonic_mean(xs):\n    return len(xs) / sum(1 / x for x in xs)\n")
    (repo / "pocketlib" / "roman.py").touch()  # a new stamp, the same bytes: read and hashed, not embedded
    report = index.update(LocalTree(repo))
    per_file = len([c for c in index.chunks if c is not None and c.path == "pocketlib/stats.py"])
    assert report.files_changed == ["pocketlib/stats.py"] and report.chunks_embedded == per_file
    assert embedder.texts == total + per_file
    assert index.search("harmonic_mean", 1, mode="bm25")[0].chunk.symbol == "harmonic_mean"
    assert index.update(LocalTree(repo)).files_changed == []  # nothing moved: nothing read
    (repo / "pocketlib" / "roman.py").unlink()
    report = index.update(LocalTree(repo))
    assert report.files_removed == ["pocketlib/roman.py"] and report.chunks_embedded == 0
    assert all(h.chunk.path != "pocketlib/roman.py" for m in ("semantic", "bm25", "hybrid")
               for h in index.search("roman numeral", 50, mode=m))
    report = index.update(LocalTree(repo), paths=["pocketlib/stats.py", "pocketlib/strings.py"])  # known changes
    assert report.files_changed == [] and report.chunks_embedded == 0


def test_saved_index_reopens_and_refuses_another_embedder(repo, tmp_path, tiny_embedder, minilm):
    index = build(repo, tmp_path / "ix", tiny_embedder)
    before = [(h.chunk, round(h.score, 6)) for h in index.search("stack push pop", 10)]
    index.save()
    index.close()
    again = CodeIndex.open(tmp_path / "ix", tiny_embedder)
    assert [(h.chunk, round(h.score, 6)) for h in again.search("stack push pop", 10)] == before
    assert again.update(LocalTree(repo)).files_changed == []
    with pytest.raises(IndexError_, match="built with embedder"):
        CodeIndex.open(tmp_path / "ix", minilm)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    with pytest.raises(IndexError_, match="not a search index"):
        CodeIndex.open(tmp_path / "other", tiny_embedder)


def test_a_crash_between_commit_and_save_leaves_a_consistent_index(repo, tmp_path, tiny_embedder):
    index = build(repo, tmp_path / "ix", tiny_embedder)
    index.save()
    stats = repo / "pocketlib" / "stats.py"
    stats.write_text(stats.read_text().replace("def mean(", "def arithmetic_mean_unsaved("))
    index.update(LocalTree(repo))  # BM25 committed, chunks not saved: then the process dies
    assert [h.chunk.path for h in index.search("arithmetic_mean_unsaved", 1, mode="bm25")] == ["pocketlib/stats.py"]
    index.close()
    del index
    again = CodeIndex.open(tmp_path / "ix", tiny_embedder)
    hits = again.search("arithmetic_mean_unsaved", 50, mode="bm25")
    assert hits and all("arithmetic_mean_unsaved" not in h.chunk.text for h in hits)
    assert all({"arithmetic", "mean", "unsaved"} & set(code_words(f"{h.chunk.path} {h.chunk.symbol} {h.chunk.text}"))
               for h in hits)  # BM25's rows are these chunks' rows: rebuilt for the saved chunks
    assert again.update(LocalTree(repo)).files_changed == ["pocketlib/stats.py"]  # the saved stamp is the old one
    assert again.search("arithmetic_mean_unsaved", 1, mode="bm25")[0].chunk.path == "pocketlib/stats.py"


def test_compaction_and_the_ann_graph_keep_the_results(repo, tmp_path, tiny_embedder):
    exact = build(repo, tmp_path / "exact", tiny_embedder)
    ann = build(repo, tmp_path / "ann", tiny_embedder, ann_threshold=10)
    for query in ("roman numeral", "median of values", "slugify a title"):
        assert locations(ann.search(query, 5, mode="semantic")) == locations(exact.search(query, 5, mode="semantic"))
        assert all(h.chunk.path.startswith("tests/") for h in ann.search(query, 5, mode="semantic", dirs=["tests"]))
    shutil.rmtree(repo / "tests")
    ann.update(LocalTree(repo))
    assert ann.dead_fraction() > 0.25
    expected = locations(ann.search("roman numeral", 5))
    ann.save()  # compacts
    assert ann.dead_fraction() == 0 and ann.rows == ann.live_chunks()
    assert locations(ann.search("roman numeral", 5)) == expected
    assert np.allclose(np.linalg.norm(ann.vectors[:ann.rows], axis=1), 1, atol=1e-5)
    again = CodeIndex.open(tmp_path / "ann", tiny_embedder, IndexConfig(ann_threshold=10))
    assert locations(again.search("roman numeral", 5)) == expected


def test_a_crash_inside_save_leaves_the_previous_save_whole(repo, tmp_path, tiny_embedder):
    index = build(repo, tmp_path / "ix", tiny_embedder)
    index.save()
    expected = locations(index.search("roman numeral", 10))
    removed = sorted(str(p.relative_to(repo)) for p in (repo / "tests").glob("*.py"))
    shutil.rmtree(repo / "tests")
    index.update(LocalTree(repo))
    index.compact()  # rows renumbered: the old file→rows map would now point at other chunks
    index.saves += 1  # what save() writes before it replaces index.json: then the process dies
    with open(tmp_path / "ix" / f"chunks-{index.saves}.jsonl", "w") as f:
        f.write("null\n" * index.rows)
    np.save(tmp_path / "ix" / f"vectors-{index.saves}.npy", np.zeros((index.rows, index.embedder.dim), np.float32))
    index.close()
    again = CodeIndex.open(tmp_path / "ix", tiny_embedder)
    assert locations(again.search("roman numeral", 10)) == expected  # the previous save, whole
    assert again.update(LocalTree(repo)).files_removed == removed  # and it still knows what changed since
    assert len(removed) == 6


def test_a_tampered_index_is_refused_not_followed(repo, tmp_path, tiny_embedder):
    index = build(repo, tmp_path / "ix", tiny_embedder)
    index.save()
    meta = json.loads((tmp_path / "ix" / "index.json").read_text())
    for data in ({"chunks": "../../etc/passwd", "vectors": meta["data"]["vectors"]}, {}):
        (tmp_path / "ix" / "index.json").write_text(json.dumps({**meta, "data": data}))
        with pytest.raises(IndexError_, match="does not name its data files"):
            CodeIndex.open(tmp_path / "ix", tiny_embedder)


def test_the_ann_graph_grows_with_edits_instead_of_being_rebuilt(repo, tmp_path, tiny_embedder):
    index = build(repo, tmp_path / "ix", tiny_embedder, ann_threshold=10)
    index.search("roman numeral", 5, mode="semantic")
    graph = index._ann
    (repo / "pocketlib" / "extra.py").write_text("def brand_new_function(x):\n    return x * 3\n")
    (repo / "pocketlib" / "roman.py").unlink()
    index.update(LocalTree(repo))
    hits = index.search("def brand_new_function(x): return x * 3", 50, mode="semantic")
    assert index._ann is graph  # added to, not rebuilt
    assert "pocketlib/extra.py" in {h.chunk.path for h in hits}
    assert "pocketlib/roman.py" not in {h.chunk.path for h in hits}  # dead rows masked


def test_each_removal_is_masked_from_the_exact_search(repo, tmp_path, tiny_embedder):
    """After each removal the exact search masks exactly the dead rows, and returns every live one asked for."""
    index = build(repo, tmp_path / "ix", tiny_embedder)
    for name in ("roman.py", "stats.py"):
        (repo / "pocketlib" / name).unlink()
        index.update(LocalTree(repo))
        live = index.live_chunks()
        assert index._allowed(None).sum() == live
        hits = index.search("numbers", live + 5, mode="semantic")
        assert len(hits) == live and f"pocketlib/{name}" not in {h.chunk.path for h in hits}
