from __future__ import annotations

import pytest
from tiny_embedder import tiny_embedder_dir


@pytest.fixture(scope="session")
def tiny_embedder(tmp_path_factory):
    from shipyard.search.embed import SentenceEmbedder

    return SentenceEmbedder(str(tiny_embedder_dir(tmp_path_factory.mktemp("tiny-embedder"))), max_tokens=64)


@pytest.fixture(scope="session")
def minilm():
    """The bundled MiniLM (offline, ~90 MB; loads in a few seconds)."""
    from shipyard.search.embed import SentenceEmbedder

    return SentenceEmbedder()
