"""FLOP counts the library reports and plans with: model FLOPs per token (MFU) and Newton–Schulz FLOPs.

One definition, used by the trainer's metrics, the benchmarks and the study: training FLOPs are
``6 N`` for the matmul parameters (forward + backward; the embedding lookup is not a matmul, the head is)
plus ``12 L h s`` for attention scores and values (causal masking not halved, as MFU is usually quoted). MoE
models count the parameters a token activates (``top_k`` of the experts), so MFU is on active parameters.
"""
from __future__ import annotations

from collections.abc import Iterable


def matmul_params_per_layer(hf_config) -> int:
    """Active matmul weights of one decoder layer (attention projections and the MLP or top-k experts)."""
    h = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    attention = h * q + 2 * h * kv + q * h
    experts = getattr(hf_config, "num_experts_per_tok", None)
    mlp = 3 * h * hf_config.intermediate_size * (experts or 1)
    router = h * hf_config.num_local_experts if experts else 0
    return attention + mlp + router


def model_flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token of a LLaMA/Mixtral model at sequence length ``seq_len``."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    attention_width = hf_config.num_attention_heads * head_dim
    head = h * hf_config.vocab_size
    return 6 * (layers * matmul_params_per_layer(hf_config) + head) + 12 * layers * attention_width * seq_len


def newton_schulz_flops(shapes: Iterable[tuple[int, ...]], steps: int) -> float:
    """FLOPs of ``steps`` quintic Newton–Schulz iterations on matrices of these shapes (the last two dimensions;
    leading ones are a stack). Per n x k matrix (n <= k after orientation) and iteration: X X^T (2 n^2 k),
    the polynomial's A A (2 n^3) and B X (2 n^2 k)."""
    total = 0.0
    for shape in shapes:
        n, k = sorted(shape[-2:])
        stack = 1
        for d in shape[:-2]:
            stack *= d
        total += stack * steps * (4 * n * n * k + 2 * n ** 3)
    return total


def layer_flops_per_token(hf_config, seq_len: int) -> list[float]:
    """Training FLOPs per token of each pipeline layer ``[embedding, decoder x L, head]`` (the embedding lookup 0,
    the head its vocabulary projection); they add up to :func:`model_flops_per_token`. For balancing stages."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    decoder = 6 * matmul_params_per_layer(hf_config) + 12 * hf_config.num_attention_heads * head_dim * seq_len
    return [0.0] + [float(decoder)] * layers + [6.0 * h * hf_config.vocab_size]
