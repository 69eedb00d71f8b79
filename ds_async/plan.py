"""Will it fit? The memory of every pipeline stage, the schedule's bubble and compute-balanced boundaries of a
ds_async job, before launching it.

    python -m ds_async.plan CONFIG.json [--gpus N] [--gpu-memory GiB] [--json]

Contract. Reads the DeepSpeed JSON that ``launch/train.py`` reads, with the same checks (``ds_async.config.load``,
``check_batch``, ``models.model_config``, the partition of ``models.partition.stage_bounds``); a config error prints
``ds_async: error: <key>: ...`` and exits 1. ``--gpus`` is the world size (default: ``pipeline_stages`` x the
replicas ``train_batch_size`` implies, else ``pipeline_stages``), ``--gpu-memory`` the card in GiB (default: this
machine's GPU, else 80). The model's layers are built on the ``meta`` device (no memory, no init), so parameter
counts are exact: embedding, each decoder layer, head, Mixtral's expert stacks (``active`` counts the ``top_k`` of
``E`` experts a token uses). Prints a table per stage (``--json``: the same as one JSON object) and exits 0 whether
or not it fits; ``fits`` says which.

What each row counts, the byte model per parameter and per token, the peak over time and how the plan compares
with measured GPU peaks (within 10% on every stage of every measured row): ``docs/DESIGN.md``, "Will it fit?",
whose formulas :mod:`ds_async.memory_model` implements and ``tests/test_plan.py`` holds to real tensors on CPU; here
the config becomes a job and a layer list, and the byte model's figures a plan per stage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field

import torch

from . import config as cfgmod
from .config import (ConfigError, check_batch, data_parallel_degree, gradient_clipping, parse_optimizer,
                     recomputed_layers)
from .flops import layer_flops_per_token
from .memory_model import (CONTEXT_GIB, GIB, STATE_BYTES, Job, Layer, Stage, activation_memory, bubble,
                           graph_instances, grads_wait_on_master, in_flight, state_memory, step_phase,
                           step_workspace)
from .models import FAMILIES, check_seq_len, model_config
from .models.partition import stage_bounds
from .optim.muon import SPLIT_GATE_UP, check_split_gate_up
from .optim.roles import fused_gate_up, param_roles
from .pipe.version_rule import get


def job_of(ds_config: dict, cfg, world: int):
    """The :class:`Job` of a parsed config at world size ``world``; raises ``ConfigError`` naming the key."""

    try:
        get(cfg.schedule).check_engine()  # the planner plans what the engine runs
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _, mbs, gas = check_batch(ds_config, cfg, world)
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError("fp16.enabled: ds_async trains in bf16, torch_autocast or fp32")
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    autocast = bool((ds_config.get("torch_autocast") or {}).get("enabled"))
    if bf16 and autocast:
        raise ConfigError("torch_autocast.enabled: bf16 and torch_autocast are both enabled; choose one")
    block = ds_config.get("optimizer")
    if not isinstance(block, dict) or "type" not in block:
        raise ConfigError("optimizer: the planner needs the optimizer block (type and params)")
    spec = parse_optimizer(block, cfg.correction)
    kind, params = spec.kind, spec.params
    if kind not in STATE_BYTES:
        raise ConfigError(f"optimizer.type: the planner knows {sorted(STATE_BYTES)}, not {spec.type!r}")
    split = params.get("split_gate_up", SPLIT_GATE_UP) if kind == "muon" else False
    try:
        check_split_gate_up(split)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    path = "master-weights" if bf16 and spec.ds_async_builds else "deepspeed-bf16" if bf16 else "plain"
    zero = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if zero >= 2:
        raise ConfigError(f"zero_optimization.stage: {zero}; pipelines run ZeRO stage 0 or 1")
    # DeepSpeed accumulates a pipeline's gradients in the model's dtype unless data_types says otherwise.
    accum = str((ds_config.get("data_types") or {}).get("grad_accum_dtype") or "bf16").lower()
    return Job(family=cfg.model.family, stages=cfg.pipeline_stages, replicas=world // cfg.pipeline_stages,
               micro_batch=mbs, micro_batches=gas, seq_len=cfg.data.seq_len, schedule=cfg.schedule,
               optimizer=kind, sgd_momentum=bool(params.get("momentum", 0)), correction=cfg.correction.type,
               precision="bf16" if bf16 else "autocast" if autocast else "fp32", path=path, zero=zero,
               grad_accum_bytes=2 if accum in ("bf16", "bfloat16") else 4,
               fused_step=cfg.performance.fused_optimizer_step,
               checkpoint_interval=cfg.performance.activation_checkpoint_interval,
               recompute=tuple(recomputed_layers(cfg.performance, cfg.pipeline_stages))
               if cfg.performance.activation_checkpoint_layers else (),
               loss_chunk=cfg.performance.loss_chunk, compiled=bool(cfg.performance.compile),
               clip=gradient_clipping(ds_config), split_gate_up=split, fp8=cfg.performance.fp8 is not None,
               cuda_graphs=cfg.performance.cuda_graphs)


def layers_of(hf_config, family: str, seq_len: int) -> list[Layer]:
    """``[embedding, decoder x L, head]`` of the model, built on the meta device as the stages build them."""

    specs = FAMILIES[family].layer_specs(hf_config)
    with torch.device("meta"):
        modules = [spec.build() for spec in specs]
    flops = layer_flops_per_token(hf_config, seq_len)
    experts = getattr(hf_config, "num_local_experts", None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    out = []
    for i, (module, f) in enumerate(zip(modules, flops)):
        roles = param_roles(module)
        params = [p for p in module.parameters() if p.requires_grad]
        by_role: dict[str, int] = {}
        for p in params:
            by_role[roles[p]] = by_role.get(roles[p], 0) + p.numel()
        total = sum(p.numel() for p in params)
        stacked = sum(p.numel() for p in params if p.ndim == 3)  # expert stacks [E, rows, cols]
        active = total - stacked + (stacked * top_k // experts if experts else stacked)
        kind = "embedding" if i == 0 else "head" if i == len(modules) - 1 else "decoder"
        fused = {id(p) for p in fused_gate_up(module)}
        out.append(Layer(kind, total, active, by_role, tuple(tuple(p.shape) for p in params),
                         tuple(roles[p] for p in params), tuple(id(p) in fused for p in params), f))
    return out


def bounds_of(cfg, layers: list[Layer]) -> list[int]:
    """The stage boundaries the engine uses (``models.partition.stage_bounds`` over parameter counts)."""

    class Counted(torch.nn.Module):  # stage_bounds counts each layer's trainable parameters
        def __init__(self, n):
            super().__init__()
            self.p = torch.nn.Parameter(torch.empty(n, device="meta"))

    return [int(b) for b in stage_bounds(cfg.partition.method, [Counted(layer.params) for layer in layers],
                                         cfg.pipeline_stages, cfg.partition.boundaries)]


# ---------------------------------------------------------------------------------------------------- the plan

def stage_plan(job: Job, hf, layers: list[Layer], bounds: list[int], stage: int, gpu_bytes: int) -> Stage:
    mine = layers[bounds[stage]:bounds[stage + 1]]
    out = Stage(stage, (bounds[stage], bounds[stage + 1]), sum(x.params for x in mine),
                sum(x.active for x in mine), sum(x.flops for x in mine))
    for key, value in state_memory(job, mine, stage).items():
        setattr(out, key, value)
    out.step_workspace = step_workspace(job, mine)
    per, working = activation_memory(job, hf, [x.kind for x in mine], stage)
    out.in_flight = in_flight(job, stage)
    out.activations_per_micro_batch = per
    out.activations = out.in_flight * per + working
    out.at_step, between = step_phase(job, stage)
    instances = graph_instances(job, stage)
    if instances:  # the in-flight micro-batches live in the instances' pools; outside them only the transient rest
        out.graphs = instances * (per + working + job.weight_bytes * out.params)
        out.activations, per = working, 0
    if between and grads_wait_on_master(job):  # the next batch's gradients, on a version slot, beside the waiting
        out.grads_next = job.weight_bytes * out.params
    out.context = int(CONTEXT_GIB * GIB)
    state = sum(getattr(out, k) for k in STATE_ROWS)
    passes = out.activations + out.grads_next
    step = out.at_step * per + out.step_workspace + out.grads_next
    out.peak_phase = "passes" if passes >= step else "step"
    out.total = state + max(passes, step) + out.context
    out.fits = out.total <= gpu_bytes
    return out


STATE_ROWS = ("weights", "versions", "grads", "masters", "optimizer", "correction", "graphs")
"""A stage's state rows (``graphs``: CUDA graph pools, held all run); its total is the state, the larger of the
passes' peak (activations, grads_next) and the
step's (step_workspace, ``at_step`` micro-batches' activations, grads_next), and the context."""

def balanced_bounds(costs: list[float], stages: int) -> list[int]:
    """Boundaries of the contiguous split of ``costs`` into ``stages`` non-empty parts with the smallest largest
    part (ties: the earliest boundaries)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][j]: first j layers in k parts
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-9 * abs(value):
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


@dataclass
class Plan:
    config: str
    family: str
    world: int
    stages: int
    replicas: int
    micro_batch: int
    micro_batches: int
    seq_len: int
    schedule: str
    optimizer: str
    correction: str
    precision: str
    optimizer_path: str
    zero: int
    checkpoint_interval: int
    loss_chunk: int
    cuda_graphs: bool
    params: int
    active_params: int
    gpu_memory: int
    bubble: float
    bubble_1f1b: float
    min_micro_batches: int
    boundaries: list[int]
    stage_list: list[Stage] = field(default_factory=list)
    balanced_boundaries: list[int] = field(default_factory=list)
    balanced_fits: bool = False
    balanced_peak: int = 0
    flops_imbalance: float = 0.0
    balanced_flops_imbalance: float = 0.0
    recompute: list[int] = field(default_factory=list)
    suggested_recompute: list[int] | None = None
    suggested_recompute_peak: int = 0
    suggested_recompute_imbalance: float = 0.0
    fits: bool = False


def imbalance(layers: list[Layer], bounds: list[int], recompute: list[int] | None = None) -> float:
    """Largest stage's FLOPs over the mean stage's (1 = perfectly balanced); with ``recompute`` (decoder layers per
    stage run forward twice: a third more of their training FLOPs) the largest stage's over the mean without."""
    parts = [sum(x.flops for x in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    mean = sum(parts) / len(parts)
    if recompute:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            decoders = [x for x in layers[a:b] if x.kind == "decoder"][:recompute[s]]
            parts[s] += sum(x.flops for x in decoders) / 3
    return max(parts) / mean


RECOMPUTE_HEADROOM = 0.9
"""The share of the card the suggested recompute stays under: the planner is within 10% of measured peaks."""

def suggest_recompute(job: Job, hf, layers: list[Layer], bounds: list[int], gpu_bytes: int
                      ) -> tuple[list[int], int] | None:
    """The fewest decoder layers each stage recomputes (``activation_checkpoint_layers``) for every stage to stay
    under ``RECOMPUTE_HEADROOM`` of the card, with the largest stage total; ``None`` if recomputing all does not.
    Without CUDA graphs, which a recomputing stage cannot use."""
    base = dataclasses.replace(job, checkpoint_interval=0, cuda_graphs=False)
    counts, peak = [], 0
    for stage, (a, b) in enumerate(zip(bounds, bounds[1:])):
        decoders = sum(1 for x in layers[a:b] if x.kind == "decoder")
        for k in range(decoders + 1):
            trial = dataclasses.replace(base, recompute=tuple(k if s == stage else 0 for s in range(job.stages)))
            total = stage_plan(trial, hf, layers, bounds, stage, gpu_bytes).total
            if total <= RECOMPUTE_HEADROOM * gpu_bytes:
                counts.append(k)
                peak = max(peak, total)
                break
        else:
            return None
    return counts, peak


def plan(config_path: str, gpus: int | None = None, gpu_memory_gib: float | None = None,
         overrides: dict | None = None) -> Plan:
    """The plan of the job at ``config_path`` with ``overrides`` set (dotted key -> value, the jobs' ``--set``; see
    the module docstring); raises ``ConfigError`` naming the key."""

    ds_config, cfg = cfgmod.load(config_path, overrides)
    if gpus is None:
        gpus = cfg.pipeline_stages * data_parallel_degree(ds_config)
    if gpus < 1:
        raise cfgmod.ConfigError(f"--gpus: must be >= 1, got {gpus}")
    job = job_of(ds_config, cfg, gpus)
    hf = model_config(cfg)
    check_seq_len(cfg, hf)
    layers = layers_of(hf, cfg.model.family, cfg.data.seq_len)
    bounds = bounds_of(cfg, layers)
    if job.recompute:
        cfgmod.check_recompute(list(job.recompute), [sum(1 for x in layers[a:b] if x.kind == "decoder")
                                                     for a, b in zip(bounds, bounds[1:])])
    gpu_bytes = int((gpu_memory_gib if gpu_memory_gib is not None else default_gpu_gib()) * GIB)
    stages = [stage_plan(job, hf, layers, bounds, s, gpu_bytes) for s in range(job.stages)]
    balanced = balanced_bounds([x.flops for x in layers], job.stages)
    trial = [stage_plan(job, hf, layers, balanced, s, gpu_bytes) for s in range(job.stages)]
    rule = get(job.schedule)
    suggested = suggest_recompute(job, hf, layers, bounds, gpu_bytes)
    return Plan(config=config_path, family=job.family, world=gpus, stages=job.stages, replicas=job.replicas,
                micro_batch=job.micro_batch, micro_batches=job.micro_batches, seq_len=job.seq_len,
                schedule=job.schedule, optimizer=job.optimizer, correction=job.correction, precision=job.precision,
                optimizer_path=job.path, zero=job.zero, checkpoint_interval=job.checkpoint_interval,
                loss_chunk=job.loss_chunk, cuda_graphs=job.cuda_graphs, params=sum(x.params for x in layers),
                active_params=sum(x.active for x in layers), gpu_memory=gpu_bytes,
                bubble=bubble(job.schedule, job.stages, job.micro_batches),
                bubble_1f1b=bubble("1f1b", job.stages, job.micro_batches),
                min_micro_batches=rule.min_micro_batches(job.stages), boundaries=bounds, stage_list=stages,
                balanced_boundaries=balanced, balanced_fits=all(s.fits for s in trial),
                balanced_peak=max(s.total for s in trial), flops_imbalance=imbalance(layers, bounds),
                balanced_flops_imbalance=imbalance(layers, balanced), recompute=list(job.recompute),
                suggested_recompute=suggested[0] if suggested else None,
                suggested_recompute_peak=suggested[1] if suggested else 0,
                suggested_recompute_imbalance=imbalance(layers, bounds, suggested[0]) if suggested else 0.0,
                fits=all(s.fits for s in stages))


def default_gpu_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return 80.0


# ---------------------------------------------------------------------------------------------------- output

def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _g(n: int) -> str:
    return f"{n / GIB:.2f}"


PATHS = {"deepspeed-bf16": "bf16 weights, DeepSpeed's bf16 optimizer (flat fp32 masters and gradient buffer)",
         "master-weights": "bf16 weights, ds_async MasterWeights (fp32 masters per tensor)",
         "plain": "fp32 weights and state"}


def render(p: Plan) -> str:
    rows = [f"ds_async plan: {p.config}",
            f"model     {p.family}, {_b(p.params)} parameters ({_b(p.active_params)} active), "
            f"{p.boundaries[-1]} layers (embedding + {p.boundaries[-1] - 2} decoder + head), seq {p.seq_len}",
            f"world     {p.world} GPUs = {p.stages} stages x {p.replicas} replica(s); micro-batch {p.micro_batch} x "
            f"{p.seq_len} tokens, m = {p.micro_batches}",
            f"precision {p.precision}: {PATHS[p.optimizer_path] if p.precision != 'autocast' else 'fp32 weights, bf16 autocast'}"
            f"; optimizer {p.optimizer}, correction {p.correction}, ZeRO {p.zero}",
            f"memory    {checkpointing(p)}, loss chunk {p.loss_chunk or '-'}; "
            f"GiB per GPU, card {p.gpu_memory / GIB:.1f} GiB", ""]
    head = ("stage", "layers", "params", "weights", "versions", "grads", "masters", "optim", "correct", "graphs",
            "step",
            "activ", "x", "next", "peak", "context", "total", "fits")
    table = [head]
    for s in p.stage_list:
        table.append((str(s.stage), f"{s.layers[0]}-{s.layers[1] - 1}", _b(s.params), _g(s.weights),
                      _g(s.versions), _g(s.grads), _g(s.masters), _g(s.optimizer), _g(s.correction),
                      _g(s.graphs), _g(s.step_workspace), _g(s.activations), str(s.in_flight), _g(s.grads_next),
                      f"{s.peak_phase}" + (f" ({s.at_step})" if s.peak_phase == "step" else ""), _g(s.context), _g(s.total),
                      "yes" if s.fits else "NO"))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    rows += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    rule_note = (f"{p.bubble:.1%} (steady state; a warm-up and drain only at drains); 1f1b at this m: "
                 f"{p.bubble_1f1b:.1%}" if p.bubble == 0 else f"{p.bubble:.1%} = (p-1)/(m+p-1)")
    rows += ["", "(x: micro-batches in flight; activ = x per-micro-batch activations + one working set; next: the "
             "next batch's gradients beside the waiting ones; total = the state + the larger of the passes (activ + "
             "next) and the step (step + the activations of the micro-batches held then, in brackets, + next) + "
             "context; graphs: the CUDA graph instances' pools, each a micro-batch's activations, a working set and "
             "a gradient buffer per parameter)",
             f"bubble    {p.schedule}: {rule_note}",
             f"smallest m {p.min_micro_batches} ({p.schedule}); memory does not grow with m >= p",
             f"balance   boundaries {p.boundaries}: largest stage {p.flops_imbalance:.3f}x the mean FLOPs",
             f"suggest   \"partition\": {{\"method\": \"explicit\", \"boundaries\": {p.balanced_boundaries}}} "
             f"({p.balanced_flops_imbalance:.3f}x; peak {p.balanced_peak / GIB:.1f} GiB, "
             f"{'fits' if p.balanced_fits else 'does NOT fit'})",
             f"recompute {recompute_note(p)}",
             f"fits      {'yes' if p.fits else 'NO'}: peak {max(s.total for s in p.stage_list) / GIB:.1f} GiB of "
             f"{p.gpu_memory / GIB:.1f} GiB"]
    return "\n".join(rows)


def checkpointing(p: Plan) -> str:
    if p.recompute:
        return f"recompute {p.recompute} decoder layer(s) per stage"
    return f"checkpoint every {p.checkpoint_interval or '-'} layer(s)"


def recompute_note(p: Plan) -> str:
    if p.suggested_recompute is None:
        return f"recomputing every decoder layer does not keep a stage under {RECOMPUTE_HEADROOM:.0%} of the card"
    without = " and cuda_graphs false, which recompute excludes" if p.cuda_graphs else ""
    return (f"suggest \"activation_checkpoint_layers\": {p.suggested_recompute}{without} (the fewest per stage "
            f"that stay under {RECOMPUTE_HEADROOM:.0%} of the card: peak {p.suggested_recompute_peak / GIB:.1f} GiB; "
            f"largest stage {p.suggested_recompute_imbalance:.3f}x the mean FLOPs with the recompute)")


def to_json(p: Plan) -> dict:
    out = asdict(p)
    out["stages_detail"] = out.pop("stage_list")
    return out


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m ds_async.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="DeepSpeed JSON with a \"ds_async\" section")
    parser.add_argument("--gpus", type=int, default=None, help="world size (default: stages x replicas)")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: this GPU, else 80)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    cfgmod.add_set_argument(parser)
    args = parser.parse_args(argv)
    try:
        result = plan(args.config, args.gpus, args.gpu_memory, dict(args.sets))
    except (ConfigError, ValueError) as e:
        print(f"ds_async: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(result), indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
