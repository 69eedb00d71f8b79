"""The one-pass hybrid Muon (+ error feedback) step equals the Muon optimizer class, bit for bit on CPU, and writes
every output."""
import pytest
import torch
from torch import nn

from ds_async.optim import ErrorFeedback, Muon, NesterovLookahead, muon_param_groups
from ds_async.optim.muon_pass import hybrid_muon_step_, muon_hyper, muon_pass_

# Repeated shapes (batched Newton-Schulz), tall and wide, an expert stack, a matrix with an odd number of entries.
SHAPES = [(32, 16), (16, 48), (32, 16), (3, 24, 8), (37, 5), (16, 48)]
MAGNITUDES = [1.0, 1e-2, 10.0, 1e-4, 1.0]


def reference_grad(g: torch.Tensor, scale: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 gradient the class is given: ``G * scale`` rounded in ``grad_dtype`` (DeepSpeed's buffers)."""
    return (g.to(grad_dtype) * scale.to(grad_dtype)).float()


def assert_bits(have, want, what):
    assert torch.equal(have, want), f"{what}: {(have != want).sum().item()} entries differ, max " \
                                    f"{(have.float() - want.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lr_rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_muon_pass_equals_muon_class(weight_decay, ef, nesterov, lr_rule, grad_dtype):
    """Five steps from bf16 gradients times a clip factor, weight decay on or off (the class then skips the
    multiplication), gradients from large to tiny, the lr changed between steps (as a scheduler would): master,
    momentum and EF buffer bit-equal to ``Muon`` (with ``ErrorFeedback(0.7)`` or without a correction) on fp32
    masters whose ``.grad`` is the rounded scaled gradient; every bf16 output is the rounded master."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    hp = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=weight_decay, lr_rule=lr_rule)
    opt = Muon([dict(params=ref, use_muon=True)], correction=ErrorFeedback(0.7) if ef else None, **hp)
    masters = [p.clone() for p in init]
    momenta = [torch.zeros_like(p) for p in init]
    prevs = [torch.zeros_like(p) for p in init] if ef else None
    outs = [[torch.empty(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]
    group = opt.param_groups[0]
    for step, magnitude in enumerate(MAGNITUDES):
        group["lr"] = 0.02 * (1 - 0.1 * step)
        grads = [(torch.randn(s, generator=gen) * magnitude).to(torch.bfloat16) for s in SHAPES]
        scale = torch.tensor(0.37719)  # not a power of two: the product rounds
        for r, g in zip(ref, grads):
            r.grad = reference_grad(g, scale, grad_dtype)
        opt.step()
        hyper = muon_hyper(group, [m.shape for m in masters], torch.device("cpu"), 0.7 if ef else 0.0)
        muon_pass_(masters, grads, momenta, prevs, outs, hyper, scale, grad_dtype, nesterov=nesterov)
        for k, r in enumerate(ref):
            state = opt.state[r]
            assert_bits(masters[k], r.detach(), f"step {step} master {k}")
            assert_bits(momenta[k], state["momentum_buffer"], f"step {step} momentum {k}")
            if ef:
                assert_bits(prevs[k], state["ef_prev_update"], f"step {step} EF buffer {k}")
            for out in outs:
                assert torch.equal(out[k], masters[k].to(torch.bfloat16))
    assert not torch.equal(masters[0], init[0])


class TinyLM(nn.Module):
    """Every role of hybrid Muon: an embedding, hidden matrices (two of one shape), an expert stack, norm weights
    and biases, and a head declared as such."""

    def __init__(self, vocab=50, hidden=16, ffn=40, experts=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.05)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def ds_async_roles(self):
        return {self.head.weight: "head"}


class TinyMoELM(TinyLM):
    """TinyLM with transformers' Mixtral experts beside its plain expert stack: a fused ``[gate; up]`` stack
    ``[E, 2I, H]`` (tall, 24 x 16, with wide 12 x 16 halves) and its down stack."""

    def __init__(self):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        self.moe = MixtralExperts(MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=3))
        with torch.no_grad():  # transformers leaves them uninitialised (its init runs on whole models)
            for p in self.moe.parameters():
                p.normal_(0, 0.05)


def hybrid_twins(ef: bool, model_cls=TinyLM, **options):
    """Two identical hybrid Muons over fp32 copies of a ``model_cls``'s parameters; ``options``: more
    ``muon_param_groups`` arguments (``split_gate_up``)."""
    torch.manual_seed(0)
    model = model_cls()
    with torch.no_grad():  # norms away from their 1/0 init, so that weight decay and EF move them measurably
        for p in model.norm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hp = dict(lr=0.02, weight_decay=0.1, lr_rule="match_rms_adamw", adam_lr=3e-3, adam_betas=(0.9, 0.95),
              adam_eps=1e-8, adam_weight_decay=0.05)

    def build():
        groups = muon_param_groups(model, **hp, **options)
        for g in groups:  # fp32 masters: copies of the model's parameters
            g["params"] = [p.detach().clone().requires_grad_() for p in g["params"]]
        return Muon(groups, correction=ErrorFeedback(1.0) if ef else None)
    return build(), build()


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ef", [True, False])
def test_hybrid_muon_step_equals_muon_step(ef, grad_dtype):
    """A whole hybrid Muon (matrix group by the Muon pass; embedding, head and vector groups by the one-pass AdamW,
    then EF) against ``Muon.step()`` with the same correction: every parameter and every state tensor (momentum,
    AdamW moments and step, EF buffer) bit-equal after each step, bf16 outputs written for every group."""
    ref, fast = hybrid_twins(ef)
    names = [g["name"] for g in ref.param_groups]
    assert sorted(names) == ["embedding", "head", "matrix", "vector"]
    assert_fused_step_equals_class_step(ref, fast, grad_dtype)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ef", [True, False])
def test_hybrid_muon_step_equals_muon_step_with_split_gate_up(ef, grad_dtype):
    """As above with ``split_gate_up``: the fused ``[gate; up]`` stack in its own Muon group of two row blocks
    (beside a plain expert stack and the fused one's down stack in ``matrix``), fused step and class bit-equal."""
    ref, fast = hybrid_twins(ef, TinyMoELM, split_gate_up=True)
    assert [g["name"] for g in ref.param_groups] == ["matrix", "gate_up", "embedding", "head", "vector"]
    assert [tuple(p.shape) for p in ref.param_groups[1]["params"]] == [(3, 24, 16)]
    assert ref.param_groups[1]["row_blocks"] == 2
    assert_fused_step_equals_class_step(ref, fast, grad_dtype)


def assert_fused_step_equals_class_step(ref, fast, grad_dtype):
    """Step ``ref`` (``Muon.step()``) and ``fast`` (``hybrid_muon_step_``) with the same bf16 gradients: every
    parameter and state tensor bit-equal after each step, the bf16 outputs written, the lrs and the update
    statistics recorded."""
    masters = [p for g in fast.param_groups for p in g["params"]]  # group after group
    outs = [[torch.empty_like(p, dtype=torch.bfloat16) for p in masters] for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    for step, magnitude in enumerate(MAGNITUDES):
        scale = torch.tensor(0.61803)
        ref_params = [p for g in ref.param_groups for p in g["params"]]
        grads = [(torch.randn(p.shape, generator=gen) * magnitude).to(torch.bfloat16) for p in ref_params]
        for p, grad in zip(ref_params, grads):
            p.grad = reference_grad(grad, scale, grad_dtype)
        ref.step()
        hybrid_muon_step_(fast, grads, scale, outs, grad_dtype)
        for gr, gf in zip(ref.param_groups, fast.param_groups):
            for j, (pr, pf) in enumerate(zip(gr["params"], gf["params"])):
                what = f"step {step} {gr['name']}[{j}]"
                assert_bits(pf.detach(), pr.detach(), what)
                sr, sf = ref.state[pr], fast.state[pf]
                assert sr.keys() == sf.keys(), what
                for key in sr:
                    if torch.is_tensor(sr[key]):
                        assert_bits(sf[key], sr[key], f"{what} {key}")
                    else:
                        assert sf[key] == sr[key], f"{what} {key}"
                k = next(k for k, m in enumerate(masters) if m is pf)
                for out in outs:
                    assert torch.equal(out[k], pf.detach().to(torch.bfloat16)), what
        # The statistics tensorboard logs: the same keys, the same values up to the order of fp32 additions (the
        # fused step sums squares per tensor, the class squares per-chunk norms).
        want, got = ref.stats(), fast.stats()
        assert got.keys() == want.keys() and any(k.startswith("update_rms/") for k in want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5), (step, key)
            assert value > 0, (step, key)
    assert fast.last_lrs == ref.last_lrs


def test_hybrid_muon_step_skips_missing_gradients_and_refuses_other_corrections():
    """A ``None`` gradient leaves its parameter and state alone (as the class skips a parameter without ``.grad``);
    lists of the wrong length and a correction other than EF are refused rather than silently misapplied."""
    _, fast = hybrid_twins(False)
    masters = [p for g in fast.param_groups for p in g["params"]]
    grads = [torch.ones_like(p, dtype=torch.bfloat16) for p in masters]
    matrix = next(g for g in fast.param_groups if g["use_muon"])
    skipped, moved = matrix["params"][0], matrix["params"][1]
    before = skipped.detach().clone()
    grads[next(k for k, m in enumerate(masters) if m is skipped)] = None
    with pytest.raises(ValueError, match="outs.0. has 1 tensors"):
        hybrid_muon_step_(fast, grads, torch.tensor(1.0), [[torch.empty(1)]])
    hybrid_muon_step_(fast, grads, torch.tensor(1.0))
    assert torch.equal(skipped.detach(), before) and not fast.state[skipped]
    assert "momentum_buffer" in fast.state[moved]
    fast.correction = NesterovLookahead()
    with pytest.raises(NotImplementedError, match="NesterovLookahead"):
        hybrid_muon_step_(fast, grads, torch.tensor(1.0))
