"""A byte-level tokenizer with ChatML special tokens, built in-process (no download).

Every byte is one token (GPT-2's byte-to-unicode alphabet, no merges), plus `<|endoftext|>`, `<|im_start|>`
and `<|im_end|>`. It is lossless for any UTF-8 text and deterministic, which makes it the tokenizer for the
replay engine (recorded text → ids) and for tiny random test models. It carries no chat template, so it
exercises the harness's ChatML fallback.
"""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_alphabet() -> list[str]:
    """GPT-2's reversible byte→printable-character map, in byte order (Radford et al. 2019, encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = 0
    chars = {}
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@cache
def _tokenizer_json() -> str:
    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer instance (vocab size 259: 256 bytes + 3 special tokens)."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
