"""``performance.fp8`` on CPU: the config, the refusals (through the CLI and the emulation), which layers are
converted, and that converted layers train (torchao's CPU emulation of the FP8 products: no FP8 kernel runs here).
Speed and the loss at length are GPU measurements (``launch/bench/RESULTS.md``)."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from ds_async import config as cfgmod
from ds_async import fp8, plan
from ds_async.config import ConfigError
from ds_async.emulate import Emulation
from ds_async.models import FAMILIES, decoder_layers
from ds_async.optim.roles import param_roles

from distributed import train_py_error

pytest.importorskip("torchao.float8")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
ATTENTION = ["layer.self_attn.q_proj", "layer.self_attn.k_proj", "layer.self_attn.v_proj", "layer.self_attn.o_proj"]
CPU = torch.device("cpu")


def layers_of(family: str):
    hf = LlamaConfig(**SMALL) if family == "llama" else MixtralConfig(**SMALL, num_local_experts=4,
                                                                       num_experts_per_tok=2)
    return [spec.build() for spec in FAMILIES[family].layer_specs(hf, seed=0)]


def test_the_recipe_is_checked_by_name():
    section = {"model": {"config": SMALL}, "train": {"steps": 1}}
    assert cfgmod.parse(section).performance.fp8 is None  # off by default
    assert cfgmod.parse({**section, "performance": {"fp8": "rowwise"}}).performance.fp8 == "rowwise"
    with pytest.raises(ConfigError, match=r"ds_async.performance.fp8: must be one of \['tensorwise', 'rowwise', "
                                          r"'rowwise_with_gw_hp'\], got 'rowwize'"):
        cfgmod.parse({**section, "performance": {"fp8": "rowwize"}})


def test_where_fp8_cannot_run_it_is_refused_naming_what_to_do(monkeypatch):
    fp8.check(None, {"fp16": {"enabled": True}}, False, CPU)  # off: nothing to check
    with pytest.raises(ConfigError, match=r"^ds_async.performance.fp8: not with fp16; .* use \"bf16\""):
        fp8.check("rowwise", {"fp16": {"enabled": True}}, True, CPU)
    with pytest.raises(ConfigError, match=r"^ds_async.performance.fp8: needs ds_async.performance.compile: true"):
        fp8.check("rowwise", {"bf16": {"enabled": True}}, False, CPU)
    with pytest.raises(ConfigError, match=r"^ds_async.performance.fp8: FP8 matrix products need an NVIDIA GPU with "
                                          r"FP8 tensor cores \(compute capability 8.9 or later: .*\); this run is on "
                                          r"cpu: set it to null$"):
        fp8.check("rowwise", {"bf16": {"enabled": True}}, True, CPU)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed: its import fails
    monkeypatch.delitem(sys.modules, "torchao.float8")
    with pytest.raises(ConfigError, match=r"^ds_async.performance.fp8: needs torchao's float8 training: pip install "
                                          r"-e \"\.\[fp8\]\""):
        fp8.check("rowwise", {}, True, CPU)


def test_the_cli_and_the_emulation_refuse_it_on_cpu(tmp_path, capsys, monkeypatch):
    """Before anything is built: one line, exit 1 (the trainer in a one-process world; the emulation's job)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "ds_async": {"model": {"config": SMALL}, "tokenizer": "train:300", "pipeline_stages": 1,
                        "performance": {"fp8": "rowwise", "compile": True},
                        "data": {"train": "python:docs", "validation": None, "seq_len": 16},
                        "train": {"steps": 2}, "logging": {"dir": str(tmp_path / "runs"), "run_name": "fp8"}}}
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(cfg))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    line = train_py_error(["--config", str(path)], capsys)
    assert line.startswith("ds_async: error: ds_async.performance.fp8: FP8 matrix products need an NVIDIA GPU"), line
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made
    with pytest.raises(ConfigError, match=r"^ds_async.performance.fp8: FP8 matrix products need an NVIDIA GPU"):
        Emulation(str(path))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_only_the_decoder_layers_products_are_converted(family):
    """LLaMA: attention's four projections and the MLP's three; Mixtral: attention's (its router and its experts,
    3-D stacks, stay). The embedding and the head are never touched; the parameters stay the same tensors under
    the same names, so checkpoints, export and Muon's parameter roles see the same model."""
    from torchao.float8.float8_linear import Float8Linear

    layers = layers_of(family)
    params = {name: p for layer in layers for name, p in layer.named_parameters()}
    names = {layer: dict(layer.hf_state_dict()) for layer in layers}
    roles = param_roles(torch.nn.ModuleList(layers))
    converted = [fp8.convert(layer, "rowwise") for layer in decoder_layers(layers)]
    want = ATTENTION + (["layer.mlp.gate_proj", "layer.mlp.up_proj", "layer.mlp.down_proj"] if family == "llama" else [])
    assert converted == [want] * SMALL["num_hidden_layers"]
    found = sorted({type(m).__name__ for layer in layers for m in layer.modules() if isinstance(m, Float8Linear)})
    assert found == ["Float8Linear"]
    assert not any(isinstance(m, Float8Linear) for m in layers[0].modules())  # embedding
    assert not any(isinstance(m, Float8Linear) for m in layers[-1].modules())  # head
    if family == "mixtral":
        mlp = decoder_layers(layers)[0].layer.mlp
        assert not any(isinstance(m, Float8Linear) for m in [*mlp.gate.modules(), *mlp.experts.modules()])
    after = {name: p for layer in layers for name, p in layer.named_parameters()}
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert {layer: dict(layer.hf_state_dict()).keys() for layer in layers} == {k: v.keys() for k, v in names.items()}
    assert param_roles(torch.nn.ModuleList(layers)) == roles


def test_converted_layers_train_with_fp8_rounding():
    """Forward and backward through FP8 products (torchao's emulation on CPU): close to the unconverted model, not
    equal to it (the products really are rounded to FP8), and every weight of a converted product gets a
    gradient."""
    x = torch.randint(0, SMALL["vocab_size"], (2, 16))
    outputs, grads = [], []
    for convert in (False, True):
        layers = layers_of("llama")
        if convert:
            for layer in decoder_layers(layers):
                fp8.convert(layer, "rowwise", emulate=True)
        h = x
        for layer in layers:
            h = layer(h)
        h.float().pow(2).mean().backward()
        outputs.append(h.detach())
        grads.append(decoder_layers(layers)[0].layer.self_attn.q_proj.weight.grad)
    (ref, got), (ref_grad, got_grad) = outputs, grads
    assert not torch.equal(got, ref)
    assert ((got - ref).norm() / ref.norm()).item() < 0.1
    assert got_grad is not None and ((got_grad - ref_grad).norm() / ref_grad.norm()).item() < 0.2


def test_the_planner_counts_fp8s_casts(tmp_path):
    """``python -m ds_async.plan`` on the shipped 8B config with ``fp8``: every stage's working set grows by FP8's
    casts of its largest product (weight and transpose, input and output gradient, a byte an element), nothing
    else changes."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "ds_configs" / "llama3_8b_4gpu_2bw_adamw.json"
    config = json.loads(shipped.read_text())
    config["ds_async"]["performance"]["fp8"] = "rowwise"
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(config))
    bf16, with_fp8 = plan.plan(str(shipped), 4, 80), plan.plan(str(path), 4, 80)
    h, f = 4096, 14336  # the config's hidden and MLP sizes
    tokens = config["train_micro_batch_size_per_gpu"] * config["ds_async"]["data"]["seq_len"]
    extra = 2 * h * f + 2 * tokens * f
    for a, b in zip(bf16.stage_list, with_fp8.stage_list):
        assert b.activations - a.activations == extra
        assert b.total - a.total in (0, extra)  # unless the step's phase, not the passes', is the peak
        assert (b.weights, b.masters, b.optimizer) == (a.weights, a.masters, a.optimizer)
