"""A Hugging Face Mixtral (sparse mixture of experts) as DeepSpeed ``LayerSpec``s, on the LLaMA pipeline layers.

Stage contract (what crosses a stage boundary is always one of these):

* embedding: ``input_ids`` [b, s] -> ``hidden`` [b, s, h] (the LLaMA embedding layer, unchanged);
* decoder layer: ``hidden`` or ``(hidden, prob_sum, counts)`` -> ``(hidden, prob_sum, counts)``;
* head: ``(hidden, prob_sum, counts)`` -> ``(logits, aux)``; the loss is ``CE(logits) + router_aux_loss_coef * aux``.

Router load-balancing loss. HF's ``load_balancing_loss_func`` does not add per-layer losses: it sums, over all
layers and tokens, each expert's top-k assignment count ``C_e`` and routing probability ``P_e`` and returns
``E * sum_e (C_e / R) * (P_e / R)`` with ``R`` = layers x tokens. That is bilinear in the two sums, so a sum of
per-layer losses would differ. Each decoder layer therefore adds its own two statistics to running sums that
travel with the hidden states: ``prob_sum`` (float32 [E], differentiable: its gradient reaches every router,
on every stage, through DeepSpeed's gradient sends) and ``counts`` (int64 [E], exact; DeepSpeed neither expects nor
sends gradients for non-float tensors). The head computes the loss from the sums, with HF's operations in HF's
order, so ``aux`` equals ``MixtralForCausalLM(..., output_router_logits=True).aux_loss`` of the same micro-batch.
The layer before the first decoder layer sends only ``hidden``, so every float tensor sent between stages
requires grad, as DeepSpeed's backward needs.

Expert weights are the plain 3-D parameters of transformers 5's ``MixtralExperts``: ``gate_up_proj`` [E, 2I, H]
(each expert's gate rows then its up rows) and ``down_proj`` [E, H, I]; ``ds_async_roles`` declares them
``matrix`` (a stack of one matrix per expert) and the router's ``gate.weight`` [E, H] a 2-D ``matrix``.
Checkpoints are read in either layout (transformers 5's fused one, or the per-expert ``block_sparse_moe.experts.
{e}.w1/w2/w3`` one that ``save_pretrained`` writes) and exported in the latter.
"""
from __future__ import annotations

import functools

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

from ..config import ConfigError
from . import hf_io, llama
from .llama import DecoderLayerPipe, EmbeddingPipe, HeadPipe, causal_lm_loss


def router_statistics(router_logits: torch.Tensor, num_experts: int, top_k: int):
    """One layer's share of HF's load-balancing loss (no attention mask): the routing probabilities summed over
    tokens (float32 [E]) and how many of the tokens' top-k choices went to each expert (int64 [E]).

    As ``load_balancing_loss_func``: softmax in the logits' dtype, top-k on those probabilities."""
    probs = torch.softmax(router_logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices.flatten()
    counts = torch.zeros(num_experts, dtype=torch.long, device=chosen.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen))
    return probs.float().sum(dim=0), counts


def load_balancing_loss(prob_sum: torch.Tensor, counts: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` from the statistics summed over all layers; ``rows`` = layers x tokens."""
    tokens_per_expert = counts.float() / float(rows)
    router_prob_per_expert = prob_sum / float(rows)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


class MoeDecoderLayerPipe(DecoderLayerPipe):
    """HF's ``MixtralDecoderLayer``, adding its router statistics to the running sums it passes on."""

    decoder_cls = MixtralDecoderLayer
    rotary_cls = MixtralRotaryEmbedding

    def __init__(self, config: MixtralConfig, layer_idx: int, seed: int = 0, hf_dir: str | None = None):
        super().__init__(config, layer_idx, seed=seed, hf_dir=hf_dir)
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self._router_logits = None
        self.layer.mlp.gate.register_forward_hook(self._keep_router_logits)

    def ds_async_roles(self):
        """The router is a bare [E, H] parameter, not a Linear: declare it; each expert stack is E matrices."""
        mlp = self.layer.mlp
        return {mlp.gate.weight: "matrix", mlp.experts.gate_up_proj: "matrix", mlp.experts.down_proj: "matrix"}

    def _keep_router_logits(self, module, args, output):
        self._router_logits = output[0]

    def forward(self, inputs):
        hidden, prob_sum, counts = inputs if isinstance(inputs, tuple) else (inputs, None, None)
        hidden = self._decode(hidden)
        probs, chosen = router_statistics(self._router_logits, self.num_experts, self.top_k)
        self._router_logits = None
        if prob_sum is None:  # the first decoder layer
            return hidden, probs, chosen
        return hidden, prob_sum + probs, counts + chosen

    # ------------------------------------------------------------------------------------ checkpoint layout
    def _expert_keys(self, e: int) -> dict[str, str]:
        prefix = f"model.layers.{self.layer_idx}.block_sparse_moe.experts.{e}."
        return {w: f"{prefix}{w}.weight" for w in ("w1", "w2", "w3")}

    @staticmethod
    def _saved_name(hf_name: str) -> str:
        return hf_name.replace(".mlp.", ".block_sparse_moe.")

    def hf_state_dict(self):
        """As ``save_pretrained`` writes it: experts one by one, ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""
        out = {}
        for name, tensor in self.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                gate, up = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    keys = self._expert_keys(e)
                    out[keys["w1"]], out[keys["w3"]] = gate[e], up[e]
            elif name.endswith("experts.down_proj"):
                for e in range(tensor.shape[0]):
                    out[self._expert_keys(e)["w2"]] = tensor[e]
            else:
                out[self._saved_name(self.hf_names()[name])] = tensor
        return out

    def load_hf(self, hf_dir: str) -> None:
        names = self.hf_names()
        if set(names.values()) <= hf_io.checkpoint_names(hf_dir):  # transformers 5's fused layout
            return super().load_hf(hf_dir)
        experts = range(self.layer.mlp.experts.num_experts)
        plain = {k: self._saved_name(v) for k, v in names.items() if ".experts." not in k}
        wanted = list(plain.values()) + [key for e in experts for key in self._expert_keys(e).values()]
        tensors = hf_io.read_tensors(hf_dir, wanted)
        local = {k: tensors[v] for k, v in plain.items()}
        per_expert = [self._expert_keys(e) for e in experts]
        local["layer.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[k["w1"]], tensors[k["w3"]]]) for k in per_expert])
        local["layer.mlp.experts.down_proj"] = torch.stack([tensors[k["w2"]] for k in per_expert])
        hf_io.assign(self, local)


class MoeHeadPipe(HeadPipe):
    """Final norm and LM head; also turns the router statistics into the load-balancing loss."""

    def __init__(self, config: MixtralConfig, seed: int = 0, index: int = 0, hf_dir: str | None = None):
        super().__init__(config, seed=seed, index=index, hf_dir=hf_dir)
        self.num_experts, self.num_layers = config.num_local_experts, config.num_hidden_layers

    def forward(self, inputs):
        hidden, prob_sum, counts = inputs
        rows = self.num_layers * hidden.shape[:-1].numel()
        return super().forward(hidden), load_balancing_loss(prob_sum, counts, rows, self.num_experts)


def moe_causal_lm_loss(outputs, labels: torch.Tensor, coef: float, chunk: int = 0) -> torch.Tensor:
    """``CE + coef * aux`` as ``MixtralForCausalLM`` with ``output_router_logits=True``; labels already shifted."""
    logits, aux = outputs
    return causal_lm_loss(logits, labels, chunk) + coef * aux


def loss_fn(config: MixtralConfig, chunk: int = 0):
    """The pipeline's ``loss_fn(outputs, labels)``; ``chunk`` > 0: chunked cross-entropy (see ``.loss``)."""
    return functools.partial(moe_causal_lm_loss, coef=config.router_aux_loss_coef, chunk=chunk)


def check_supported(config: MixtralConfig, prefix: str | None = None) -> None:
    """LLaMA's refusals and attention (:func:`llama.check_supported`, the same ``prefix``, Mixtral's rotary
    embedding), the router's and the attention window's refusals; then pick the experts' implementation."""
    prefix = f"ds_async.models ({config.model_type}): " if prefix is None else prefix
    llama.check_supported(config, prefix, MoeDecoderLayerPipe.rotary_cls)
    if not 0 < config.num_experts_per_tok <= config.num_local_experts:
        raise ConfigError(f"{prefix}num_experts_per_tok: {config.num_experts_per_tok} must be in "
                          f"1..num_local_experts ({config.num_local_experts})")
    if config.sliding_window is not None:
        raise ConfigError(f"{prefix}sliding_window: {config.sliding_window} is not supported: stages run full "
                          "causal attention; set it to null (the same model for sequences within the window)")
    if config._experts_implementation is None:
        config._experts_implementation = "grouped_mm"  # what a transformers model picks by default


def layer_specs(config: MixtralConfig, seed: int = 0, hf_dir: str | None = None) -> list:
    """The model as ``[embedding, decoder x L, head]`` LayerSpecs (built lazily, only on the owning stage)."""
    check_supported(config)
    return llama.layer_specs(config, seed=seed, hf_dir=hf_dir, embedding=EmbeddingPipe, decoder=MoeDecoderLayerPipe,
                             head=MoeHeadPipe)
