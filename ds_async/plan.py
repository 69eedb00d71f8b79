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
whose formulas the functions below implement and ``tests/test_plan.py`` holds to real tensors on CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import asdict, dataclass, field

import torch

from . import config as cfgmod
from .config import (ConfigError, check_batch, data_parallel_degree, gradient_clipping, parse_optimizer,
                     recomputed_layers)
from .flops import layer_flops_per_token
from .models import FAMILIES, check_seq_len, model_config
from .models.partition import stage_bounds
from .optim.muon import SPLIT_GATE_UP, check_split_gate_up, split_rows
from .optim.roles import fused_gate_up, param_roles
from .optim.sharded import partition_params
from .pipe import schedule as fs
from .pipe.version_rule import get

GIB = 2 ** 30
CONTEXT_GIB = 2.0
"""Allowance per GPU for the CUDA context (~0.5 GiB), cuBLAS and NCCL workspaces and allocator fragmentation."""

# ---------------------------------------------------------------------------------------------------- the job

@dataclass(frozen=True)
class Job:
    """What the config decides, resolved."""

    family: str
    stages: int
    replicas: int
    micro_batch: int
    micro_batches: int
    seq_len: int
    schedule: str
    optimizer: str            # lower-case type: adamw, adam, muon, lion, sgd
    sgd_momentum: bool
    correction: str           # none, ef, nesterov
    precision: str            # bf16, autocast, fp32
    path: str                 # deepspeed-bf16, master-weights, plain
    zero: int
    grad_accum_bytes: int     # DeepSpeed bf16 optimizer's gradient buffer, bytes per element
    fused_step: bool
    checkpoint_interval: int
    loss_chunk: int
    split_gate_up: bool       # Muon orthogonalises fused [gate; up] expert stacks as their halves
    recompute: tuple[int, ...] = ()  # activation_checkpoint_layers per stage (empty: none)
    compiled: bool = False    # performance.compile: inductor's saved tensors (see compiled_decoder_bytes)
    clip: float = 0.0         # gradient_clipping
    fp8: bool = False         # performance.fp8: the decoder layers' products in FP8 (fp8_workspace)

    @property
    def weight_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def act_bytes(self) -> int:      # matmul activations
        return 4 if self.precision == "fp32" else 2

    @property
    def residual_bytes(self) -> int:  # the residual stream and stage boundaries
        return 2 if self.precision == "bf16" else 4

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


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
               clip=gradient_clipping(ds_config), split_gate_up=split, fp8=cfg.performance.fp8 is not None)


# ---------------------------------------------------------------------------------------------------- layers

@dataclass(frozen=True)
class Layer:
    """One pipeline layer's parameters, counted on the meta device."""

    kind: str                           # embedding, decoder, head
    params: int
    active: int                         # parameters one token uses (top-k experts)
    by_role: dict[str, int]             # ds_async.optim.roles role -> parameters
    shapes: tuple[tuple[int, ...], ...]  # every trainable parameter, module order
    roles: tuple[str, ...]              # their roles
    gate_up: tuple[bool, ...]           # which are fused [gate; up] expert stacks (optim.roles.fused_gate_up)
    flops: float                        # training FLOPs per token


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


# ---------------------------------------------------------------------------------------------------- state

STATE_BYTES = {"adamw": 8, "adam": 8, "muon": None, "lion": 4, "sgd": None}


def state_bytes(job: Job, role: str) -> int:
    """fp32 optimizer state per parameter of ``role`` (corrections apart)."""
    if job.optimizer == "muon":
        return 4 if role == "matrix" else 8
    if job.optimizer == "sgd":
        return 4 if job.sgd_momentum else 0
    return STATE_BYTES[job.optimizer]


def correction_bytes(job: Job) -> int:
    return 0 if job.correction == "none" else 4


def sharded_by_tensor(job: Job) -> bool:
    """ds_async's ZeRO-1 (whole tensors per owner) rather than DeepSpeed's flat partitions."""
    return job.zero == 1 and job.replicas > 1 and job.path != "deepspeed-bf16" and (
        job.path == "master-weights" or job.optimizer == "muon")


def deepspeed_padded(n: int, replicas: int) -> int:
    """DeepSpeed's bf16 optimizer pads a flat group to a multiple of 2 x replicas elements."""
    align = 2 * replicas
    return -(-n // align) * align


def owned_state(job: Job, shapes, roles) -> tuple[int, int]:
    """(optimizer, correction) bytes of the busiest replica under ds_async's tensor-granular ZeRO-1."""

    tensors = [torch.empty(s, device="meta") for s in shapes]
    owners = partition_params(tensors, job.replicas)
    state, corr = [0] * job.replicas, [0] * job.replicas
    for t, role, owner in zip(tensors, roles, owners):
        state[owner] += t.numel() * state_bytes(job, role)
        corr[owner] += t.numel() * correction_bytes(job)
    busiest = max(range(job.replicas), key=lambda r: state[r] + corr[r])
    return state[busiest], corr[busiest]


@dataclass
class Stage:
    stage: int
    layers: tuple[int, int]              # [first, last + 1)
    params: int
    active: int
    flops: float
    weights: int = 0
    versions: int = 0
    grads: int = 0
    masters: int = 0
    optimizer: int = 0
    correction: int = 0
    step_workspace: int = 0
    activations: int = 0
    activations_per_micro_batch: int = 0
    in_flight: int = 0
    grads_next: int = 0                  # the next batch's gradients while this batch's wait for the step (2BW)
    at_step: int = 0                     # micro-batches held when the optimizer step is issued
    peak_phase: str = ""                 # passes or step: which phase sets the peak
    context: int = 0
    total: int = 0
    fits: bool = False


def state_memory(job: Job, layers: list[Layer], stage: int) -> dict[str, int]:
    """Bytes of weights, versions, gradients, masters, optimizer state and correction buffers of one stage."""

    n = sum(layer.params for layer in layers)
    shapes = [s for layer in layers for s in layer.shapes]
    roles = [r for layer in layers for r in layer.roles]
    numel = [math.prod(s) for s in shapes]
    rule, w, d = get(job.schedule), job.weight_bytes, job.replicas
    slots = rule.max_versions(stage, job.stages, job.micro_batches) if rule.flush_free else 0
    state = sum(k * state_bytes(job, r) for k, r in zip(numel, roles))
    out = dict(weights=w * n, versions=slots * w * n, grads=w * n, masters=0, optimizer=state,
               correction=correction_bytes(job) * n)
    if job.path == "deepspeed-bf16":  # flat, padded, partitioned over replicas whatever the ZeRO stage
        padded = deepspeed_padded(n, d)
        out.update(weights=w * padded, versions=slots * w * n, grads=w * n + job.grad_accum_bytes * padded,
                   masters=4 * padded // d, optimizer=state_bytes(job, "matrix") * padded // d)
        return out
    if job.path == "master-weights":
        out["masters"] = 4 * n
    if sharded_by_tensor(job):
        out["optimizer"], out["correction"] = owned_state(job, shapes, roles)
    elif job.zero == 1 and d > 1:  # DeepSpeed's flat ZeRO-1: an fp32 partition, its gradients and the state
        out.update(masters=4 * n // d, grads=w * n + 4 * n // d, optimizer=state // d,
                   correction=out["correction"] // d)
    return out


def step_workspace(job: Job, layers: list[Layer]) -> int:
    """Transient bytes of the optimizer step (estimate; see the module docstring)."""
    n = sum(layer.params for layer in layers)
    total = muon_step_workspace(job, layers) if job.optimizer == "muon" else 0
    if job.path == "master-weights" and not job.fused_step:
        total += 4 * n + 8 * min(n, 2 ** 28)  # fp32 gradients, then the update in chunks
    elif job.path == "deepspeed-bf16" and not job.fused_step and job.grad_accum_bytes != 4:
        total += 4 * deepspeed_padded(n, job.replicas) // job.replicas  # the fp32 gradients its step reads
    elif job.path == "plain" and job.optimizer != "sgd":
        total += 8 * min(n, 2 ** 28)
    return total


def muon_step_workspace(job: Job, layers: list[Layer]) -> int:
    """Peak transient bytes of Muon's Newton-Schulz over a stage: its groups (:func:`muon_groups`) one after the
    other, each :func:`muon_workspace`; the unfused step keeps each group's bf16 results until it applies them all,
    the fused one applies a group's before the next."""
    peak = held = 0
    for group in muon_groups(job, layers):
        peak = max(peak, held + muon_workspace(group))
        held += 0 if job.fused_step else 2 * sum(math.prod(s) for s in group)
    return peak


def muon_groups(job: Job, layers: list[Layer]) -> list[list[tuple[int, ...]]]:
    """The shapes Newton-Schulz is given for each of a stage's Muon groups, in step order, as
    :func:`ds_async.optim.muon.muon_param_groups` builds them: the ``matrix`` parameters, then under
    ``split_gate_up`` the fused ``[gate; up]`` stacks as ``[..., 2, rows / 2, cols]`` (their ``gate_up`` group,
    viewed by :func:`ds_async.optim.muon.split_rows`)."""

    plain, split = [], []
    for layer in layers:
        for shape, role, gate_up in zip(layer.shapes, layer.roles, layer.gate_up):
            if role != "matrix":
                continue
            if gate_up and job.split_gate_up:
                split.append(tuple(split_rows(torch.empty(shape, device="meta"), 2).shape))
            else:
                plain.append(shape)
    return [group for group in (plain, split) if group]


def muon_workspace(matrices: list[tuple[int, ...]]) -> int:
    """Peak transient bytes of Muon's Newton-Schulz over a stage's ``matrices`` (shapes, module order), as
    :func:`ds_async.optim.muon.orthogonalise_batched` runs it: the bf16 directions of all of them live through the
    step; same shapes are orthogonalised as one stack, in order of first appearance, each stack holding its bf16
    copy, two iterates and two Gram-sized products (``6`` bytes an element + ``4`` per Gram element) beside the
    bf16 results of the stacks before it; at the end every result (``2`` bytes an element) beside the directions."""
    by_shape: dict[tuple, int] = {}
    for s in matrices:
        by_shape[s] = by_shape.get(s, 0) + math.prod(s)
    done = peak = 0
    for s, size in by_shape.items():
        gram = size // max(s[-2:]) * min(s[-2:])  # the stack's matrices, each min(rows, cols) squared
        peak = max(peak, 2 * done + 3 * 2 * size + 2 * 2 * gram)
        done += size
    return 2 * done + max(peak, 2 * done)


# ---------------------------------------------------------------------------------------------------- activations

def norm_bytes(job: Job, hidden: int) -> int:
    """Per token: one RMSNorm's saved tensors (fp32 input, rsqrt, normalised, weighted; autocast's bf16 cast)."""
    r, e = job.residual_bytes, job.act_bytes
    return 4 * hidden + 4 + 2 * r * hidden + (e * hidden if r != e else 0)


def decoder_bytes(job: Job, hf) -> int:
    """Bytes one decoder layer saves for backward per micro-batch (see the module docstring)."""
    e, t = job.act_bytes, job.tokens
    h, a = hf.hidden_size, hf.num_attention_heads
    d = getattr(hf, "head_dim", None) or h // a
    hq, hkv = a * d, hf.num_key_value_heads * d
    if job.compiled:
        return t * compiled_decoder_per_token(job, hf) + 2 * job.seq_len * d
    per_token = 2 * norm_bytes(job, h) + e * (2 * hq + 2 * hkv) + 4 * a
    if job.family == "mixtral":
        k, experts = hf.num_experts_per_tok, hf.num_local_experts
        per_token += k * (2 * e * h + 4 * e * hf.intermediate_size) + (4 + e) * experts + 48 * k + 4
    else:
        per_token += 4 * e * hf.intermediate_size
    return t * per_token + 2 * job.seq_len * d * e


def compiled_decoder_per_token(job: Job, hf) -> int:
    """Bytes per token an inductor-compiled decoder layer saves (``performance.compile``; see the module
    docstring): its input, per RMSNorm the ``rsqrt`` and the normalised, weighted matmul input, ``q, k, v``, the
    attention output and its log-sum-exp, the ``o_proj`` input; LLaMA's gate, up and their product (SiLU
    recomputed), Mixtral's per token and choice the gathered input, gate-up, the product and the expert's output,
    plus its routing (logits, probabilities, the top-k weights and indices and three int64 index vectors)."""
    r, e = job.residual_bytes, job.act_bytes
    h, a = hf.hidden_size, hf.num_attention_heads
    d = getattr(hf, "head_dim", None) or h // a
    hq, hkv = a * d, hf.num_key_value_heads * d
    attention = r * h + 2 * (4 + e * h) + e * (3 * hq + 2 * hkv) + 4 * a
    if job.family == "mixtral":
        k, experts = hf.num_experts_per_tok, hf.num_local_experts
        return attention + k * (2 * e * h + 3 * e * hf.intermediate_size) + (4 + e) * experts + 36 * k
    return attention + 3 * e * hf.intermediate_size


def head_bytes(job: Job, hf) -> int:
    """The head's saved tensors, its logits and the loss's, per micro-batch."""
    t, v = job.tokens, hf.vocab_size
    if job.compiled:  # its input, rsqrt, the normalised input, the logits; the loss keeps two fp32 per row
        h = hf.hidden_size
        return t * (job.residual_bytes * h + 4 + job.act_bytes * h + job.act_bytes * v + (13 if job.loss_chunk else 8))
    loss = 13 if job.loss_chunk else 4 * v + 8
    return t * (norm_bytes(job, hf.hidden_size) + job.act_bytes * v + loss)


def layer_bytes(job: Job, hf, kind: str) -> int:
    if kind == "decoder":
        return decoder_bytes(job, hf)
    if kind == "head":
        return head_bytes(job, hf)
    return 0  # the embedding keeps its input_ids, which the stage holds anyway


def chunks_of(kinds: list[str], interval: int, recompute: int = 0) -> list[tuple[list[str], bool]]:
    """The stage's layers in checkpoint chunks, each with whether it is checkpointed (decoders only): DeepSpeed's
    chunks of ``interval`` layers, or (``activation_checkpoint_layers``) the first ``recompute`` decoder layers one
    by one and every other layer as it runs."""
    if recompute:
        out, left = [], recompute
        for k in kinds:
            checkpointed = left > 0 and k == "decoder"
            left -= checkpointed
            if checkpointed or not out or out[-1][1]:
                out.append(([k], checkpointed))
            else:
                out[-1][0].append(k)
        return out
    if not interval:
        return [(kinds, False)]
    return [(kinds[i:i + interval], all(k == "decoder" for k in kinds[i:i + interval]))
            for i in range(0, len(kinds), interval)]


def activation_memory(job: Job, hf, kinds: list[str], stage: int) -> tuple[int, int]:
    """(bytes per in-flight micro-batch, working set) of a stage with layers of ``kinds``."""
    t, h, r, e = job.tokens, hf.hidden_size, job.residual_bytes, job.act_bytes
    first, last = stage == 0, stage == job.stages - 1
    held = (8 * t if first else r * h * t if r != 4 else 0) + (8 * t if last else r * h * t)
    working, f = 0, hf.intermediate_size * (getattr(hf, "num_experts_per_tok", None) or 1)
    recompute = job.recompute[stage] if job.recompute else 0
    for i, (chunk, checkpointed) in enumerate(chunks_of(kinds, job.checkpoint_interval, recompute)):
        full = sum(layer_bytes(job, hf, k) for k in chunk)
        if checkpointed:
            held += r * h * t if i else (r * h * t if r == 4 and not first else 0)
            working = max(working, full)
        else:
            held += full
    working += 3 * e * f * t
    if job.fp8 and "decoder" in kinds:
        working += fp8_workspace(job, hf)
    if last:  # the logits' gradient; eager (or chunked) the loss's fp32 rows beside it, compiled one fused kernel
        rows = min(job.loss_chunk, t) if job.loss_chunk else 0 if job.compiled else t
        working += e * hf.vocab_size * t + 4 * hf.vocab_size * rows
    else:
        working += r * h * t  # the received gradient
    return held, working


def fp8_workspace(job: Job, hf) -> int:
    """FP8's casts beside one decoder-layer product (``performance.fp8``), a byte an element: the weight and its
    transpose, the input and the output's gradient, of the largest product (the MLP's, else attention's). Upper
    bound: what the product saves for backward is counted as in bf16, though compiled it may keep the FP8 input."""
    h, f = hf.hidden_size, hf.intermediate_size
    largest = h * f if job.family == "llama" else h * h  # Mixtral's experts stay in bf16 (ds_async.fp8)
    return 2 * largest + 2 * job.tokens * (max(h, f) if job.family == "llama" else h)


def in_flight(job: Job, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B (steady across batches when
    flush-free)."""

    ahead = job.stages - stage
    return ahead if get(job.schedule).flush_free else min(ahead, job.micro_batches)


def step_phase(job: Job, stage: int) -> tuple[int, bool]:
    """When stage ``stage`` issues its optimizer step: (micro-batches whose activations it holds then, whether a
    backward of the next batch ran between the batch's gradient reduce and its step). Read off the schedule the
    engine runs (``ds_async.pipe.schedule.FlushFreeSchedule``: under 2BW the step of stage ``s`` is issued ``s``
    schedule steps after its reduce, so stages 2 and up backward a micro-batch of the next batch meanwhile); 1F1B
    (DeepSpeed's TrainSchedule) steps after its flush, with nothing in flight."""

    rule = get(job.schedule)
    if not rule.flush_free:
        return 0, False
    m, target = job.micro_batches, 3  # a steady-state batch, past the warm-up
    held, reduced, between = 0, False, False
    for cmds in fs.FlushFreeSchedule(m, job.stages, stage, rule).steps():
        for cmd in cmds:
            if isinstance(cmd, fs.ForwardPass):
                held += 1
            elif isinstance(cmd, fs.BackwardPass):
                held -= 1
                between |= reduced and cmd.micro_batch // m == target + 1
            elif isinstance(cmd, fs.ReduceGrads) and cmd.batch == target:
                reduced = True
            elif isinstance(cmd, fs.OptimizerStep) and cmd.batch == target:
                return held, between
    raise AssertionError("unreachable: the schedule is endless")


def grads_wait_on_master(job: Job) -> bool:
    """Whether a batch's gradients stay on the optimizer's parameters from the reduce to the step (every path but
    DeepSpeed's bf16 optimizer when its hand-over moves them into its buffer at the reduce: ``pipe.steps``)."""
    if job.path != "deepspeed-bf16":
        return True
    can_wait = job.replicas == 1 and job.zero == 0
    return (can_wait and job.clip > 0) or job.fused_step


def bubble(schedule: str, stages: int, micro_batches: int) -> float:
    """Fraction of a step a stage idles in steady state."""

    return 0.0 if get(schedule).flush_free else (stages - 1) / (micro_batches + stages - 1)


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


STATE_ROWS = ("weights", "versions", "grads", "masters", "optimizer", "correction")
"""A stage's state rows; its total is the state, the larger of the passes' peak (activations, grads_next) and the
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
    under ``RECOMPUTE_HEADROOM`` of the card, with the largest stage total; ``None`` if recomputing all does not."""
    base = dataclasses.replace(job, checkpoint_interval=0)
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


def plan(config_path: str, gpus: int | None = None, gpu_memory_gib: float | None = None) -> Plan:
    """The plan of the job at ``config_path`` (see the module docstring); raises ``ConfigError`` naming the key."""

    ds_config, cfg = cfgmod.load(config_path)
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
                loss_chunk=job.loss_chunk, params=sum(x.params for x in layers),
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
    head = ("stage", "layers", "params", "weights", "versions", "grads", "masters", "optim", "correct", "step",
            "activ", "x", "next", "peak", "context", "total", "fits")
    table = [head]
    for s in p.stage_list:
        table.append((str(s.stage), f"{s.layers[0]}-{s.layers[1] - 1}", _b(s.params), _g(s.weights),
                      _g(s.versions), _g(s.grads), _g(s.masters), _g(s.optimizer), _g(s.correction),
                      _g(s.step_workspace), _g(s.activations), str(s.in_flight), _g(s.grads_next),
                      f"{s.peak_phase}" + (f" ({s.at_step})" if s.peak_phase == "step" else ""), _g(s.context), _g(s.total),
                      "yes" if s.fits else "NO"))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    rows += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    rule_note = (f"{p.bubble:.1%} (steady state; a warm-up and drain only at drains); 1f1b at this m: "
                 f"{p.bubble_1f1b:.1%}" if p.bubble == 0 else f"{p.bubble:.1%} = (p-1)/(m+p-1)")
    rows += ["", "(x: micro-batches in flight; activ = x per-micro-batch activations + one working set; next: the "
             "next batch's gradients beside the waiting ones; total = the state + the larger of the passes (activ + "
             "next) and the step (step + the activations of the micro-batches held then, in brackets, + next) + "
             "context)",
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
    return (f"suggest \"activation_checkpoint_layers\": {p.suggested_recompute} (the fewest per stage that stay "
            f"under {RECOMPUTE_HEADROOM:.0%} of the card: peak {p.suggested_recompute_peak / GIB:.1f} GiB; largest "
            f"stage {p.suggested_recompute_imbalance:.3f}x the mean FLOPs with the recompute)")


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
    args = parser.parse_args(argv)
    try:
        result = plan(args.config, args.gpus, args.gpu_memory)
    except (ConfigError, ValueError) as e:
        print(f"ds_async: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(result), indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
