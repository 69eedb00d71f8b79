"""The planner's byte model: what one pipeline stage of a ds_async job holds, per parameter (weights, held
versions, gradients, masters, optimizer state, correction buffers, the optimizer step's workspace) and per token
(activations per micro-batch, compiled and checkpointed, in flight by the schedule), and the schedule's bubble.

Input: a :class:`Job` (what the config decides, resolved by ``ds_async.plan.job_of``) and the model's :class:`Layer`
list (``ds_async.plan.layers_of``). The formulas are DESIGN.md's "Will it fit?"; ``tests/test_plan.py`` holds them
to real tensors on CPU. :mod:`ds_async.plan` puts them together into a plan per stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .optim.muon import split_rows
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
    cuda_graphs: bool = False  # performance.cuda_graphs: captured instances keep their own pools (graph_instances)

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
    graphs: int = 0                      # CUDA graph instances' pools (performance.cuda_graphs), held all run
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


def graph_instances(job: Job, stage: int) -> int:
    """Captured forward/backward pairs stage ``stage`` holds under ``performance.cuda_graphs`` (0 without): one per
    weight slot a forward runs on (the master under 1F1B, each held version when flush-free) and micro-batch in
    flight (:mod:`ds_async.pipe.graphs`; an upper bound: a slot's group grows to the micro-batches in flight on it at
    once). Each keeps its memory pool for the whole run: one micro-batch's activations and working set, and a
    gradient buffer per parameter."""
    if not job.cuda_graphs:
        return 0
    rule = get(job.schedule)
    slots = rule.max_versions(stage, job.stages, job.micro_batches) if rule.flush_free else 1
    return slots * in_flight(job, stage)


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
