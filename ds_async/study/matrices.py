"""The loss-curve study's runs as ordinary ds_async JSON configs: its matrices.

Every run is one of the study's base configs in ``launch/study/`` (``base.json``: the 20.5M LLaMA on the corpus'
enwiki shards, 300 steps of 48 sequences as 2 micro-batches of 24; ``long.json``: the 30.9M LLaMA at 20 tokens per
parameter; ``long_moe.json``: a Mixtral of its shape; ``tiny.json``: the CPU/CI model) with dotted-key overrides of
that JSON, e.g. ``{"ds_async.schedule": "2bw", "ds_async.correction": {"type": "ef", "lambda": 1.0}}``; the JSON is
the only config language. A matrix is a named list of such runs (:func:`matrix`); :mod:`ds_async.study.driver`
writes each one's JSON and trains it.
"""
from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import override

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "launch" / "study"  # the base configs and the committed results

# Peak learning rates and weight decay, chosen for the synchronous runs and reused unchanged for the asynchronous
# ones (the extras' LR sweep checks them). Muon: its rate for hidden matrices, AdamW's (adam_*) for embedding, head
# and norms; no decay on the hidden matrices (Muon's lr x wd there would be 7x AdamW's).
OPTIMIZERS = {
    "adamw": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1, "torch_adam": True}}},
    "muon": {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "nesterov": True,
                                                      "weight_decay": 0.0, "adam_lr": 3e-3, "adam_betas": [0.9, 0.95],
                                                      "adam_weight_decay": 0.1}}},
}
VARIANTS = {
    "sync": {"ds_async.schedule": "1f1b"},
    "2bw": {"ds_async.schedule": "2bw"},
    "2bw+ef": {"ds_async.schedule": "2bw", "ds_async.correction": {"type": "ef", "lambda": 1.0}},
}
# The engine comparison's points: each trains through both runners with the same JSON.
PAIR_POINTS = (("muon", "2bw+ef"), ("adamw", "2bw"), ("adamw", "sync"))


@dataclass
class Run:
    base: str
    """The base config's file name in this folder."""
    group: str
    name: str
    overrides: dict = field(default_factory=dict)
    """Dotted keys of the JSON -> values."""

    def config(self, sets: dict | None = None) -> dict:
        """The run's whole JSON: the base with the overrides, then ``sets``, applied."""
        return override(load_base(self.base), {**self.overrides, **(sets or {})})


def load_base(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def product(base: str, group: str, *axes: dict) -> list[Run]:
    """One run per combination of the axes' entries (``label -> overrides``), named by the labels joined by ``-``
    (an empty label adds nothing to the name)."""
    runs = []
    for combo in itertools.product(*(axis.items() for axis in axes)):
        overrides = {}
        for _, o in combo:
            overrides.update(o)
        runs.append(Run(base, group, "-".join(label for label, _ in combo if label), overrides))
    return runs


def seeds(*values: int) -> dict:
    return {f"s{s}": {"ds_async.seed": s} for s in values}


def length(steps: int) -> dict:
    """Train ``steps`` steps: validation every tenth of them, the LR schedule (10% warm-up) stretched to match."""
    return {"ds_async.train.steps": steps, "ds_async.eval.every": max(1, steps // 10),
            "scheduler.params.total_num_steps": steps, "scheduler.params.warmup_num_steps": max(1, round(steps / 10))}


def lr_scaled(optimizer: str, scale: float) -> dict:
    """The optimizer's peak learning rates (Muon: both) times ``scale``."""
    params = OPTIMIZERS[optimizer]["optimizer"]["params"]
    return {f"optimizer.params.{k}": params[k] * scale for k in ("lr", "adam_lr") if k in params}


def extras(base: str, optimizers=("adamw", "muon"), token_scales=(0.5, 2.0), lr_scales=(0.5, 2.0),
           batches=(96, 192), batch_optimizers=("adamw",), depths=(2, 4, 8), lambdas=(0.5, 1.5)) -> list[Run]:
    """Sweeps of one axis of ``base`` each, seed 0; each sweep's point at ``base`` itself is the main matrix's."""
    cfg = load_base(base)
    steps, ds = cfg["ds_async"]["train"]["steps"], cfg["ds_async"]
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    sync_2bw = {k: VARIANTS[k] for k in ("sync", "2bw")}
    s0 = {"": {"ds_async.seed": 0}}
    runs = []
    for opt in optimizers:
        o = {opt: OPTIMIZERS[opt]}
        tokens = {f"tokens{x:g}x": length(int(steps * x)) for x in token_scales}
        runs += product(base, "tokens", o, sync_2bw, tokens, s0)
        runs += product(base, "lr", o, sync_2bw, {f"lr{x:g}x": lr_scaled(opt, x) for x in lr_scales}, s0)
        if opt in batch_optimizers:  # the same tokens in fewer, larger steps of the same micro-batches
            sizes = {f"batch{b}": {"gradient_accumulation_steps": b // mbs, **length(steps * mbs * gas // b)}
                     for b in batches}
            runs += product(base, "batch", o, sync_2bw, sizes, s0)
        # PipeDream's variable delay: one micro-batch per step (the step's sequences in one), stage s of p lags
        # p - 1 - s steps; validation on the same held-out sequences in micro-batches of the new size.
        depth = {f"pipedream-p{p}": {"ds_async.schedule": "pipedream", "ds_async.pipeline_stages": p,
                                     "train_micro_batch_size_per_gpu": mbs * gas, "gradient_accumulation_steps": 1,
                                     "ds_async.eval.batches": ds["eval"]["batches"] * mbs // (mbs * gas)}
                 for p in depths}
        runs += product(base, "depth", o, depth, s0)
        ef = {f"2bw+ef-lambda{lam:g}": {**VARIANTS["2bw"], "ds_async.correction": {"type": "ef", "lambda": lam}}
              for lam in lambdas}
        runs += product(base, "ef_lambda", o, ef, s0)
        nesterov = {"2bw+nesterov": {**VARIANTS["2bw"],
                                     "ds_async.correction": {"type": "nesterov", "momentum": 0.9, "delay": 1}}}
        runs += product(base, "nesterov", o, nesterov, s0)
    return runs


def pairs(base: str, group: str, seed_values: tuple[int, ...], **shape) -> list[Run]:
    """The engine comparison's points (Muon 2bw+ef, AdamW 2bw and sync) per seed, with ``shape`` overrides."""
    points = {f"{opt}-{v}": {**OPTIMIZERS[opt], **VARIANTS[v]} for opt, v in PAIR_POINTS}
    return product(base, group, points, seeds(*seed_values), {"": shape})


def _depth8(base: str, group: str, seed_values: tuple[int, ...], **shape) -> list[Run]:
    """Muon sync vs 2BW + EF through 8 stages, m = 8 (the eight-GPU issue's pair)."""
    return product(base, group, {"muon": OPTIMIZERS["muon"]},
                   {k: VARIANTS[k] for k in ("sync", "2bw+ef")}, seeds(*seed_values),
                   {"": {"ds_async.pipeline_stages": 8, "ds_async.partition": {"method": "uniform"},
                         "gradient_accumulation_steps": 8, **shape}})


# The real-length study (long.json: 30.9M parameters, 4712 steps of 131k tokens = 20 tokens per parameter): the
# optimizers on the engine's fast path: torch's fused AdamW kernel, Muon's step fused.
LONG_OPTIMIZERS = {
    "adamw": {"optimizer": {"type": "AdamW", "params": {**OPTIMIZERS["adamw"]["optimizer"]["params"], "fused": True}}},
    "muon": {**OPTIMIZERS["muon"], "ds_async.performance.fused_optimizer_step": True},
}


def long_product(group: str, *axes: dict) -> list[Run]:
    """:func:`product` on long.json; an AdamW run with a delay correction is ds_async's AdamW (the same update,
    hookable), which has no ``fused`` switch, so its block is the study's plain one."""
    runs = product("long.json", group, *axes)
    for run in runs:
        if run.overrides.get("ds_async.correction") and run.overrides["optimizer"]["type"] == "AdamW":
            run.overrides["optimizer"] = copy.deepcopy(OPTIMIZERS["adamw"]["optimizer"])
    return runs


def long_lengths(fractions=(1 / 81, 1 / 27, 1 / 9, 1 / 3)) -> dict:
    """Shorter runs of long.json, each with its own LR schedule: the gap against training length (with long.json's
    own point, 81x from the shortest to the longest). Not longer: long.json already takes 6.4 passes over the
    corpus' enwiki shards, and 3x would take 19, mixing the delay with repeated data."""
    steps = load_base("long.json")["ds_async"]["train"]["steps"]
    return {f"len{n}": length(n) for n in (round(steps * f) for f in fractions)}


def long_lambda(lambdas=(0.5, 1.0, 2.0, 3.0), lr_scales=(0.5, 1.0, 2.0, 4.0, 8.0), fraction=1 / 9) -> list[Run]:
    """2bw + EF at each lambda and peak-LR scale, both optimizers, seed 0, with sync and plain 2bw (lambda 0) at the
    scales other than x1 (long-lengths holds those): the LR range where each lambda stays stable, so the scales go
    up to x8, far enough for a lambda to stop training. At 1/9 of long.json's length (2.2 tokens per parameter),
    where the delay costs most (long-lengths) and a 28-point grid per optimizer costs about two full runs; the full
    length's EF points are ``long``'s and long-async-lr's."""
    runs = []
    for opt in LONG_OPTIMIZERS:
        points = {f"2bw+ef-lambda{lam:g}-lr{x:g}x": {**VARIANTS["2bw"], **lr_scaled(opt, x),
                                                     "ds_async.correction": {"type": "ef", "lambda": lam}}
                  for x in lr_scales for lam in lambdas}
        points.update({f"{v}-lr{x:g}x": {**VARIANTS[v], **lr_scaled(opt, x)}
                       for x in lr_scales if x != 1.0 for v in ("sync", "2bw")})
        runs += long_product("long-lambda", {opt: LONG_OPTIMIZERS[opt]}, points, long_lengths((fraction,)), seeds(0))
    return runs


def long_delay(depths=(3, 5), fraction=1 / 3) -> list[Run]:
    """PipeDream's variable delay against a constant one of the same mean, on long.json at m = 1 (the step's
    sequences in one micro-batch, as ``extras``' depth sweep; validation on the same held-out sequences in
    micro-batches of that size): ``pipedream`` at depth p delays stage s by p - 1 - s steps, ``delay<(p-1)/2>``
    every stage by their mean, on the same p stages; sync and 2bw (one stage, which 2bw's m >= p asks for at m = 1;
    its rule is then delay1's) as references. Both optimizers, seed 0, at 1/3 of long.json's length (6.7 tokens
    per parameter): the delay still costs both optimizers a clear gap there (long-lengths), at a third of the cost."""
    cfg = load_base("long.json")
    mbs, gas, batches = (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
                         cfg["ds_async"]["eval"]["batches"])
    one = {"train_micro_batch_size_per_gpu": mbs * gas, "gradient_accumulation_steps": 1,
           "ds_async.eval.batches": batches * mbs // (mbs * gas)}
    rules = {}
    for p in depths:
        rules[f"pipedream-p{p}"] = {"ds_async.schedule": "pipedream", "ds_async.pipeline_stages": p}
        rules[f"delay{(p - 1) // 2}-p{p}"] = {"ds_async.schedule": f"delay{(p - 1) // 2}",
                                             "ds_async.pipeline_stages": p}
    rules.update({k: {**VARIANTS[k], "ds_async.pipeline_stages": 1} for k in ("sync", "2bw")})
    return long_product("long-delay", LONG_OPTIMIZERS, rules, {"": one}, long_lengths((fraction,)), seeds(0))


# The MoE study (long_moe.json): a Mixtral of long.json's shape (hidden 512, 7 layers, vocab 8192, seq 512, 4 stages,
# m = 4 micro-batches of 64) with 8 experts of intermediate size 320, top-2: 43.3M parameters, 22.6M active per
# token. 6606 steps of 131k tokens = 866M tokens = 20 tokens per *total* parameter (per active one it would be
# 453M): every expert's weights are trained and the budget stays under ~1.2B tokens. Muon as in ``long`` (fused
# step); each expert's fused gate_up_proj is one matrix (split_gate_up false, the library's default when the matrix
# was set up, kept so that its seeds run alike) except in long-moe-ns's split runs, which orthogonalise its gate and
# up halves apart as the dense path does.
LONG_MOE_MUON = {"muon": {**LONG_OPTIMIZERS["muon"], "optimizer.params.split_gate_up": False}}


# Each optimizer's sync-tuned peak-LR scale: the best of long-lr's sweep, which brackets it (the results page's LR
# table and findings). AdamW's is long.json's own, so ``long`` is its main point; Muon's main point is ``long-tuned``.
TUNED_LR = {"adamw": 1.0, "muon": 2.0}
SYNC_LR_SCALES = {"adamw": (0.5, 2.0), "muon": (0.5, 2.0, 4.0)}
# Each async variant's own sweep, around its best with long's x1 (and long-tuned's x2 for Muon). AdamW's async best
# lies below sync's (a delayed step's error grows with the step), so its sweep runs down from x0.5 instead of up to
# x2, beyond the x1 that x0.5 beats: 2bw+ef's best is x0.25, and 2bw's x0.125, which x0.0625 brackets.
ASYNC_LR_SCALES = {"adamw": (0.0625, 0.125, 0.25, 0.5), "muon": (0.5, 2.0, 4.0)}
# Each async variant's own best scale in that sweep (seed 0; the results page's own-best table), which long-own-lr
# trains at every seed of the main table.
OWN_LR = {"adamw": {"2bw": 0.125, "2bw+ef": 0.25}, "muon": {"2bw": 1.0, "2bw+ef": 2.0}}


def _long_lr(group: str, variants: tuple[str, ...], scales: dict[str, tuple[float, ...]]) -> list[Run]:
    """Each of ``variants`` on long.json at each of the optimizer's peak-LR ``scales``, seed 0."""
    return [r for opt in LONG_OPTIMIZERS for r in long_product(
        group, {opt: LONG_OPTIMIZERS[opt]}, {v: VARIANTS[v] for v in variants},
        {f"lr{x:g}x": lr_scaled(opt, x) for x in scales[opt]}, seeds(0))]


def _long_tuned() -> list[Run]:
    """Muon x {sync, 2bw, 2bw+ef} at its sync-tuned LR (``TUNED_LR``), seeds 0-2: seed 0's runs are long-lr's and
    long-async-lr's (the same folders: trained once)."""
    opt, x = "muon", TUNED_LR["muon"]
    shared = {f"{opt}-{v}-lr{x:g}x-s0" for v in VARIANTS}
    seed0 = [r for name in ("long-lr", "long-async-lr") for r in MATRIX_BUILDERS[name]() if r.name in shared]
    return seed0 + long_product("long-tuned", {opt: LONG_OPTIMIZERS[opt]}, VARIANTS,
                                {f"lr{x:g}x": lr_scaled(opt, x)}, seeds(1, 2))


def _long_own_lr() -> list[Run]:
    """Sync at its tuned LR (``TUNED_LR``) and each async variant at its own best (``OWN_LR``), seeds 0-2; a run
    that long, long-tuned or long-async-lr holds at that point is that run (the same folder: trained once)."""
    held = {_config_key(r): r for name in ("long", "long-tuned", "long-async-lr") for r in MATRIX_BUILDERS[name]()}
    runs = []
    for opt, own in OWN_LR.items():
        for variant, x in {"sync": TUNED_LR[opt], **own}.items():
            runs += [held.get(_config_key(r), r) for r in long_product(
                "long-own-lr", {opt: LONG_OPTIMIZERS[opt]}, {variant: VARIANTS[variant]},
                {f"lr{x:g}x": lr_scaled(opt, x)}, seeds(0, 1, 2))]
    return runs


def _config_key(run: Run) -> str:
    return json.dumps(run.config(), sort_keys=True)


def _long_batch(seed_values: tuple[int, ...] = (0,), scales: tuple[float, ...] = (0.5, 2.0)) -> list[Run]:
    """Steps against tokens: long.json's 618M tokens at half and twice its batch of 256 sequences (9424 or 2356
    steps), warm-up 10% of the steps as long.json's, validation on the same held-out sequences at the same token
    points; sync, 2bw and 2bw+ef at each optimizer's sync-tuned LR (``TUNED_LR``: AdamW 3e-3, Muon 0.04 with 6e-3).
    Twice the batch is 8 micro-batches of 64; half is 4 of 32, not 2 of 64, since 2bw needs at least as many
    micro-batches as long.json's 4 stages (the step's update is the same either way). The batch of 256 is long's
    (AdamW) and long-tuned's (Muon) point."""
    cfg = load_base("long.json")
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    steps, ds_eval = cfg["ds_async"]["train"]["steps"], cfg["ds_async"]["eval"]
    sizes = {}
    for x in scales:
        size = mbs if x >= 1 else round(mbs * x)
        sizes[f"batch{round(mbs * gas * x)}"] = {
            "train_micro_batch_size_per_gpu": size, "gradient_accumulation_steps": round(mbs * gas * x) // size,
            **length(round(steps / x)), "ds_async.eval.every": round(ds_eval["every"] / x),
            "ds_async.eval.batches": ds_eval["batches"] * mbs // size}
    return [r for opt in LONG_OPTIMIZERS for r in long_product(
        "long-batch", {opt: LONG_OPTIMIZERS[opt]}, VARIANTS, {"": lr_scaled(opt, TUNED_LR[opt])}, sizes,
        seeds(*seed_values))]


def _long_adamw_lambda(lambdas=(1.0, 2.0, 3.0)) -> list[Run]:
    """AdamW's 2bw + EF at each lambda at the full length and sync's tuned LR (``TUNED_LR``: long.json's 3e-3),
    seeds 0-2: does long-lambda's best lambda at 1/9 of the length (2 to 3 at this LR) hold at the full one? Its sync
    and 2bw are long's runs; lambda 1 is long's 2bw+ef (the same folders: trained once)."""
    held = {_config_key(r): r for r in MATRIX_BUILDERS["long"]()}
    points = {f"2bw+ef-lambda{lam:g}": {**VARIANTS["2bw"], "ds_async.correction": {"type": "ef", "lambda": lam}}
              for lam in lambdas}
    return [held.get(_config_key(r), r) for r in long_product(
        "long-adamw-lambda", {"adamw": LONG_OPTIMIZERS["adamw"]}, points, {"": lr_scaled("adamw", TUNED_LR["adamw"])},
        seeds(0, 1, 2))]


def _long_moe_ns() -> list[Run]:
    """The fused mode's runs are long-moe's own (the same folders: trained once)."""
    variants = {k: VARIANTS[k] for k in ("sync", "2bw+ef")}
    fused = [r for r in MATRIX_BUILDERS["long-moe"]() if r.name in {f"muon-{v}-s0" for v in variants}]
    return fused + product("long_moe.json", "long-moe-ns", LONG_MOE_MUON, variants,
                           {"split": {"optimizer.params.split_gate_up": True}}, seeds(0))


MATRIX_BUILDERS = {
    "main": lambda: product("base.json", "main", OPTIMIZERS, VARIANTS, seeds(0, 1, 2)),
    "extras": lambda: extras("base.json"),
    "pairs": lambda: pairs("base.json", "main", (0, 1, 2)),  # main's own runs: the emulation side is main's
    "tiny": lambda: product("tiny.json", "main", OPTIMIZERS, VARIANTS, seeds(0, 1)) + extras(
        "tiny.json", optimizers=("adamw",), token_scales=(0.5,), lr_scales=(2.0,), batches=(8,), depths=(2,),
        lambdas=(0.5,)),
    "tiny-pairs": lambda: pairs(  # tiny.json's one stage split in two, for a 2-process engine
        "tiny.json", "engine", (0,), **{"ds_async.pipeline_stages": 2, "train_micro_batch_size_per_gpu": 2,
                                        "gradient_accumulation_steps": 2, "ds_async.eval.batches": 4}),
    "depth8": lambda: _depth8("base.json", "depth8", (0,), train_micro_batch_size_per_gpu=6,
                              **{"ds_async.eval.batches": 80}),
    "depth8-cpu": lambda: _depth8("tiny.json", "depth8-cpu", (0, 1), train_micro_batch_size_per_gpu=1,
                                  **{"ds_async.model.config.num_hidden_layers": 6, "ds_async.eval.batches": 8,
                                     **length(200), "ds_async.eval.every": 20}),
    "long": lambda: long_product("long", LONG_OPTIMIZERS, VARIANTS, seeds(0, 1, 2)),
    "long-lr": lambda: _long_lr("long-lr", ("sync",), SYNC_LR_SCALES),
    "long-tuned": _long_tuned,
    "long-async-lr": lambda: _long_lr("long-async-lr", ("2bw", "2bw+ef"), ASYNC_LR_SCALES),
    "long-own-lr": _long_own_lr,
    "long-lengths": lambda: long_product("long-lengths", LONG_OPTIMIZERS, {k: VARIANTS[k] for k in ("sync", "2bw")},
                                         long_lengths(), seeds(0, 1)),
    "long-lambda": long_lambda,
    "long-delay": long_delay,
    "long-moe": lambda: product("long_moe.json", "long-moe", LONG_MOE_MUON, VARIANTS, seeds(0, 1, 2)),
    "long-moe-ns": _long_moe_ns,
    "long-batch": _long_batch,
    "long-batch-seeds": lambda: _long_batch((1, 2)),
    "long-adamw-lambda": _long_adamw_lambda,
}
MATRICES = tuple(MATRIX_BUILDERS)


def matrix(name: str) -> list[Run]:
    """The named list of runs.

    ``main``: {AdamW, Muon} x {sync, 2bw, 2bw+ef} x seeds {0, 1, 2} of ``base.json`` (18). ``extras`` (seed 0):
    token budget x0.5/x2 and peak LR x0.5/x2 for sync and 2bw with both optimizers, batch 96/192 sequences at the
    same tokens (AdamW), PipeDream at p = 2/4/8, EF lambda 0.5/1.5 and the Nesterov look-ahead correction (32).
    ``pairs``: the engine comparison's points of ``main`` (Muon 2bw+ef, AdamW 2bw and sync, 3 seeds), for
    ``--runner engine``; their emulation twins are ``main``'s runs. ``tiny``: ``main`` and ``extras`` on
    ``tiny.json`` (2 seeds, one AdamW point per sweep; one stage and one micro-batch per step, so that CI's
    emulation runs are cheap). ``tiny-pairs``: the pairs' points on ``tiny.json`` split over 2 stages (2
    micro-batches of 2), to run with both runners. ``depth8`` (8 GPUs) and ``depth8-cpu``
    (8 CPU ranks, a 6-layer tiny model, 200 steps, seeds 0 and 1): Muon sync vs 2bw+ef through 8 stages.
    ``long``: ``main`` at a real length on ``long.json`` (20 tokens per parameter, bf16 weights with fp32 masters
    as on the engine's fast path; 18). ``long-lr``: sync's peak LR there, AdamW x0.5 and x2, Muon x0.5, x2 and x4
    (seed 0; 5), which brackets each optimizer's best (``TUNED_LR``). ``long-tuned``: Muon's sync, 2bw and 2bw+ef
    at its sync-tuned x2, seeds 0-2 (seed 0's are long-lr's and long-async-lr's runs; 6 more); AdamW's tuned point
    is ``long``'s. ``long-async-lr``: 2bw and 2bw+ef at AdamW x0.0625 to x0.5, Muon x0.5, x2 and x4 (seed 0; 14):
    each async variant's own best LR. ``long-own-lr``: sync at its tuned LR and each async variant at its own best
    (``OWN_LR``), seeds 0-2, the runs other long matrices hold included (18; AdamW's async ones at seeds 1-2 are 4
    more).
    ``long-lengths``: sync and 2bw at 1/81, 1/27, 1/9 and 1/3 of that length, seeds 0 and 1 (32).
    ``long-lambda``: at 1/9 of the length, 2bw + EF at lambda 0.5/1/2/3 x peak LR x0.5/x1/x2/x4/x8, with sync and
    2bw at the scales other than x1 (seed 0; 56). ``long-delay``: at 1/3 of the length and m = 1, PipeDream at p = 3
    and 5 against the constant delays of their means (``delay1``, ``delay2``, emulation only) on the same stages,
    with sync and 2bw at m = 1 (seed 0; 12).
    ``long-moe``: Muon x {sync, 2bw, 2bw+ef} x seeds {0, 1, 2} on ``long_moe.json`` (a 43.3M Mixtral, 8 experts,
    top-2, 22.6M active; 20 tokens per total parameter; 9). ``long-moe-ns``: how Muon orthogonalises the experts'
    fused ``gate_up_proj``, sync and 2bw+ef at seed 0: one matrix per expert (``long-moe``'s own runs) and its gate
    and up halves apart (``split_gate_up``; 2 more runs).
    ``long-batch``: steps against tokens at long's 618M tokens, half and twice its batch (4 micro-batches of 32 or 8
    of 64, 9424 or 2356 steps), sync, 2bw and 2bw+ef at each optimizer's sync-tuned LR, seed 0 (12);
    ``long-batch-seeds``: the same at seeds 1 and 2 (24, group ``long-batch``). ``long-adamw-lambda``: AdamW 2bw +
    EF at lambda 1, 2 and 3 at the full length and sync's tuned LR, seeds 0-2 (9; lambda 1 is long's runs, so 6
    more).
    """
    if name not in MATRIX_BUILDERS:
        raise ValueError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}")
    return MATRIX_BUILDERS[name]()
