"""Semantic code search (docs/search.md). `Mode` lives here, not in `index`, so that the CLI can type its option
without importing numpy."""

from typing import Literal

Mode = Literal["hybrid", "semantic", "bm25"]  # hybrid: meaning and words fused by reciprocal rank
