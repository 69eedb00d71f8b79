"""The engine's host path (issue 44): DeepSpeed's throughput timer does not synchronise the device; identical
decoder layers share one compiled code (regional compilation); an evaluation runs through the graphs training
compiled, without compiling its own; the compile cache's folder is the config's; layers are built on threads with
the weights of one build after the other."""
import json
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from ds_async.builder import start_reader, without_throughput_sync
from ds_async.config import ConfigError, parse
from ds_async.emulate import Emulation
from ds_async.models import (StagedPipelineModule, compiled_stage, dropout_free, llama, loss_as_in_training,
                             mixtral, model_config, use_compile_cache)
from ds_async.pipe.delayed import DelayedTrainer
from ds_async.telemetry import StartClock, process_age


def test_deepspeed_throughput_timer_is_off_unless_configured():
    """DeepSpeed's pipeline engine starts its throughput timer at every forward pass, and by default each start
    waits for the device (``timers.throughput.synchronized``): the host could never run ahead of the GPU."""
    from deepspeed.runtime.config import DeepSpeedConfig

    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    assert DeepSpeedConfig(base, mpu=None).timers_config.enabled  # DeepSpeed's default
    assert not DeepSpeedConfig(without_throughput_sync(base), mpu=None).timers_config.enabled
    own = {**base, "timers": {"throughput": {"enabled": True, "synchronized": False}}}
    assert without_throughput_sync(own) == own  # a config that sets it keeps it


def _layers(n: int, hidden: int = 32):
    cfg = parse({"model": {"config": {"hidden_size": hidden, "intermediate_size": 2 * hidden,
                                      "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": n,
                                      "vocab_size": 50, "max_position_embeddings": 16}}})
    hf = model_config(cfg)
    return hf, [llama.DecoderLayerPipe(hf, i, seed=3) for i in range(n)] + [llama.HeadPipe(hf, seed=3, index=n + 1)]


def test_identical_decoder_layers_share_one_compiled_code():
    """``compile_scope = "layer"`` is regional compilation: each decoder layer is compiled on its own, and all of
    them run one compiled code (Dynamo's cache is keyed by the code; the weights are graph inputs), so a stage of
    4 decoder layers compiles one decoder graph and the head's, not one per layer."""
    _, layers = _layers(4)
    torch._dynamo.reset()
    counters.clear()
    for layer in layers:
        layer.compile(backend="aot_eager")
    x = torch.randn(2, 16, 32, requires_grad=True, generator=torch.Generator().manual_seed(0))
    out = torch.nn.Sequential(*layers)(x)
    out.float().square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 2


class _Stage(torch.nn.Module):
    """A stage with StagedPipelineModule's own forward (without DeepSpeed's process groups)."""

    forward = StagedPipelineModule.forward
    _forward_as_in_training = StagedPipelineModule._forward_as_in_training

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self._compiled_stage = compiled_stage(layers, backend="aot_eager")
        self.recompute_layers, self.micro_offset, self.eval_as_training = 0, 0, True
        self._graphed, self._evaluating = None, False


def test_evaluation_reuses_the_training_graphs():
    """Training compiles the stage and the loss; an evaluation (``eval()`` and ``no_grad``, as DeepSpeed's
    ``eval_batch`` runs it) then compiles nothing, returns detached results equal to training's forward, and leaves
    the modules in evaluation mode."""
    hf, layers = _layers(2)
    assert dropout_free(hf)
    torch._dynamo.reset()
    stage = _Stage(layers)
    loss_fn = loss_as_in_training(torch.compile(lambda logits, labels: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten()), backend="aot_eager"))
    x = torch.randn(2, 16, 32, requires_grad=True, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    stage.train()
    out = stage(x)
    loss = loss_fn(out, labels)
    loss.backward()
    stage.eval()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        out_eval = stage(x.detach())
        loss_eval = loss_fn(out_eval, labels)
    assert torch.equal(out_eval, out.detach()) and torch.equal(loss_eval, loss.detach())
    assert not out_eval.requires_grad and not loss_eval.requires_grad
    assert not any(m.training for m in stage.modules())


def test_the_emulations_evaluation_reuses_the_training_graph():
    """The emulation's trainer, compiled: after a training step, evaluating (under ``no_grad``, as
    ``emulate.validate`` runs) compiles nothing and gives training's forward loss, detached."""
    _, layers = _layers(2)
    torch._dynamo.reset()
    params = [q for layer in layers for q in layer.parameters()]
    trainer = DelayedTrainer(layers, [0] * len(layers), lambda logits, labels: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten()), torch.optim.SGD(params, lr=0.1), "1f1b", micro_batches=1,
        stages=1, compile={"backend": "aot_eager"})
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, 16, 32, generator=gen), torch.randint(0, 50, (2, 16), generator=gen)) for _ in range(2)]
    trainer.train_batch(batches[:1])
    want = trainer.loss(*batches[1]).detach()
    grads = [None if q.grad is None else q.grad.clone() for q in params]
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        got = trainer.eval_loss(*batches[1])
    assert torch.equal(got, want) and not got.requires_grad
    assert all((g is None and q.grad is None) or torch.equal(g, q.grad) for g, q in zip(grads, params))


def test_dropout_or_jitter_keeps_evaluation_graphs_of_its_own():
    hf, _ = _layers(1)
    hf.attention_dropout = 0.1
    assert not dropout_free(hf)


def test_compile_cache_folder_is_the_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    model = {"model": {"config": {"hidden_size": 32}}}
    assert parse(model).performance.compile_cache == "~/.cache/ds_async/compile"
    use_compile_cache(parse(model).performance.compile_cache)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "ds_async" / "compile")
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    assert cache_dir() == str(tmp_path / ".cache" / "ds_async" / "compile")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".cache" / "ds_async" / "compile" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    use_compile_cache(None)  # null: torch's own location
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    with pytest.raises(ConfigError, match="ds_async.performance.data_reader"):
        parse({**model, "performance": {"data_reader": "thread"}})


@pytest.mark.parametrize("world, stages", [(1, 1), (4, 2), (6, 3)])
def test_reader_processes_start_on_the_first_and_last_stages(world, stages):
    """``builder.start_reader``, which ``launch/train.py`` calls before the trainer's imports: with
    ``performance.data_reader: process`` a rank of the first or last stage (DeepSpeed's layout: stages outermost)
    gets a reader process and a middle stage none; ``auto`` on CPU reads in the training process (none); a world that
    the stages do not divide gets none (the job's own checks refuse it)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    model = {"model": {"config": {"hidden_size": 32}}, "pipeline_stages": stages}
    cfg = parse({**model, "performance": {"data_reader": "process"}})
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=world // stages)
    readers = [start_reader(cfg, rank, world, "cpu") for rank in range(world)]
    try:
        reads = [topology.get_coord(rank).pipe in (0, stages - 1) for rank in range(world)]
        assert [r is not None for r in readers] == reads
        assert (stages > 2) == (not all(reads))
    finally:
        for reader in readers:
            if reader is not None:
                reader.close()
    assert start_reader(parse(model), 0, world, "cpu") is None
    if stages > 1:
        assert start_reader(cfg, 0, world + 1, "cpu") is None


@pytest.mark.parametrize("stages", [2, 1])
def test_a_fresh_or_resumed_runs_reader_begins_before_the_model_builds(tmp_path, stages):
    """With its training stream in a reader process, a run hands the reader its stream and position before the
    model's build, so the first chunk is read meanwhile: a fresh run's position is the stream's start, a resumed run's
    the checkpoint's, read from this rank's state file before anything is built. On two ranks:
    two stages, or two replicas of one (each reader opens its own replica's stream, named before the engine's grid
    exists; the set-up checks the grid agrees). test_checkpoint's reader case checks a resume bit-equal. Fresh or
    resumed, the start-up reads of the data run on a thread of their own while the model builds."""
    from distributed import run_job

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "ds_async": {"model": {"config": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                                                "num_hidden_layers": 2, "num_attention_heads": 2,
                                                "num_key_value_heads": 2, "max_position_embeddings": 32}},
                           "tokenizer": "train:300", "pipeline_stages": stages,
                           "data": {"train": "gensim:lee", "seq_len": 32, "shuffle_buffer": 20},
                           "train": {"steps": 4}, "eval": {"every": 0},
                           "performance": {"data_reader": "process"},
                           "logging": {"dir": str(tmp_path / "runs"), "run_name": "early", "progress": False,
                                       "plot": False},
                           "checkpoint": {"every": 2, "final": True}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    gathered = run_job(2, "reader_start", tmp_path / "job", config=str(path), steps=2)["gathered"]
    assert [g["fresh"] for g in gathered] == [["begin", "build"]] * 2
    assert [g["resumed"] for g in gathered] == [["begin", "build"]] * 2
    assert [g["reads"] for g in gathered] == [["ds_async-sources beside the build"] * 2] * 2


def test_the_command_line_exits_at_once_after_its_summary(tmp_path):
    """``python launch/train.py`` with its training stream in a reader process ends within a second or two of its
    summary line: the reader stops at once, evaluations read no stream (their micro-batches are read at start), and
    the process ends without the interpreter's teardown (its exit handlers waited out arrow's grace period and
    Inductor's compile workers). Its start is accounted for: the phases from launch to the end of step 1, in order,
    adding up to no more than the time to the line that states them."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    from distributed import job_env

    root = Path(__file__).resolve().parents[1]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "ds_async": {"model": {"config": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                                "num_key_value_heads": 2, "max_position_embeddings": 32}},
                           "tokenizer": "train:300", "pipeline_stages": 1,
                           "data": {"train": "gensim:lee", "validation": "gensim:lee", "seq_len": 32,
                                    "shuffle_buffer": 20},
                           "train": {"steps": 3}, "eval": {"every": 0, "batches": 2},
                           "performance": {"data_reader": "process"},
                           "logging": {"dir": str(tmp_path / "runs"), "run_name": "exit", "progress": False,
                                       "plot": False},
                           "checkpoint": {"final": False}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # No launcher's variables (a test before this one in the same process may have left its one-process group's)
    env = {k: v for k, v in job_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    launched = time.time()
    proc = subprocess.Popen([sys.executable, str(root / "launch" / "train.py"), "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    seen, started, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ds_async summary:"):
            seen = time.monotonic()
        if line.startswith("step 1: started in "):
            started = time.time()
    assert proc.wait(timeout=300) == 0, "".join(lines[-30:])
    assert seen is not None, "".join(lines[-30:])
    assert time.monotonic() - seen < 2.0
    spans = json.loads((tmp_path / "runs" / "exit" / "summary.json").read_text())["start_s"]
    assert list(spans) == ["imports", "process group", "model", "engine", "data", "first step"]
    assert all(v >= 0 for v in spans.values()) and spans["imports"] > 0
    assert started is not None and 0 < sum(spans.values()) <= started - launched + 0.05
    assert any(line.strip().startswith("start ") and "started in" in line for line in lines)


def test_the_emulation_keeps_its_compiled_code_in_the_configs_cache(tmp_path, monkeypatch):
    """``performance.compile_cache`` is the emulation's too: a run of it compiles the same layers and Muon passes as
    the pipeline, and the second run of a config should load them."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "ds_async": {"model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                             "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 300,
                                             "max_position_embeddings": 16}},
                        "tokenizer": "train:300", "pipeline_stages": 1,
                        "performance": {"fused_optimizer_step": True, "compile_cache": str(tmp_path / "cc")},
                        "data": {"train": "python:docs", "validation": None, "seq_len": 16},
                        "train": {"steps": 1}, "logging": {"dir": str(tmp_path / "runs"), "run_name": "e"}}}
    path = tmp_path / "e.json"
    path.write_text(json.dumps(cfg))
    Emulation(str(path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc")


def _hf_init(layer: torch.nn.Module, std: float, seed: int) -> dict[str, torch.Tensor]:
    """The reference: HF's init rule drawn from one generator per layer, parameter by parameter in module order."""
    gen, want = torch.Generator().manual_seed(seed), {}
    for prefix, sub in layer.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if type(sub).__name__.endswith("RMSNorm"):
                want[key] = torch.ones_like(p) if name == "weight" else torch.zeros_like(p)
            else:
                want[key] = torch.randn(p.shape, generator=gen) * std
    return want


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_layers_built_on_threads_have_the_weights_of_hf_init(family):
    """``build_all`` builds seeded layers on threads; each layer's weights are still HF's rule from its own
    ``(seed, index)`` generator, and transformers' no-init patch of torch's init functions is undone afterwards."""
    from transformers import MixtralConfig

    cfg = parse({"model": {"config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "num_hidden_layers": 5, "vocab_size": 64}}})
    hf = model_config(cfg) if family == "llama" else MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2)
    module = llama if family == "llama" else mixtral
    normal, init_weights = torch.nn.init.normal_, torch.nn.init.kaiming_uniform_
    layers = llama.build_all(module.layer_specs(hf, seed=7), workers=4)
    assert torch.nn.init.normal_ is normal and torch.nn.init.kaiming_uniform_ is init_weights
    assert len(layers) == 7
    for index, layer in enumerate(layers):
        want = _hf_init(layer, hf.initializer_range, 7 * 100_003 + index)
        got = layer.state_dict()
        assert want.keys() <= got.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (index, key)


def test_the_start_clock_splits_the_time_since_launch_into_its_marks():
    """``imports`` runs from the process's launch to the clock's creation; each mark's span from the one before;
    together they are the time from launch to the last mark."""
    import time

    clock = StartClock()
    time.sleep(0.05)
    clock.mark("model")
    time.sleep(0.02)
    clock.mark("first step")
    spans = clock.spans()
    assert list(spans) == ["imports", "model", "first step"]
    assert spans["model"] >= 0.04 and spans["first step"] >= 0.01
    assert abs(sum(spans.values()) - process_age()) < 0.05
