"""CUDA graphs of a stage's passes (``performance.cuda_graphs``) compute the bits the ungraphed passes compute.

On GPUs: a stage replayed from graphs against the same stage run as compiled (two weight versions, two
micro-batches in flight, 1F1B order), output by output and gradient by gradient; and the shipped 2BW demo config
trained through ``launch/train.py`` on one GPU with and without graphs (``performance.deterministic``, which the
comparison needs), weights compared at the end. On CPU: the
refusals (no GPU, activation checkpointing). The GPU tests skip on CPU; their output on the device is committed in
``launch/bench/results/cuda_graphs_tests_1xH200.txt``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from ds_async import checkpoint
from ds_async.config import ConfigError, parse
from ds_async.models import compiled_stage, llama
from ds_async.pipe.graphs import GraphedStage
from distributed import train_py_error, two_versions

ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _stage(kind: str, cfg: LlamaConfig) -> list[torch.nn.Module]:
    layers = [llama.DecoderLayerPipe(cfg, i, seed=3) for i in range(2)]
    if kind == "first":
        return [llama.EmbeddingPipe(cfg, seed=3)] + layers
    return layers + [llama.HeadPipe(cfg, seed=3, index=3)]


@gpu
@pytest.mark.parametrize("kind", ["first", "last"])
def test_graphed_stage_is_bit_equal_to_the_compiled_stage(kind):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)
    runs = {}
    for name in ("plain", "graphed"):
        layers = _stage(kind, cfg)
        stage = torch.nn.ModuleList(layers).to("cuda", torch.bfloat16)
        versions = two_versions(stage)
        run = compiled_stage(layers)
        runs[name] = (GraphedStage(layers, run) if name == "graphed" else run, versions)

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 12
    if kind == "first":
        inputs = [torch.randint(0, 512, (4, 64), device="cuda", generator=gen) for _ in range(n)]
    else:
        inputs = [torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n)]
    width = 512 if kind == "last" else 128
    grads = [torch.randn(4, 64, width, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n)]
    results = {}
    for name, (forward, versions) in runs.items():
        outs, pending, input_grads = [], {}, []
        xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        # 1F1B with two micro-batches in flight, the versions alternating every two micro-batches (a new version
        # while the previous one still has a micro-batch in flight, as under 2BW)
        for k in range(n + 1):
            if k < n:
                versions.activate(k // 2 % 2)
                pending[k] = forward(xs[k])
                outs.append(pending[k].detach().clone())
            if k >= 1:
                pending.pop(k - 1).backward(grads[k - 1])
                versions.backward_done((k - 1) // 2 % 2)
        versions.restore_master()
        input_grads = [x.grad for x in xs if x.is_floating_point()]
        slot_grads = [t.grad.clone() for slot in versions.slots for t in slot]
        results[name] = (outs, input_grads, slot_grads)
    (got, got_in, got_slots), (want, want_in, want_slots) = results["graphed"], results["plain"]
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output of micro-batch {k}"
    for k, (g, w) in enumerate(zip(got_in, want_in)):
        assert torch.equal(g, w), f"input gradient of micro-batch {k}"
    for i, (g, w) in enumerate(zip(got_slots, want_slots)):
        assert torch.equal(g, w), f"slot gradient {i}"
    graphed = runs["graphed"][0]
    # one instance per weight slot and micro-batch in flight, reused across the twelve micro-batches
    assert graphed.captured == 4, graphed.groups


def _demo_config(tmp_path: Path, graphs: bool) -> Path:
    config = json.loads((ROOT / "ds_configs" / "demo_cpu_2bw.json").read_text())
    config["bf16"] = {"enabled": True}
    ds = config["ds_async"]
    ds["pipeline_stages"] = 1
    ds["train"]["steps"] = 12
    ds["eval"] = {"every": 6, "batches": 2}
    ds["logging"] = {"dir": str(tmp_path / "runs"), "every": 1, "run_name": f"graphs-{graphs}", "progress": False,
                     "plot": False}
    ds["checkpoint"] = {"dir": str(tmp_path / f"ckpt-{graphs}"), "every": 0, "final": True}
    # deterministic: two ungraphed runs without it differ from step 5 on (atomic additions in the compiled backward)
    ds["performance"] = {"compile": True, "compile_scope": "stage", "cuda_graphs": graphs is True, "deterministic": True,
                         "compile_cache": str(tmp_path / "cache")}
    path = tmp_path / f"graphs-{graphs}.json"
    path.write_text(json.dumps(config))
    return path


@gpu
def test_demo_config_trains_bit_equal_with_graphs(tmp_path):
    """The shipped 2BW + Muon + EF demo config on one GPU, one stage: losses, validation and final weights equal."""
    summaries, weights = {}, {}
    for graphs in (False, "again", True):
        # a separate process: a finished run ends its process without the interpreter's teardown
        proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config",
                               str(_demo_config(tmp_path, graphs))], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[graphs] = json.loads((tmp_path / "runs" / f"graphs-{graphs}" / "summary.json").read_text())
        step = checkpoint.step_dir(tmp_path / f"ckpt-{graphs}", 12)
        weights[graphs] = {f"{f.name}:{k}": v for f in sorted(step.glob("*.safetensors"))
                           for k, v in load_file(f).items()}
    # the comparison means something only if the ungraphed run repeats itself exactly
    assert summaries["again"]["history"]["train"] == summaries[False]["history"]["train"]
    for key in ("train", "validation"):
        assert summaries[True]["history"][key] == summaries[False]["history"][key], (
            key, summaries[True]["history"][key], summaries[False]["history"][key])
    assert weights[True].keys() == weights[False].keys() and weights[True]
    for name, want in weights[False].items():
        assert torch.equal(weights[True][name], want), name


def test_graphs_with_activation_checkpointing_are_refused():
    with pytest.raises(ConfigError, match=r"ds_async\.performance\.cuda_graphs: needs activation_checkpoint_layers 0"):
        parse({"model": {"config": {"hidden_size": 64}}, "pipeline_stages": 2,
               "performance": {"cuda_graphs": True, "activation_checkpoint_layers": 1}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a run without a GPU")
def test_graphs_on_cpu_are_refused_with_one_line(tmp_path, capsys):
    config = json.loads(_demo_config(tmp_path, True).read_text())
    config.pop("bf16")
    config["ds_async"]["performance"] = {"cuda_graphs": True}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(config))
    line = train_py_error(["--config", str(path)], capsys)
    assert line == ("ds_async: error: ds_async.performance.cuda_graphs: CUDA graphs need an NVIDIA GPU; this run is "
                    "on cpu: set it to false")
