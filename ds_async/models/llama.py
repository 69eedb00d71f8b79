"""A Hugging Face LLaMA as a list of DeepSpeed ``LayerSpec``s.

Stage contract: the first layer takes ``input_ids`` [b, s] (int64) and every later layer takes and returns the
hidden states [b, s, h]; the last layer returns logits [b, s, vocab]. Rotary embeddings are recomputed on each
stage from positions ``0..s-1``, so only one tensor crosses a stage boundary. Attention runs through SDPA with no
mask, which transformers treats as causal.

Every layer initialises its own weights from ``(seed, layer index)`` (or reads them from a HF directory), so
the model is the same whatever the partition and no rank ever materialises another stage's layers.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from .hf_io import load_into


def _seeded_init(module: nn.Module, std: float, seed: int) -> None:
    """HF's LLaMA init (normal(0, std) for Linear/Embedding, ones for RMSNorm) from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * std)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()
            elif isinstance(sub, LlamaRMSNorm):
                sub.weight.fill_(1.0)


class _PipeLayer(nn.Module):
    """Base for pipeline layers: build weights, then seed-init them or load them from a HF directory."""

    @staticmethod
    def _building(hf_dir: str | None):
        """Weights that will be read from disk are created empty (meta) and never initialised."""
        return nullcontext() if hf_dir is None else init_empty_weights()

    def _finish(self, config: LlamaConfig, seed: int, index: int, hf_dir: str | None) -> None:
        if hf_dir is None:
            _seeded_init(self, config.initializer_range, seed * 100_003 + index)
        else:
            load_into(self, hf_dir, self.hf_names())

    def hf_names(self) -> dict[str, str]:
        """Map of this module's state-dict keys to the HF checkpoint's keys."""
        raise NotImplementedError


class EmbeddingPipe(_PipeLayer):
    def __init__(self, config: LlamaConfig, seed: int = 0, index: int = 0, hf_dir: str | None = None):
        super().__init__()
        with self._building(hf_dir):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self._finish(config, seed, index, hf_dir)

    def hf_names(self):
        return {"embed_tokens.weight": "model.embed_tokens.weight"}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayerPipe(_PipeLayer):
    def __init__(self, config: LlamaConfig, layer_idx: int, seed: int = 0, hf_dir: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        with self._building(hf_dir):
            self.layer = LlamaDecoderLayer(config, layer_idx)
        self.rotary = LlamaRotaryEmbedding(config)
        self._finish(config, seed, layer_idx + 1, hf_dir)

    def hf_names(self):
        return {f"layer.{k}": f"model.layers.{self.layer_idx}.{k}" for k in self.layer.state_dict()}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, positions)
        return self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)


class HeadPipe(_PipeLayer):
    """Final RMSNorm and LM head: hidden states -> logits."""

    def __init__(self, config: LlamaConfig, seed: int = 0, index: int = 0, hf_dir: str | None = None):
        super().__init__()
        with self._building(hf_dir):
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._finish(config, seed, index, hf_dir)

    def hf_names(self):
        return {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``labels`` are already shifted (see ``ds_async.data``)."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def check_supported(config: LlamaConfig) -> None:
    if config.tie_word_embeddings:
        raise ValueError(
            "ds_async.models.llama: tie_word_embeddings=true is not supported: the tied embedding and LM head live "
            "on different pipeline stages and a one-step-delayed update of a shared tensor is not defined. "
            "Set \"tie_word_embeddings\": false in the model config (or untie the checkpoint).")
    config._attn_implementation = "sdpa"


def layer_specs(config: LlamaConfig, seed: int = 0, hf_dir: str | None = None) -> list:
    """The model as ``[embedding, decoder x L, head]`` LayerSpecs (built lazily, only on the owning stage)."""
    from deepspeed.pipe import LayerSpec

    check_supported(config)
    n = config.num_hidden_layers
    return ([LayerSpec(EmbeddingPipe, config, seed=seed, index=0, hf_dir=hf_dir)]
            + [LayerSpec(DecoderLayerPipe, config, i, seed=seed, hf_dir=hf_dir) for i in range(n)]
            + [LayerSpec(HeadPipe, config, seed=seed, index=n + 1, hf_dir=hf_dir)])
