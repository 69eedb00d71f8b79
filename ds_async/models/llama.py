"""A Hugging Face LLaMA as a list of DeepSpeed ``LayerSpec``s, and the pipeline-layer machinery other families
(:mod:`ds_async.models.mixtral`) build on.

Stage contract: the first layer takes ``input_ids`` [b, s] (int64) and every later layer takes and returns the
hidden states [b, s, h]; the last layer returns logits [b, s, vocab]. Rotary embeddings are recomputed on each
stage from positions ``0..s-1``, so only one tensor crosses a stage boundary. Attention runs through SDPA with no
mask, which transformers treats as causal.

Every layer initialises its own weights from ``(seed, layer index)`` (or reads them from a HF directory), so
the model is the same whatever the partition and no rank ever materialises another stage's layers.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from accelerate import init_empty_weights
from deepspeed.pipe import LayerSpec
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
try:
    from transformers.initialization import no_init_weights
except ImportError:  # transformers releases that keep it in modeling_utils
    from transformers.modeling_utils import no_init_weights
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..config import ConfigError
from ..hub import one_line
from .hf_io import load_into
from .loss import causal_lm_loss


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.LayerNorm)


def _seeded_init(module: nn.Module, std: float, seed: int) -> None:
    """HF's init from a private generator: ones for norms, zeros for biases, normal(0, std) for every other
    parameter (Linear and Embedding weights; an MoE layer's router and stacked expert tensors), in module order, and
    an embedding's padding row (``pad_token_id``) zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if _is_norm(sub):
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    p.zero_()
                elif p.dtype == torch.float32 and p.is_contiguous():  # drawn in place: no temporary of its size
                    torch.randn(p.shape, generator=gen, out=p.detach()).mul_(std)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                sub.weight[sub.padding_idx].zero_()


def build_all(specs: Sequence, workers: int | None = None) -> list[nn.Module]:
    """``[spec.build() for spec in specs]`` for ``LayerSpec``s of this module's layers, the seed-initialised ones
    on threads: each layer draws from its own generator (so the weights are those of one build after the other)
    and torch releases the GIL while it draws. transformers' ``no_init_weights``, which every layer enters while
    it builds, swaps torch's init functions for no-ops in the whole process and back on exit; held here across the
    threads, each layer's own entry and exit then swap a no-op for a no-op. Layers read from a HF directory are
    built one after the other (accelerate's ``init_empty_weights`` patches the process the same way). ``workers``:
    threads, by default this process's share of the cores (their count over the ranks on the node)."""
    if workers is None:
        workers = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    workers = min(len(specs), workers)
    if workers < 2 or any(spec.module_kwargs.get("hf_dir") is not None for spec in specs):
        return [spec.build() for spec in specs]
    # One thread per worker: torch's intra-op threads per worker would put cores x workers threads on the cores.
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with no_init_weights(), ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda spec: spec.build(), specs))
    finally:
        torch.set_num_threads(intra_op)


class _PipeLayer(nn.Module):
    """Base for pipeline layers: build weights, then seed-init them or load them from a HF directory."""

    @staticmethod
    def _building(hf_dir: str | None):
        """Weights that will be read from disk are created empty (meta) and never initialised; weights that
        ``_seeded_init`` will set are created without torch's default initialisation, which it overwrites (every
        parameter) and which cost a large model's start seconds on the CPU."""
        return init_empty_weights() if hf_dir is not None else no_init_weights()

    def _finish(self, config: PretrainedConfig, seed: int, index: int, hf_dir: str | None) -> None:
        if hf_dir is None:
            _seeded_init(self, config.initializer_range, seed * 100_003 + index)
        else:
            self.load_hf(hf_dir)

    def hf_names(self) -> dict[str, str]:
        """Map of this module's state-dict keys to the keys of the same tensors in the transformers model."""
        raise NotImplementedError

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's tensors as a ``save_pretrained`` checkpoint stores them (by default: renamed only)."""
        local = self.state_dict()
        return {hf: local[name] for name, hf in self.hf_names().items()}

    def load_hf(self, hf_dir: str) -> None:
        """Fill this layer from the checkpoint in ``hf_dir`` (by default: the tensors of ``hf_names``)."""
        load_into(self, hf_dir, self.hf_names())


class EmbeddingPipe(_PipeLayer):
    def __init__(self, config: PretrainedConfig, seed: int = 0, index: int = 0, hf_dir: str | None = None):
        super().__init__()
        with self._building(hf_dir):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self._finish(config, seed, index, hf_dir)

    def hf_names(self):
        return {"embed_tokens.weight": "model.embed_tokens.weight"}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayerPipe(_PipeLayer):
    """One HF decoder layer (``decoder_cls``) with its own rotary embedding (``rotary_cls``)."""

    decoder_cls: type[nn.Module] = LlamaDecoderLayer
    rotary_cls: type[nn.Module] = LlamaRotaryEmbedding

    def __init__(self, config: PretrainedConfig, layer_idx: int, seed: int = 0, hf_dir: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        with self._building(hf_dir):
            self.layer = self.decoder_cls(config, layer_idx)
        self.rotary = self.rotary_cls(config)
        self._finish(config, seed, layer_idx + 1, hf_dir)

    def hf_names(self):
        return {f"layer.{k}": f"model.layers.{self.layer_idx}.{k}" for k in self.layer.state_dict()}

    def _decode(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, positions)
        return self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._decode(hidden)


class HeadPipe(_PipeLayer):
    """Final RMSNorm and LM head: hidden states -> logits."""

    def __init__(self, config: PretrainedConfig, seed: int = 0, index: int = 0, hf_dir: str | None = None):
        super().__init__()
        with self._building(hf_dir):
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._finish(config, seed, index, hf_dir)

    def hf_names(self):
        return {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}

    def ds_async_roles(self):
        """The LM head is a Linear, which by type would be a hidden ``matrix`` (see ``ds_async.optim.roles``)."""
        return {self.lm_head.weight: "head"}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def loss_fn(config: LlamaConfig, chunk: int = 0):
    """The pipeline's ``loss_fn(outputs, labels)``; ``chunk`` > 0: chunked cross-entropy (see ``.loss``)."""
    return functools.partial(causal_lm_loss, chunk=chunk) if chunk else causal_lm_loss


def check_supported(config: PretrainedConfig, prefix: str | None = None, rotary_cls: type | None = None) -> None:
    """Refuse a config the pipeline cannot run, with a ConfigError naming the key after ``prefix`` (the key's
    place in the run's config, from ``models.model_config``; for a config built in Python, this module's name);
    then pick the attention the stages run (SDPA). ``rotary_cls``: the family's rotary embedding (LLaMA's)."""
    prefix = f"ds_async.models ({config.model_type}): " if prefix is None else prefix
    if config.tie_word_embeddings:
        raise ConfigError(f"{prefix}tie_word_embeddings: true is not supported: the tied embedding and LM head "
                          "would live on different pipeline stages, and a one-step-delayed update of a shared tensor "
                          "is not defined (set it to false, or untie the checkpoint)")
    try:  # HF checks the rotary settings only when the embedding is built, on the stages, without naming a key
        with torch.device("meta"):
            (rotary_cls or DecoderLayerPipe.rotary_cls)(config)
    except Exception as e:  # noqa: BLE001 - a KeyError for an unknown rope type, a TypeError for a string theta
        raise ConfigError(f"{prefix}rope_*: the rotary embedding cannot be built from rope_theta / rope_scaling "
                          f"({one_line(e)})") from None
    config._attn_implementation = "sdpa"


def layer_specs(config: PretrainedConfig, seed: int = 0, hf_dir: str | None = None, *,
                embedding: type = EmbeddingPipe, decoder: type = DecoderLayerPipe, head: type = HeadPipe) -> list:
    """The model as ``[embedding, decoder x L, head]`` LayerSpecs (built lazily, only on the owning stage)."""
    check_supported(config)
    n = config.num_hidden_layers
    return ([LayerSpec(embedding, config, seed=seed, index=0, hf_dir=hf_dir)]
            + [LayerSpec(decoder, config, i, seed=seed, hf_dir=hf_dir) for i in range(n)]
            + [LayerSpec(head, config, seed=seed, index=n + 1, hf_dir=hf_dir)])
