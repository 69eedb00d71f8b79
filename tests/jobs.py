"""Multi-process jobs for the tests, run under torchrun by ``tests/distributed.py``.

    python -m torch.distributed.run --nproc_per_node N tests/jobs.py JOB OUT_DIR '{"kwarg": ...}'
    python -m torch.distributed.run --nproc_per_node N tests/jobs.py serve FOLDER  # the tests' job server

Every job but ``checkpoint_groups`` (the checkpoint folder protocol over process groups) builds a real ds_async
pipeline engine (DeepSpeed, gloo on CPU); ``trainer_runs`` runs whole jobs of ``launch/train.py``'s trainer. The
rank that holds the result writes ``OUT_DIR/result.pt``; the first data-parallel replica of each stage writes
``params_stage<s>.pt`` (its tensors under Hugging Face names) so runs with different partitions compare by name.
"""
from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as tdist

from ds_async import config as cfgmod
from ds_async import data
from ds_async import init_distributed, initialize, prefetch, trainer, trainer_setup
from ds_async.builder import destroy_groups
from ds_async.checkpoint import folder
from ds_async.models import build_pipeline, export_hf, hf_state_dict, model_config

import ckpt_jobs

TINY_LLAMA = {"vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5}


def ds_config(mbs: int, gas: int, optimizer: dict | None = None, clip: float = 1.0, **extra) -> dict:
    opt = optimizer or {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}}
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 9,
            "optimizer": opt, "gradient_clipping": clip, **extra}


CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def global_micro_batches(seed: int, seq_len: int, mbs: int, count: int) -> list:
    """The run's whole data, identical on every rank: ``count`` micro-batches (input_ids, labels) of real text
    (the shared corpus' Wikipedia validation split, tokenized with its 8k BPE, shuffled by ``seed``)."""
    stream = data.load_text_stream(str(CORPUS / "enwiki-validation.parquet"), "validation")
    tokenizer = data.load_tokenizer(str(CORPUS / "tokenizers" / "bpe8192.json"))
    packed = data.PackedBatches(stream, tokenizer, seq_len, mbs, seed=seed, shuffle_buffer=50, repeat=False)
    return list(itertools.islice(packed, count))


def rank_stream(batches: list, step_count: int, gas: int, dp_rank: int, dp_world: int):
    """This replica's share of each step: step t uses global micro-batches [t*G, (t+1)*G), G = gas * dp."""
    g = gas * dp_world
    for t in range(step_count):
        yield from batches[t * g + dp_rank * gas: t * g + (dp_rank + 1) * gas]


def _engine(stages: int, mbs: int, gas: int, schedule: str = "1f1b", model: dict | None = None,
            partition: dict | None = None, seed: int = 1234, stock: bool = False,
            correction: dict | None = None, performance: dict | None = None, stats_every: int = 0, **ds_extra):
    """A ds_async engine, or with ``stock=True`` DeepSpeed's own PipelineEngine via ``deepspeed.initialize``."""
    section = {"model": model or {"config": TINY_LLAMA}, "pipeline_stages": stages, "schedule": schedule,
               "partition": partition or {"method": "uniform"}, "train": {"steps": 1}, "seed": seed,
               "correction": correction or {"type": "none"}, "performance": performance or {}}
    cfg = cfgmod.parse(section)
    hf_config = model_config(cfg)
    module, config = build_pipeline(cfg, hf_config), ds_config(mbs, gas, **ds_extra)
    if stock:
        import deepspeed
        engine = deepspeed.initialize(model=module, config=config,
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])[0]
        engine.is_reporting_rank = engine.is_last_stage() and engine.grid.data_parallel_id == 0
        return engine, hf_config
    return initialize(module, config, schedule=schedule, correction=cfg.correction,
                      fused_optimizer_step=cfg.performance.fused_optimizer_step, stats_every=stats_every), hf_config


def _save_params(engine, out: Path) -> None:
    if engine.grid.data_parallel_id == 0:
        torch.save({k: v.detach().clone() for k, v in hf_state_dict(engine.module).items()},
                   out / f"params_stage{engine.stage_id}.pt")


def job_logits(out: Path, hf_dir: str, stages: int, input_ids: list, partition: dict | None = None) -> None:
    """Forward ``input_ids`` through the pipeline built from a HF directory; save the logits."""
    ids = torch.tensor(input_ids)
    engine, _ = _engine(stages, ids.shape[0], 1, model={"path": hf_dir}, partition=partition)
    _, logits = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1, bcast_loss=False)
    if engine.is_reporting_rank:
        torch.save({"logits": logits}, out / "result.pt")


def job_train(out: Path, stages: int, steps: int, mbs: int, gas: int, seq_len: int = 32, data_seed: int = 0,
              schedule: str = "1f1b", optimizer: dict | None = None, clip: float = 1.0, export: bool = False,
              stock: bool = False, correction: dict | None = None, stats: bool = False,
              deepspeed_bf16_step: bool = False, clip_at_hand_over: bool | None = None,
              drop_grad_at: int | None = None, count_calls: bool = False, **ds_extra) -> None:
    """Train ``steps`` steps on fixed data; save per-step losses and final parameters.

    ``deepspeed_bf16_step``: undo the engine's swap of DeepSpeed's bf16 optimizer class, so DeepSpeed's own step
    (and its zeroing of the fp32 gradients after every step) runs: the reference for ds_async's.
    ``clip_at_hand_over``: override the engine's choice of clipping bf16 gradients as it hands them over.
    ``drop_grad_at``: in that batch, the stage's first parameter gets no gradient (as if unused in the batch).
    ``count_calls``: ``calls_stage<s>.json`` lists how often each of the stage's layers ran forward (a recomputed
    layer runs twice per micro-batch)."""
    engine, hf_config = _engine(stages, mbs, gas, schedule=schedule, optimizer=optimizer, clip=clip, stock=stock,
                                correction=correction, stats_every=steps if stats else 0, **ds_extra)
    if deepspeed_bf16_step:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        from ds_async.pipe.steps import StepPlan
        engine.optimizer.__class__ = BF16_Optimizer
        # DeepSpeed's step, computing its own norm, on the gradients handed to its buffers by addition.
        engine.step_plan = StepPlan(engine.module, own_norm=True, bf16_optimizer=engine.optimizer)
    if clip_at_hand_over is not None:
        engine.step_plan.clip_at_hand_over = clip_at_hand_over
    if drop_grad_at is not None:
        gather = engine.versions.gather_grads

        def gather_then_drop():
            gather()
            if engine.global_steps == drop_grad_at:  # the batch being reduced: its step has not run yet
                engine.versions.entries[0][2].grad = None
        engine.versions.gather_grads = gather_then_drop
    dp_rank, dp_world = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    batches = global_micro_batches(data_seed, seq_len, mbs, steps * gas * dp_world)
    it = rank_stream(batches, steps, gas, dp_rank, dp_world)
    if not stock:
        engine.drain_after(steps - 1)
    calls = [0] * len(engine.module.forward_funcs)
    if count_calls:
        for i, layer in enumerate(engine.module.forward_funcs):
            layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    if stock:  # DeepSpeed's own engine: its train_batch returns the loss alone
        losses = [engine.train_batch(it) for _ in range(steps)]
    else:
        reports = [engine.train_step(it) for _ in range(steps)]
        losses = [r.loss for r in reports]
    if count_calls and engine.grid.data_parallel_id == 0:
        (out / f"calls_stage{engine.stage_id}.json").write_text(json.dumps(calls))
    optimizer_stats = engine.optimizer_stats(reports[-1]) if stats else None  # collective: every rank
    _save_params(engine, out)
    master = getattr(engine.optimizer, "fp32_groups_flat_partition", None)  # DeepSpeed's bf16 optimizer
    if hasattr(engine.optimizer, "master_of"):  # ds_async's MasterWeights, in the module's parameter order
        master = [engine.optimizer.master_of(p) for p in engine.module.parameters()]
    if master is not None and engine.grid.data_parallel_id == 0:
        torch.save(torch.cat([t.detach().float().flatten() for t in master]), out / f"master_stage{engine.stage_id}.pt")
    result = {"losses": torch.tensor([0.0 if x is None else x.item() for x in losses], dtype=torch.float64),
              "clip_at_hand_over": getattr(getattr(engine, "step_plan", None), "clip_at_hand_over", None)}
    if stats:
        result["optimizer_stats"] = optimizer_stats
    if export:
        export_hf(engine, str(out / "hf"), hf_config)
        ids = batches[0][0]
        _, result["logits"] = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1,
                                                bcast_loss=False)
        result["input_ids"] = ids
    if engine.is_reporting_rank:
        torch.save(result, out / "result.pt")


def job_moe(out: Path, hf_dir: str, stages: int, input_ids: list, labels: list, partition: dict | None = None,
            export: bool = False) -> None:
    """A Mixtral pipeline read from a HF directory, on one micro-batch: eval (loss, logits, aux), then one training
    step recording every parameter's gradient (``grads_stage<s>.pt``, by transformers-model name), then with
    ``export`` the HF export and the logits after the step."""
    ids, labels = torch.tensor(input_ids), torch.tensor(labels)
    engine, hf_config = _engine(stages, ids.shape[0], 1, model={"family": "mixtral", "path": hf_dir},
                                partition=partition)
    result = {}
    result["loss"], outputs = engine.eval_batch(iter([(ids, labels)]), return_logits=True, num_micro_batches=1,
                                                bcast_loss=False)
    if engine.is_last_stage():
        result["logits"], result["aux"] = outputs  # the head's (logits, load-balancing loss)
    grads = {}
    for layer in engine.module.forward_funcs:
        names = layer.hf_names()
        for name, p in layer.named_parameters():
            p.register_post_accumulate_grad_hook(lambda q, hf=names[name]: grads.__setitem__(hf, q.grad.clone()))
    result["train_loss"] = engine.train_batch(iter([(ids, labels)]))
    if engine.grid.data_parallel_id == 0:
        torch.save(grads, out / f"grads_stage{engine.stage_id}.pt")
    if export:
        export_hf(engine, str(out / "hf"), hf_config)
        _, outputs = engine.eval_batch(iter([(ids, labels)]), return_logits=True, num_micro_batches=1,
                                       bcast_loss=False)
        if engine.is_last_stage():
            result["logits_after"] = outputs[0]
    if engine.is_reporting_rank:
        torch.save(result, out / "result.pt")


def job_checkpoint_groups(out: Path) -> None:
    """Two process groups, ranks {0, 1} and {2, 3}, each write a checkpoint of its own at once (every rank one file
    holding what ``folder.gather`` gave it in its group); rank 0 saves what every rank's group gathered."""
    init_distributed()
    rank = tdist.get_rank()
    groups = [tdist.new_group([0, 1], backend="gloo"), tdist.new_group([2, 3], backend="gloo")]
    mine = groups[rank // 2]
    gathered = folder.gather(rank, mine)

    def write_files(tmp: Path) -> list[str]:
        (tmp / f"rank{rank}.json").write_text(json.dumps(gathered))
        return [f"rank{rank}.json"]

    folder.write(out / f"group{rank // 2}", 1, write_files, {"group": rank // 2}, group=mine)
    everyone = folder.gather(gathered, None)
    if rank == 0:
        torch.save({"gathered": everyone}, out / "result.pt")


def job_trainer_runs(out: Path, runs: list[dict]) -> None:
    """``tests/ckpt_jobs.py``'s trainer runs in turn (:func:`ckpt_jobs.run`); rank 0 saves each run's per-rank results
    as ``{name: [rank 0's, rank 1's, ...]}``."""
    ckpt_jobs.run(runs, out)
    tdist.barrier()  # every rank's results are written
    if tdist.get_rank() == 0:
        torch.save({spec["name"]: [json.loads((out / f"{spec['name']}.rank{r}.json").read_text())
                                   for r in range(tdist.get_world_size())] for spec in runs}, out / "result.pt")


def job_reader_start(out: Path, config: str, steps: int) -> None:
    """``config``'s trainer job (its training stream in a reader process) for ``steps`` steps, then resumed from its
    last checkpoint for one more: what this rank's set-up did first, the reader process's ``begin`` (its stream and
    position handed over) or the model's build; and where the start-up reads of the data ran (the build waits, up to
    a minute, for them to have begun: it sees them only if they run beside it). Rank 0 saves ``{"fresh": [...],
    "resumed": [...], "reads": [...]}`` per rank, ``reads`` one entry per run."""
    events: list[str] = []
    reads_seen: list[str] = []  # per run: the thread the reads ran on, as the build saw them
    reading: list[str] = []  # the thread of the reads under way
    began = threading.Event()
    begin, build = prefetch.ReaderProcess.begin, trainer_setup.build_pipeline
    read_sources = trainer_setup.TrainerSetup._read_sources

    def begin_seen(self, *args, **kwargs):
        events.append("begin")
        return begin(self, *args, **kwargs)

    def build_seen(*args, **kwargs):
        events.append("build")
        reads_seen.append(f"{reading[-1]} beside the build" if began.wait(60) else "not beside the build")
        return build(*args, **kwargs)

    def read_sources_seen(self):
        reading.append(threading.current_thread().name.rsplit("_", 1)[0])
        began.set()
        return read_sources(self)

    prefetch.ReaderProcess.begin, trainer_setup.build_pipeline = begin_seen, build_seen
    trainer_setup.TrainerSetup._read_sources = read_sources_seen
    try:
        trainer.train(config, max_steps=steps)
        fresh = list(events)
        events.clear()
        began.clear()
        trainer.train(config, max_steps=steps + 1, resume="latest")
    finally:
        prefetch.ReaderProcess.begin, trainer_setup.build_pipeline = begin, build
        trainer_setup.TrainerSetup._read_sources = read_sources
    gathered = folder.gather({"fresh": fresh, "resumed": list(events), "reads": reads_seen}, None)
    if tdist.get_rank() == 0:
        torch.save({"gathered": gathered}, out / "result.pt")


JOBS = {"logits": job_logits, "train": job_train, "moe": job_moe, "checkpoint_groups": job_checkpoint_groups,
        "trainer_runs": job_trainer_runs, "reader_start": job_reader_start}


def serve(folder: Path) -> None:
    """Run the jobs requested in ``folder`` one after another (``tests/distributed.py``'s ``_JobServer``): each as
    in a fresh process, with torch's default generator at its start-up seed, the job's folder as working directory
    and none of the process groups earlier jobs made. A failing job ends the process group; so does the test process
    going away."""
    rank, owner, seed = int(os.environ["RANK"]), int((folder / "owner").read_text()), torch.initial_seed()
    (folder / f"pid.rank{rank}").write_text(str(os.getpid()))
    for n in itertools.count():
        request = folder / f"request{n}.json"
        while not request.exists():
            if (folder / "stop").exists() or not os.path.exists(f"/proc/{owner}"):
                os._exit(0)
            time.sleep(0.02)
        spec = json.loads(request.read_text())
        out = Path(spec["out"])
        os.chdir(out)
        torch.manual_seed(seed)
        try:
            JOBS[spec["job"]](out, **spec["kwargs"])
        except BaseException:
            (folder / f"error{n}.rank{rank}.txt").write_text(traceback.format_exc())
            sys.stdout.flush()
            os._exit(1)
        gc.collect()
        tdist.barrier()  # every rank has written its files and is done with the job's groups
        # Every group but the default one: those the job made (a trainer run destroys its own). Left alone, each
        # keeps gloo threads that wake all the time, so a server's idle cost grew with every job it ran.
        destroy_groups(keep={tdist.group.WORLD})
        gc.collect()
        if rank == 0:
            (folder / f"done{n}").write_text("")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(Path(sys.argv[2]))
    else:
        name, out_dir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
        JOBS[name](out_dir, **kwargs)
