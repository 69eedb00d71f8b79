"""Mixtral (sparse MoE) pipeline: logits, loss with the router load-balancing term and gradients equal Hugging
Face's for the same weights; the export loads back into ``from_pretrained``."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from distributed import assert_params_close, emulate_run, run_job, stage_params
from ds_async import config as cfgmod
from ds_async.config import ConfigError
from ds_async.models import FAMILIES, mixtral, model_config
from ds_async.optim.roles import fused_gate_up, param_roles

# router_aux_loss_coef far above Mixtral's 0.02 so that the aux loss's share of each router gradient is large
TINY_MIXTRAL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**TINY_MIXTRAL, attn_implementation="sdpa")).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(0, TINY_MIXTRAL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    # ds_async's labels are already shifted (labels[t] = input_ids[t + 1]); HF shifts ``labels=input_ids`` itself
    shifted = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    return ids, shifted


@pytest.fixture(scope="module")
def hf_reference(hf_model, batch):
    """HF's outputs and gradients: of the total loss (CE + coef * aux) and of the aux loss alone."""
    model, _ = hf_model
    ids, _ = batch
    out = model(ids, labels=ids, output_router_logits=True)
    params = dict(model.named_parameters())
    total = torch.autograd.grad(out.loss, list(params.values()), retain_graph=True)
    aux = torch.autograd.grad(out.aux_loss, list(params.values()), allow_unused=True)
    return out, dict(zip(params, total)), dict(zip(params, aux))


PARTITIONS = {
    # [embedding, layers 0-1] | [layers 2-3, head]: (hidden, prob_sum, counts) crosses
    "p2": (2, {"method": "uniform"}),
    # [embedding] | [layers 0-1] | [layers 2-3, head]: hidden alone crosses, then a middle stage relays the sums
    "p3": (3, {"method": "explicit", "boundaries": [0, 1, 3, 6]}),
}


@pytest.fixture(scope="module", params=list(PARTITIONS))
def pipeline_run(request, hf_model, batch, tmp_path_factory):
    """One real pipeline job per partition: eval, one training step with gradients recorded, export."""
    stages, partition = PARTITIONS[request.param]
    _, path = hf_model
    ids, labels = batch
    out = tmp_path_factory.mktemp(f"moe-{request.param}")
    result = run_job(stages, "moe", out, hf_dir=str(path), stages=stages, input_ids=ids.tolist(),
                     labels=labels.tolist(), partition=partition, export=True)
    grads = {}
    for s in range(stages):
        grads.update(torch.load(out / f"grads_stage{s}.pt", weights_only=True))
    return result, grads, out


def test_logits_equal_hf(pipeline_run, hf_reference):
    result, _, _ = pipeline_run
    want, _, _ = hf_reference
    torch.testing.assert_close(result["logits"], want.logits.detach(), rtol=1e-5, atol=1e-5)


def test_loss_with_router_aux_equals_hf(pipeline_run, hf_reference):
    result, _, _ = pipeline_run
    want, _, _ = hf_reference
    torch.testing.assert_close(result["aux"], want.aux_loss.detach(), rtol=1e-6, atol=1e-7)
    assert want.aux_loss.item() * TINY_MIXTRAL["router_aux_loss_coef"] > 0.1 * want.loss.item()  # not negligible
    torch.testing.assert_close(result["loss"], want.loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result["train_loss"], want.loss.detach(), rtol=1e-6, atol=1e-6)


def test_gradients_equal_hf_routers_through_aux(pipeline_run, hf_reference):
    _, grads, _ = pipeline_run
    _, total, aux = hf_reference
    assert grads.keys() == total.keys()
    for name, want in total.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=2e-7, msg=name)
    # Every router's gradient has a large share from the aux loss (which the CE never sees): matching HF's total
    # gradient on stage 0's routers means the aux gradient crossed the stage boundary back to them.
    for layer in range(TINY_MIXTRAL["num_hidden_layers"]):
        name = f"model.layers.{layer}.mlp.gate.weight"
        share = TINY_MIXTRAL["router_aux_loss_coef"] * aux[name].norm() / total[name].norm()
        assert share > 0.05, (name, share)
        assert grads[name].norm() > 0


def test_export_round_trip(pipeline_run, hf_model, batch):
    """Export after a training step -> from_pretrained -> the logits the pipeline computes after that step; the
    files hold the tensors ``save_pretrained`` writes (per-expert w1/w2/w3)."""
    result, _, out = pipeline_run
    _, path = hf_model
    names = set()
    for shard in (out / "hf").glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            names |= set(f.keys())
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert names == set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="sdpa").eval()
    assert isinstance(model, MixtralForCausalLM)
    with torch.no_grad():
        logits = model(batch[0]).logits
    assert not torch.allclose(logits, result["logits"], atol=1e-4), "the step must have changed the model"
    torch.testing.assert_close(logits, result["logits_after"], rtol=1e-5, atol=1e-5)


SGD_M = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


@pytest.mark.parametrize("perf", [{}, {"activation_checkpoint_interval": 1}, {"activation_checkpoint_layers": [1, 1]}],
                         ids=["plain", "checkpoint-interval", "recomputed-layers"])
def test_2bw_engine_equals_emulation(tmp_path, perf):
    """PipeDream-2BW through a real 2-stage MoE pipeline (the router sums cross the boundary, the aux gradient comes
    back) equals the single-process emulation of its delayed update, bit for bit; also with every decoder layer
    recomputed in the backward, or the first of each stage (DeepSpeed's reentrant checkpoint, which fails under one
    backward per output)."""
    model = {"family": "mixtral", "config": {**TINY_MIXTRAL, "vocab_size": 8192}}  # the corpus' 8k BPE
    kw = dict(steps=6, micro_batches=4, data_parallel=1, optimizer=SGD_M, seq_len=32, mbs=2, model=model)
    got = run_job(2, "train", tmp_path, stages=2, steps=6, mbs=2, gas=4, seq_len=32, schedule="2bw",
                  optimizer=SGD_M, model=model, performance=perf)
    losses, want = emulate_run("2bw", 2, **kw)
    _, sync = emulate_run("1f1b", 2, **kw)
    assert max((sync[k] - want[k]).abs().max().item() for k in want) > 1e-3, "the delay must matter"
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)  # losses summed in other orders
    # Bit-equal: the engine runs one backward over the stage's outputs (hidden, prob_sum), as the emulation does.
    # (DeepSpeed's one backward per float output summed stage 0's gradients from two partial passes: ~1e-9 off.)
    assert_params_close(stage_params(tmp_path, 2), want, rel=0)


def test_seeded_init_and_roles():
    """Fresh weights: HF's init rule from (seed, layer); expert stacks and routers are matrices for Muon."""
    config = MixtralConfig(**TINY_MIXTRAL)
    specs = mixtral.layer_specs(config, seed=3)
    a, b = specs[2].build(), specs[2].build()
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    other = mixtral.layer_specs(MixtralConfig(**TINY_MIXTRAL), seed=4)[2].build()
    experts = a.layer.mlp.experts
    assert not torch.equal(experts.gate_up_proj, other.layer.mlp.experts.gate_up_proj)
    assert experts.gate_up_proj.shape == (4, 2 * 96, 64) and experts.down_proj.shape == (4, 64, 96)
    assert abs(experts.gate_up_proj.std().item() - config.initializer_range) < 2e-3
    assert torch.equal(a.layer.input_layernorm.weight, torch.ones(64))
    roles = a.ds_async_roles()
    assert roles[experts.gate_up_proj] == roles[experts.down_proj] == roles[a.layer.mlp.gate.weight] == "matrix"
    head = specs[-1].build()
    assert head.ds_async_roles() == {head.lm_head.weight: "head"}


def test_every_parameter_has_a_role():
    layers = torch.nn.ModuleList(spec.build() for spec in mixtral.layer_specs(MixtralConfig(**TINY_MIXTRAL)))
    got = param_roles(layers)
    assert len(got) == len(list(layers.parameters()))
    by_shape = {(tuple(p.shape), role) for p, role in got.items()}
    assert ((4, 192, 64), "matrix") in by_shape and ((4, 64), "matrix") in by_shape
    assert ((512, 64), "embedding") in by_shape and ((512, 64), "head") in by_shape


def test_fused_gate_up_is_found_and_is_two_contiguous_halves():
    """What ``split_gate_up`` relies on: every decoder layer's expert ``gate_up_proj`` is listed as a fused
    ``[gate; up]`` stack (and nothing else is), and HF's experts apply it as two contiguous halves of rows, not
    interleaved rows: zeroing either half zeroes the experts' output (``silu(0) * up = silu(gate) * 0 = 0``)."""
    layers = torch.nn.ModuleList(spec.build() for spec in mixtral.layer_specs(MixtralConfig(**TINY_MIXTRAL), seed=2))
    decoders = list(layers)[1:-1]
    assert [id(p) for p in fused_gate_up(layers)] == [id(d.layer.mlp.experts.gate_up_proj) for d in decoders]
    experts = decoders[0].layer.mlp.experts
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(10, TINY_MIXTRAL["hidden_size"], generator=gen)
    top_k = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=gen)
    with torch.no_grad():
        assert experts(hidden, top_k, weights).abs().max() > 0
        inter = TINY_MIXTRAL["intermediate_size"]
        for rows in (slice(0, inter), slice(inter, 2 * inter)):
            saved = experts.gate_up_proj[:, rows].clone()
            experts.gate_up_proj[:, rows] = 0
            assert torch.equal(experts(hidden, top_k, weights), torch.zeros_like(hidden)), rows
            experts.gate_up_proj[:, rows] = saved


def test_tied_embeddings_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        mixtral.layer_specs(MixtralConfig(**{**TINY_MIXTRAL, "tie_word_embeddings": True}))


def test_a_config_built_in_python_is_refused_as_the_json_one_naming_the_module():
    """``layer_specs`` of a config built in Python runs the refusals ``model_config`` runs on a JSON config, the
    same ConfigError with this module in place of the JSON key's path."""
    for change, message in (({"num_experts_per_tok": 3}, r"num_experts_per_tok: 3 must be in 1..num_local_experts"),
                            ({"sliding_window": 64}, r"sliding_window: 64 is not supported")):
        with pytest.raises(ConfigError, match=r"^ds_async.models \(mixtral\): " + message):
            mixtral.layer_specs(MixtralConfig(**{**TINY_MIXTRAL, "num_local_experts": 2, **change}))


def test_family_selects_mixtral(hf_model):
    inline = cfgmod.parse({"model": {"family": "mixtral", "config": {"num_local_experts": 4}}, "train": {"steps": 1}})
    config = model_config(inline)
    assert isinstance(config, MixtralConfig) and config.num_local_experts == 4 and not config.tie_word_embeddings
    assert FAMILIES[inline.model.family] is mixtral
    wrong = cfgmod.parse({"model": {"family": "llama", "path": str(hf_model[1])}, "train": {"steps": 1}})
    with pytest.raises(cfgmod.ConfigError, match="'llama' but the config is a 'mixtral'"):
        model_config(wrong)
