"""The benchmarks' model and batch flags, shared so that rows of different scripts describe the same model.

Defaults: the 0.9B LLaMA of the 4-GPU rows (hidden 2048, 15 decoder layers, MLP 5632, 16 heads, vocabulary 32000),
micro-batches of 2 x 2048 tokens. ``bench_pipeline.py`` (DeepSpeed's engine: 1F1B and 2BW) and ``bench_peers.py``
(torch's pipeline schedules, as torchtitan runs them) both take them.
"""
from __future__ import annotations

import argparse

from transformers import LlamaConfig


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)


def model_of(a: argparse.Namespace) -> tuple[dict, LlamaConfig]:
    """``(the ds_async.model.config section, its Hugging Face config)`` of the flags: full attention heads (no
    grouped keys and values), untied embeddings."""
    model = {"vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": a.ffn,
             "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.heads,
             "max_position_embeddings": a.seq_len}
    return model, LlamaConfig(**model, tie_word_embeddings=False)
