"""ds_async's optimizers against torch's and against plain references; roles; config; stats.

Equalities with torch are exact: the update functions use torch's single-tensor op order (the path torch takes
on CPU), including Muon's bf16 Newton-Schulz, so any difference is a real deviation, not rounding.
"""
import copy

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

from ds_async.config import ConfigError
from ds_async.models import mixtral
from ds_async.models.llama import DecoderLayerPipe, EmbeddingPipe, HeadPipe, check_supported
from ds_async.optim import (SGD, AdamW, ErrorFeedback, Lion, Muon, NesterovLookahead, build_correction,
                            build_optimizer, muon_param_groups, param_roles)
from ds_async.optim.client import OptimizerSetupError, client_optimizer
from ds_async.optim.muon import NS_COEFFICIENTS, orthogonalise_batched, zeropower_via_newtonschulz
from ds_async.optim.roles import fused_gate_up

from muon_reference import ReferenceHybridMuon

SHAPES = [(32, 16), (16, 48), (24, 24), (32, 16)]  # a repeated shape: Muon batches it


def twin_params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    return ([p.clone().requires_grad_() for p in base], [p.clone().requires_grad_() for p in base])


def run_twins(make_a, make_b, shapes, steps=6, seed=0):
    """Step two optimizers over identical parameters with identical random gradients; return both parameter lists
    after every step."""
    a, b = twin_params(shapes, seed)
    opt_a, opt_b = make_a(a), make_b(b)
    gen = torch.Generator().manual_seed(seed + 1)
    history = []
    for _ in range(steps):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen)
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        history.append(([p.detach().clone() for p in a], [p.detach().clone() for p in b]))
    return history


def assert_equal_history(history):
    for step, (xs, ys) in enumerate(history):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(x, y), f"step {step}, param {i}: max diff {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("lr_rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch_muon(lr_rule, nesterov):
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    history = run_twins(lambda ps: torch.optim.Muon(ps, adjust_lr_fn=lr_rule, **hp),
                        lambda ps: Muon([dict(params=ps, use_muon=True)], lr_rule=lr_rule, **hp), SHAPES)
    assert_equal_history(history)
    assert not torch.equal(history[-1][0][0], twin_params(SHAPES)[0][0])  # it moved


@pytest.mark.parametrize("shape", [(4, 16, 24), (3, 40, 12), (2, 3, 8, 8)])
def test_batched_newton_schulz_equals_per_matrix(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    batched = zeropower_via_newtonschulz(g)
    flat = g.reshape(-1, *shape[-2:])
    ours = torch.stack([zeropower_via_newtonschulz(m) for m in flat]).reshape(shape)
    torchs = torch.stack([torch_newton_schulz(m, NS_COEFFICIENTS, 5, 1e-7) for m in flat]).reshape(shape)
    assert batched.dtype == torch.bfloat16
    assert torch.equal(batched, ours) and torch.equal(batched, torchs)


def test_same_shape_matrices_orthogonalised_together_equal_one_by_one():
    gen = torch.Generator().manual_seed(5)
    shapes = [(16, 24), (24, 16), (16, 24), (3, 8, 8), (16, 24), (3, 8, 8), (5, 7), (24, 16)]
    ds = [torch.randn(s, generator=gen) for s in shapes]
    for got, d in zip(orthogonalise_batched(ds), ds):
        assert got.shape == d.shape
        assert torch.equal(got, zeropower_via_newtonschulz(d))


def test_muon_on_expert_stack_equals_one_muon_per_expert():
    experts, rows, cols = 4, 24, 16
    stack, singles = twin_params([(experts, rows, cols)])[0], None
    singles = [stack[0][e].detach().clone().requires_grad_() for e in range(experts)]
    opt_stack = Muon([dict(params=stack, use_muon=True)], weight_decay=0.05, lr_rule="match_rms_adamw")
    opt_singles = Muon([dict(params=singles, use_muon=True)], weight_decay=0.05, lr_rule="match_rms_adamw")
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        g = torch.randn(experts, rows, cols, generator=gen)
        stack[0].grad = g.clone()
        for e in range(experts):
            singles[e].grad = g[e].clone()
        opt_stack.step()
        opt_singles.step()
    assert torch.equal(stack[0].detach(), torch.stack([s.detach() for s in singles]))


def test_adamw_equals_torch():
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    shapes = SHAPES + [(40,), (7, 3, 5)]
    assert_equal_history(run_twins(lambda ps: torch.optim.AdamW(ps, **hp), lambda ps: AdamW(ps, **hp), shapes))


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_sgd_equals_torch(nesterov, dampening):
    hp = dict(lr=0.05, momentum=0.9, nesterov=nesterov, dampening=dampening)
    shapes = SHAPES + [(40,)]
    assert_equal_history(run_twins(lambda ps: torch.optim.SGD(ps, **hp), lambda ps: SGD(ps, **hp), shapes))


def test_sgd_weight_decay_is_decoupled():
    """torch's SGD without weight decay after ``x *= 1 - lr * wd``: the decay never enters the momentum."""
    lr, wd = 0.05, 0.1

    class DecayThenTorchSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(1 - lr * wd)
            return super().step(closure)

    history = run_twins(lambda ps: DecayThenTorchSGD(ps, lr=lr, momentum=0.9),
                        lambda ps: SGD(ps, lr=lr, momentum=0.9, weight_decay=wd), SHAPES)
    assert_equal_history(history)


class HandLion(torch.optim.Optimizer):
    """Lion as written in the paper's pseudo-code (Chen et al. 2023, Program 1)."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.mul_(beta2).add_((1 - beta2) * p.grad)


def test_lion_equals_hand_written_lion():
    hp = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.3)
    history = run_twins(lambda ps: HandLion(ps, **hp), lambda ps: Lion(ps, **hp), SHAPES + [(40,)])
    # The momentum is a convex combination written two ways (lerp vs mul/add): equal up to fp32 rounding, and
    # the update is its sign, so the parameters agree to rounding unless a sign flips (which would be lr = 1e-3).
    for xs, ys in history:
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def tiny_llama(layers: int = 2):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False)
    check_supported(config)
    return nn.ModuleList([EmbeddingPipe(config, seed=1)]
                         + [DecoderLayerPipe(config, i, seed=1) for i in range(layers)]
                         + [HeadPipe(config, seed=1, index=layers + 1)])


def by_role(model):
    """Roles read off the model's structure by hand (attribute paths, not names)."""
    emb, *decoders, head = model
    matrices, vectors = [], [head.norm.weight]
    for d in decoders:
        attn, mlp = d.layer.self_attn, d.layer.mlp
        matrices += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                     mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        vectors += [d.layer.input_layernorm.weight, d.layer.post_attention_layernorm.weight]
    return {"matrix": matrices, "embedding": [emb.embed_tokens.weight], "head": [head.lm_head.weight],
            "vector": vectors}


def test_roles_of_a_llama_pipeline():
    model = tiny_llama()
    groups = muon_param_groups(model)
    placed = [p for g in groups for p in g["params"]]
    assert len(placed) == len({id(p) for p in placed}) == len(list(model.parameters()))
    want = by_role(model)
    for g in groups:
        assert {id(p) for p in g["params"]} == {id(p) for p in want[g["name"]]}, g["name"]
        assert g["use_muon"] == (g["name"] == "matrix")
    assert {g["name"] for g in groups} == set(want)


def test_mixtral_experts_and_router_train_with_muon():
    """A real Mixtral pipeline: expert stacks [E, rows, cols] and the router are Muon matrices, and one step on a
    real loss (through the experts' grouped matmul) moves every parameter the batch reaches."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                           num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    mixtral.check_supported(config)
    model = nn.ModuleList([mixtral.EmbeddingPipe(config, seed=1)]
                          + [mixtral.MoeDecoderLayerPipe(config, i, seed=1) for i in range(2)]
                          + [mixtral.MoeHeadPipe(config, seed=1, index=3)])
    # roles alone (split_gate_up moves gate_up_proj to a Muon group of its own: test_split_gate_up_groups)
    groups = {g["name"]: {id(p) for p in g["params"]} for g in muon_param_groups(model, split_gate_up=False)}
    for d in model[1:3]:
        mlp, attn = d.layer.mlp, d.layer.self_attn
        for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight, attn.q_proj.weight):
            assert id(p) in groups["matrix"]
        assert mlp.experts.gate_up_proj.ndim == 3
        assert id(d.layer.input_layernorm.weight) in groups["vector"]
    assert id(model[0].embed_tokens.weight) in groups["embedding"] and id(model[3].lm_head.weight) in groups["head"]
    opt = build_optimizer({"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}, model, correction={"type": "ef"})
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    x = ids
    for layer in model:
        x = layer(x)
    mixtral.loss_fn(config)(x, ids).backward()
    opt.step()
    assert all(p.grad is not None and not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_roles_from_types_and_declarations():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 8, 6))

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 8))

    class DeclaredRouter(Router):
        def ds_async_roles(self):
            return {self.weight: "vector"}

    ok = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), Experts(), DeclaredRouter())
    roles = param_roles(ok)
    assert [roles[p] for p in ok.parameters()] == ["embedding", "matrix", "vector", "vector", "vector", "matrix",
                                                   "vector"]
    with pytest.raises(ValueError, match=r"no role for Router.weight of shape \(4, 8\).*ds_async_roles"):
        param_roles(nn.Sequential(nn.Linear(8, 8), Router()))
    with pytest.raises(ValueError, match="no role for Conv1d.weight"):
        param_roles(nn.Conv1d(2, 3, 4))

    class Embedding(nn.Embedding):
        def ds_async_roles(self):
            return {self.weight: "embedding"}

    class Head(nn.Linear):
        def ds_async_roles(self):
            return {self.weight: "head"}

    tied = nn.Sequential(Embedding(10, 8), Head(8, 10, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="declared both 'embedding' and 'head'"):
        param_roles(tied)


def test_hybrid_muon_equals_slow_reference():
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, lr_rule="match_rms_adamw",
              adam_lr=3e-3, adam_betas=(0.9, 0.95), adam_eps=1e-8, adam_weight_decay=0.05)
    fast_model = tiny_llama()
    ref_model = copy.deepcopy(fast_model)
    start = [p.detach().clone() for p in fast_model.parameters()]
    fast = build_optimizer({"type": "Muon", "params": hp}, fast_model)
    roles = by_role(ref_model)
    ref = ReferenceHybridMuon(roles["matrix"], roles["embedding"] + roles["head"] + roles["vector"], **hp)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        for p, q in zip(fast_model.parameters(), ref_model.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        fast.step()
        ref.step()
    matrices = {id(p) for p in by_role(fast_model)["matrix"]}
    for p, q, p0 in zip(fast_model.parameters(), ref_model.parameters(), start):
        moved = (q - p0).norm()
        err = ((p - q).norm() / moved).item()
        # Relative to how far the parameter moved. AdamW parameters: fp32 storage vs float64 (norm weights sit at
        # ~1 and move ~1e-2, so fp32's 6e-8 is ~3e-5 of the move). Muon matrices: bf16 Newton-Schulz vs float64,
        # measured ~1e-2; a wrong lr rule, decay, momentum or routing is an O(1) error.
        assert err < (3e-2 if id(p) in matrices else 2e-4), (tuple(p.shape), err)


def test_muon_refuses_flat_partitions():
    flat = torch.zeros(64, requires_grad=True)
    with pytest.raises(ValueError, match="flat partition that DeepSpeed's ZeRO or bf16 optimizer"):
        Muon([dict(params=[flat], use_muon=True)])
    # DeepSpeed swaps flat partitions into the param groups after the optimizer is built: refused at step time.
    matrix = torch.zeros(8, 8, requires_grad=True)
    opt = Muon([dict(params=[matrix], use_muon=True)])
    opt.param_groups[0]["params"] = [flat]
    flat.grad = torch.ones(64)
    with pytest.raises(ValueError, match="has shape \\(64,\\)"):
        opt.step()
    # The elementwise optimizers take any tensor, flat partitions included.
    for cls in (AdamW, SGD, Lion):
        p = torch.zeros(64, requires_grad=True)
        p.grad = torch.ones(64)
        cls([p], lr=0.1).step()
        assert p.abs().sum() > 0


def test_stats_report_the_last_step():
    model = tiny_llama(1)
    opt = build_optimizer({"type": "Muon", "params": {"adam_lr": 1e-3}}, model, correction={"type": "ef"})
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        before = {p: p.detach().clone() for p in model.parameters()}
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    stats = opt.stats()
    for group in opt.param_groups:
        u = torch.cat([(before[p] - p.detach()).flatten() for p in group["params"]])
        assert stats[f"update_rms/{group['name']}"] == pytest.approx(u.pow(2).mean().sqrt().item(), rel=1e-5)
        assert stats[f"lr/{group['name']}"] == group["lr"]
        assert f"base_update_rms/{group['name']}" in stats
    buffers = torch.cat([opt.state[p]["ef_prev_update"].flatten() for p in model.parameters()])
    assert stats["ef_buffer_norm"] == pytest.approx(buffers.norm().item(), rel=1e-5)


def test_correction_config_is_strict():
    assert build_correction(None) is None and build_correction({"type": "none"}) is None
    assert build_correction({"type": "ef", "lambda": 0.5}) == ErrorFeedback(lam=0.5)
    assert build_correction({"type": "ef"}) == ErrorFeedback(lam=1.0)
    assert build_correction({"type": "nesterov", "delay": 2}) == NesterovLookahead(momentum=0.9, delay=2)
    with pytest.raises(ConfigError, match=r"ds_async.correction.lamda: unknown key \(did you mean "
                                          r"'ds_async.correction.lambda'\?\)"):
        build_correction({"type": "ef", "lamda": 1.0})
    with pytest.raises(ConfigError, match="ds_async.correction.momentum: only for type 'nesterov', not 'ef'"):
        build_correction({"type": "ef", "momentum": 0.9})
    with pytest.raises(ConfigError, match="ds_async.correction.type: must be one of"):
        build_correction({"type": "dana"})
    with pytest.raises(ConfigError, match="ds_async.correction.momentum: must be in"):
        build_correction({"type": "nesterov", "momentum": 1.0})


def test_build_optimizer_paths():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
    # Without a correction: exactly what DeepSpeed builds from the same block.
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}}
    assert type(build_optimizer(adamw, model.parameters())) is torch.optim.AdamW
    assert type(build_optimizer({"type": "SGD", "params": {"lr": 0.1}}, model.parameters())) is torch.optim.SGD
    # With one: ds_async's hookable classes.
    opt = build_optimizer(adamw, model, correction={"type": "ef"})
    assert type(opt) is AdamW and opt.correction == ErrorFeedback(1.0)
    assert type(build_optimizer({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}}, model)) is Lion
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        build_optimizer({"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.1}}, model, {"type": "ef"})
    sgd = build_optimizer({"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.1, "decoupled_weight_decay": True}},
                          model, {"type": "ef"})
    assert type(sgd) is SGD
    with pytest.raises(ValueError, match="pass the model"):
        build_optimizer({"type": "Muon"}, model.parameters())
    with pytest.raises(ValueError, match=r"optimizer.params.lr_rul: unknown key for type 'Muon' \(did you mean "
                                         r"'lr_rule'\?\)"):
        build_optimizer({"type": "Muon", "params": {"lr_rul": "original"}}, model)
    with pytest.raises(ValueError, match="no ds_async implementation"):
        build_optimizer({"type": "RMSprop", "params": {"lr": 0.1}}, model, {"type": "ef"})


def test_muon_steps_when_a_group_has_no_gradients():
    """A ZeRO-1 shard may own none of a group's matrices: the group is skipped, the others still step."""
    a, b = twin_params([(8, 6)])[0], twin_params([(5,)])[0]
    opt = Muon([dict(params=a, use_muon=True), dict(params=b, use_muon=False)])
    b[0].grad = torch.ones_like(b[0])
    before, a_before = b[0].detach().clone(), a[0].detach().clone()
    opt.step()
    assert a[0].grad is None and not torch.equal(b[0], before)
    assert torch.equal(a[0], a_before) and not opt.state[a[0]]


# --------------------------------------------------------------------------- fused [gate; up] experts (split_gate_up)
def tiny_mixtral(layers: int = 2, intermediate: int = 24):
    """A Mixtral pipeline whose expert halves are wide (I=24 < H=32) while the fused stack is tall (2I=48 > H):
    the two orthogonalisations then differ in orientation, rank and lr adjustment, not only in coupling."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                           num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    mixtral.check_supported(config)
    return nn.ModuleList([mixtral.EmbeddingPipe(config, seed=1)]
                         + [mixtral.MoeDecoderLayerPipe(config, i, seed=1) for i in range(layers)]
                         + [mixtral.MoeHeadPipe(config, seed=1, index=layers + 1)])


def test_split_gate_up_groups():
    """``split_gate_up`` moves exactly the fused expert stacks into a ``gate_up`` Muon group of 2 row blocks, right
    after ``matrix``, with the same hyper-parameters (the default); off, the groups are the ones from before the
    option; a dense model has no fused matrix, so its groups do not depend on it."""
    model = tiny_mixtral()
    fused = fused_gate_up(model)
    assert [id(p) for p in fused] == [id(d.layer.mlp.experts.gate_up_proj) for d in model[1:3]]
    default, off, on = (muon_param_groups(model, lr=0.03, weight_decay=0.1, **kw)
                        for kw in ({}, {"split_gate_up": False}, {"split_gate_up": True}))
    names = lambda groups: [g["name"] for g in groups]  # noqa: E731
    assert names(off) == ["matrix", "embedding", "head", "vector"]
    assert all("row_blocks" not in g for g in off)
    assert names(default) == names(on) == ["matrix", "gate_up", "embedding", "head", "vector"]
    gate_up = on[1]
    assert [id(p) for p in gate_up["params"]] == [id(p) for p in fused] and gate_up["row_blocks"] == 2
    assert {id(p) for p in on[0]["params"]} == {id(p) for p in off[0]["params"]} - {id(p) for p in fused}
    assert {k: v for k, v in gate_up.items() if k not in ("params", "name", "row_blocks")} == \
           {k: v for k, v in on[0].items() if k not in ("params", "name")}
    dense = tiny_llama()
    assert fused_gate_up(dense) == []
    assert [(g["name"], [id(p) for p in g["params"]]) for g in muon_param_groups(dense, split_gate_up=True)] == \
           [(g["name"], [id(p) for p in g["params"]]) for g in muon_param_groups(dense)]


@pytest.mark.parametrize("lr_rule", ["original", "match_rms_adamw"])
def test_split_gate_up_equals_separate_gate_and_up(lr_rule):
    """Split mode on a real Mixtral stage is Muon on each expert's gate and up matrices as separate tensors, bit for
    bit: the per-expert ``w1`` (gate) and ``w3`` (up) matrices the stage exports (``hf_state_dict``), as a model
    storing them separately, like the dense LLaMA path's ``gate_proj``/``up_proj``, is stepped. Fused mode is not:
    its directions differ at O(1)."""
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, lr_rule=lr_rule)
    runs = {}
    for split in (True, False):
        model = tiny_mixtral()
        opt = build_optimizer({"type": "Muon", "params": {**hp, "split_gate_up": split}}, model,
                              correction={"type": "ef"})
        layers = list(model[1:3])
        halves = [[t.detach().clone().requires_grad_() for t in layer_halves(d)] for d in layers]
        start = [torch.cat([t.detach().clone() for t in h]) for h in halves]
        singles = Muon([dict(params=[t for h in halves for t in h], use_muon=True)], correction=ErrorFeedback(1.0),
                       **hp)
        gen = torch.Generator().manual_seed(4)
        for _ in range(4):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            for d, h in zip(layers, halves):
                for t, g in zip(h, layer_halves(d, grad=True)):
                    t.grad = g.clone()
            opt.step()
            singles.step()
        runs[split] = [(torch.cat([t.detach() for t in layer_halves(d)]), torch.cat([t.detach() for t in h]), s0)
                       for d, h, s0 in zip(layers, halves, start)]
    for stacked, separate, _ in runs[True]:
        assert torch.equal(stacked, separate)
    for stacked, separate, s0 in runs[False]:
        # measured ~0.35 of the distance moved (random gradients, 4 steps); a mix-up of the modes would be 0
        assert (stacked - separate).norm() > 0.2 * (separate - s0).norm()


def layer_halves(decoder, grad: bool = False) -> list[torch.Tensor]:
    """Every expert's gate matrix, then every expert's up matrix, of one Mixtral decoder layer, as the exported
    ``w1``/``w3`` tensors (the stage's own ``hf_state_dict``, or the same split of the gradient)."""
    experts = decoder.layer.mlp.experts
    if grad:
        gate, up = experts.gate_up_proj.grad.chunk(2, dim=1)
        return [*gate.unbind(0), *up.unbind(0)]
    saved = decoder.hf_state_dict()
    keys = [decoder._expert_keys(e) for e in range(experts.num_experts)]
    return [saved[k["w1"]] for k in keys] + [saved[k["w3"]] for k in keys]


def test_split_gate_up_equals_slow_reference_on_the_halves():
    """Against the float64 reference run on the gate and up halves as two separate matrices (no row blocks in it):
    a ``row_blocks=2`` group agrees to bf16 Newton-Schulz accuracy (as ``test_hybrid_muon_equals_slow_reference``);
    the same stack as one matrix per expert does not."""
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, lr_rule="match_rms_adamw")
    gen = torch.Generator().manual_seed(6)
    start = torch.randn(3, 48, 32, generator=gen) * 0.05  # [E, 2I, H]: tall stack, wide halves
    errors = {}
    for blocks in (2, 1):
        stack = start.clone().requires_grad_()
        gate, up = (h.clone().requires_grad_() for h in start.chunk(2, dim=1))
        fast = Muon([dict(params=[stack], use_muon=True, row_blocks=blocks)], **hp)
        ref = ReferenceHybridMuon([gate, up], [], adam_lr=0.0, adam_betas=(0.9, 0.95), adam_eps=1e-8,
                                  adam_weight_decay=0.0, **hp)
        for _ in range(5):
            g = torch.randn(start.shape, generator=gen)
            stack.grad = g.clone()
            gate.grad, up.grad = (h.clone() for h in g.chunk(2, dim=1))
            fast.step()
            ref.step()
        want = torch.cat([gate.detach(), up.detach()], dim=1)
        errors[blocks] = ((stack.detach() - want).norm() / (want - start).norm()).item()
    assert errors[2] < 3e-2, errors
    assert errors[1] > 0.2, errors


def test_split_gate_up_option_is_checked():
    """``optimizer.params.split_gate_up`` is accepted as a JSON boolean and refused otherwise, naming the key, both
    where the emulation builds the optimizer and where the engine hands it to DeepSpeed; a ``row_blocks`` that does
    not divide a matrix's rows is refused when the optimizer is built."""
    model = tiny_mixtral(layers=1)
    for value in (True, False):
        opt = build_optimizer({"type": "Muon", "params": {"split_gate_up": value}}, model)
        assert ("gate_up" in [g["name"] for g in opt.param_groups]) is value
    for bad in ("true", 1, 0, None, [True]):
        block = {"type": "Muon", "params": {"lr": 0.02, "split_gate_up": bad}}
        with pytest.raises(ValueError, match=r"^optimizer.params.split_gate_up: must be true or false, got "):
            build_optimizer(block, model)
        with pytest.raises(OptimizerSetupError, match=r"^optimizer.params.split_gate_up: must be true or false"):
            client_optimizer(tiny_mixtral(layers=1), {"optimizer": block}, None, None, 1)
    with pytest.raises(ValueError, match=r"optimizer.params.split_gate_upp: unknown key for type 'Muon' \(did you "
                                         r"mean 'split_gate_up'\?\)"):
        build_optimizer({"type": "Muon", "params": {"split_gate_upp": True}}, model)
    with pytest.raises(ValueError, match=r"shape \(3, 7, 4\) has 7 rows, not 2 equal blocks"):
        Muon([dict(params=[torch.zeros(3, 7, 4, requires_grad=True)], use_muon=True, row_blocks=2)])
    with pytest.raises(ValueError, match="row_blocks must be a positive integer, got 0"):
        Muon([dict(params=[torch.zeros(4, 4, requires_grad=True)], use_muon=True, row_blocks=0)])
