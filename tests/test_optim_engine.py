"""ds_async's optimizers inside the DeepSpeed pipeline engine: selected from JSON, equal to the emulation, and
refused where DeepSpeed would hand them something they cannot use."""
import pytest
import torch
from torch import nn

from distributed import assert_params_close, emulate_run, run_job, stage_params
from ds_async.optim.client import OptimizerSetupError, client_optimizer
from ds_async.optim.master import MasterWeights

MUON = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 3e-3,
                                   "adam_weight_decay": 0.1}}
EF = {"type": "ef", "lambda": 1.0}
STEPS, MBS, SEQ = 10, 2, 32


def _run_2bw(out, nproc, gas, **extra):
    return run_job(nproc, "train", out, stages=2, steps=STEPS, mbs=MBS, gas=gas, seq_len=SEQ, schedule="2bw",
                   optimizer=MUON, correction=EF, **extra)


def test_2bw_muon_ef_equals_emulation(tmp_path):
    got = _run_2bw(tmp_path, 2, 4, stats=True)
    losses, want = emulate_run("2bw", 2, STEPS, 4, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF)
    _, plain = emulate_run("2bw", 2, STEPS, 4, 1, MUON, seq_len=SEQ, mbs=MBS)
    assert max((plain[k] - want[k]).abs().max().item() for k in want) > 1e-3, "EF must change the run"
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)  # the engine averages the report differently
    assert_params_close(stage_params(tmp_path, 2), want, rel=0)
    # The tensorboard figures of the last step, gathered over both stages.
    stats = got["optimizer_stats"]
    assert {"update_rms/matrix", "update_rms/embedding", "update_rms/head", "base_update_rms/matrix",
            "ef_buffer_norm", "lr/matrix", "staleness"} <= stats.keys(), sorted(stats)
    assert stats["staleness"] > 0 and stats["ef_buffer_norm"] > 0 and stats["lr/matrix"] == MUON["params"]["lr"]


def test_2bw_muon_ef_zero1_data_parallel(tmp_path):
    """ZeRO-1 with 2 replicas (ds_async's tensor-granular sharding: each replica steps half the matrices) is
    bit-equal to the emulation, which sums each replica's micro-batches before averaging the replicas, as the
    all-reduce does."""
    sharded = _run_2bw(tmp_path, 4, 2, zero_optimization={"stage": 1})
    losses, want = emulate_run("2bw", 2, STEPS, 2, 2, MUON, seq_len=SEQ, mbs=MBS, correction=EF)
    torch.testing.assert_close(sharded["losses"], losses, rtol=1e-6, atol=0)  # loss reports average differently
    assert_params_close(stage_params(tmp_path, 2), want, rel=0)


def test_2bw_muon_ef_at_depth_8_equals_emulation(tmp_path):
    """Eight stages (embedding, six decoder layers, head: one layer each), m = 8: the depth of the eight-GPU run,
    on CPU. Clipping is off here: the global norm summed over eight ranks rounds differently from the emulation's
    sum, and Muon's bf16 Newton-Schulz turns that last-bit difference into bf16-sized ones."""
    from jobs import TINY_LLAMA

    model = {"config": {**TINY_LLAMA, "num_hidden_layers": 6}}
    kw = dict(optimizer=MUON, correction=EF, model=model, clip=0.0)
    got = run_job(8, "train", tmp_path, stages=8, steps=STEPS, mbs=MBS, gas=8, seq_len=SEQ, schedule="2bw",
                  timeout=900, **kw)
    losses, want = emulate_run("2bw", 8, STEPS, 8, 1, seq_len=SEQ, mbs=MBS, **kw)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)
    assert_params_close(stage_params(tmp_path, 8), want, rel=0)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)


@pytest.mark.parametrize("extra,message", [
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}, "bf16 and torch_autocast are both enabled"),
    ({"fp16": {"enabled": True}}, "fp16 is not supported"),
    ({"zero_optimization": {"stage": 2}}, "ZeRO stage 2"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "offload"),
])
def test_muon_refused_where_it_cannot_run(extra, message):
    with pytest.raises(OptimizerSetupError, match=message):
        client_optimizer(_Tiny(), {"optimizer": MUON, **extra}, None, None, 1)


def test_zero1_muon_becomes_tensor_sharding_and_elementwise_keeps_deepspeed_zero():
    config, opt = client_optimizer(_Tiny(), {"optimizer": MUON, "zero_optimization": {"stage": 1}}, EF, None, 1)
    assert "optimizer" not in config and config["zero_optimization"]["stage"] == 0
    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    config, opt = client_optimizer(_Tiny(), {"optimizer": adamw, "zero_optimization": {"stage": 1}}, EF, None, 1)
    assert config["zero_optimization"]["stage"] == 1 and config["zero_allow_untested_optimizer"]
    # No ds_async type and no correction: DeepSpeed builds its own optimizer from the block.
    config, opt = client_optimizer(_Tiny(), {"optimizer": adamw}, None, None, 1)
    assert opt is None and config["optimizer"] == adamw


def test_1f1b_muon_ef_equals_emulation(tmp_path):
    got = run_job(2, "train", tmp_path, stages=2, steps=6, mbs=MBS, gas=2, seq_len=SEQ, schedule="1f1b",
                  optimizer=MUON, correction=EF)
    losses, want = emulate_run("1f1b", 2, 6, 2, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)
    assert_params_close(stage_params(tmp_path, 2), want, rel=0)


def test_adamw_ef_trains_under_deepspeed_bf16(tmp_path):
    """DeepSpeed's bf16 optimizer hands ds_async's AdamW flat fp32 partitions: elementwise, so EF still applies."""
    adamw = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
    got = run_job(2, "train", tmp_path, stages=2, steps=STEPS, mbs=MBS, gas=2, seq_len=SEQ, schedule="2bw",
                  optimizer=adamw, correction=EF, bf16={"enabled": True}, stats=True)
    losses = got["losses"]
    assert torch.isfinite(losses).all() and losses[-3:].mean() < losses[:3].mean() - 0.3, losses
    # EF's buffer holds the last update, and the update applied is not the base one (without EF neither exists).
    stats = got["optimizer_stats"]
    assert stats["ef_buffer_norm"] > 0 and stats["update_rms/group0"] != stats["base_update_rms/group0"], stats


# ------------------------------------------------------------------------------ bf16 weights, fp32 masters
def test_bf16_muon_keeps_fp32_masters_per_whole_tensor():
    """Under ``"bf16"`` Muon is not refused: DeepSpeed gets the job without its bf16 block (so no flat partitions),
    the module's weights become bf16 and the optimizer keeps fp32 masters of the same shapes."""
    module = _Tiny()
    config, opt = client_optimizer(module, {"optimizer": MUON, "bf16": {"enabled": True}}, EF, None, 1)
    assert "bf16" not in config and isinstance(opt, MasterWeights)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert [m.shape for m in opt.masters] == [w.shape for w in opt.weights]
    assert all(m.dtype == torch.float32 for m in opt.masters)


@pytest.mark.parametrize("extra,message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}},
     "fused_optimizer_step: with optimizer type 'AdamW' and bf16 it is implemented for Muon only"),
    ({"optimizer": MUON}, "fused_optimizer_step: with optimizer type 'Muon' it needs bf16 weights"),
])
def test_fused_step_refused_where_it_does_not_apply(extra, message):
    with pytest.raises(OptimizerSetupError, match=message):
        client_optimizer(_Tiny(), extra, EF, None, 1, fused=True)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_bf16_muon_ef_equals_emulation(tmp_path, schedule):
    """bf16 weights and version slots, fp32 masters, momentum and EF buffer per whole tensor, the clip factor
    applied as the step reads the bf16 gradients: bit-equal to the emulation running the same bf16 arithmetic,
    which differs from the fp32 run and, under 2BW, from the synchronous rule."""
    got = run_job(2, "train", tmp_path, stages=2, steps=STEPS, mbs=MBS, gas=4, seq_len=SEQ, schedule=schedule,
                  optimizer=MUON, correction=EF, bf16={"enabled": True})
    losses, want, masters = emulate_run(schedule, 2, STEPS, 4, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF,
                                        bf16=True, with_masters=True)
    _, fp32 = emulate_run(schedule, 2, STEPS, 4, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF)
    assert all(w.dtype == torch.bfloat16 for w in want.values())
    assert max((fp32[k] - want[k].float()).abs().max().item() for k in want) > 1e-3, "bf16 must change the run"
    if schedule == "2bw":
        _, sync = emulate_run("1f1b", 2, STEPS, 4, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF, bf16=True)
        assert max((sync[k].float() - want[k].float()).abs().max().item() for k in want) > 1e-3
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)
    assert_params_close(stage_params(tmp_path, 2), want, rel=0)
    assert torch.equal(torch.cat([torch.load(tmp_path / f"master_stage{s}.pt") for s in range(2)]), masters)


@pytest.mark.parametrize("drop_grad_at", [None, 2], ids=["every-grad", "one-grad-missing-in-batch-2"])
def test_bf16_muon_ef_fused_step_equals_the_unfused_step(tmp_path, drop_grad_at):
    """``performance.fused_optimizer_step`` with bf16 Muon + EF: the step in a few passes per tensor
    (:func:`ds_async.optim.muon_pass.hybrid_muon_step_`), writing the new weight version itself, leaves the masters,
    the bf16 weights and every loss bit-equal to MasterWeights' unfused step (CPU: both eager), also where a
    parameter gets no gradient in a batch (not stepped, yet written into the new version's slot)."""
    kw = dict(stages=2, steps=STEPS, mbs=MBS, gas=4, seq_len=SEQ, schedule="2bw", optimizer=MUON, correction=EF,
              bf16={"enabled": True}, drop_grad_at=drop_grad_at)
    fused = run_job(2, "train", tmp_path / "fused", performance={"fused_optimizer_step": True}, **kw)
    plain = run_job(2, "train", tmp_path / "plain", **kw)
    torch.testing.assert_close(fused["losses"], plain["losses"], rtol=0, atol=0)
    assert_params_close(stage_params(tmp_path / "fused", 2), stage_params(tmp_path / "plain", 2), rel=0)
    for s in range(2):
        assert torch.equal(torch.load(tmp_path / "fused" / f"master_stage{s}.pt"),
                           torch.load(tmp_path / "plain" / f"master_stage{s}.pt"))


@pytest.mark.parametrize("stages,zero,bf16", [(2, 0, False), (2, 0, True), (3, 0, True), (2, 1, True)],
                         ids=["2x2-zero0-fp32", "2x2-zero0-bf16", "3x2-zero0-bf16", "2x2-zero1-bf16"])
def test_2bw_muon_ef_replicas_equal_emulation(tmp_path, stages, zero, bf16):
    """Two replicas per stage. At ZeRO-0 each replica orthogonalises about half the matrices and all-gathers the
    rest (:mod:`ds_async.optim.ns_split`); at ZeRO-1 each owner steps its own; either way bit-equal to the
    emulation, which orthogonalises every matrix in one process."""
    steps = 6
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    got = run_job(stages * 2, "train", tmp_path, stages=stages, steps=steps, mbs=MBS, gas=stages, seq_len=SEQ,
                  schedule="2bw", optimizer=MUON, correction=EF, zero_optimization={"stage": zero}, **extra)
    losses, want = emulate_run("2bw", stages, steps, stages, 2, MUON, seq_len=SEQ, mbs=MBS, correction=EF,
                               bf16=bf16)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)
    assert_params_close(stage_params(tmp_path, stages), want, rel=0)


def test_fused_step_refuses_a_correction_it_does_not_implement():
    """Refused at setup, naming the key, rather than at the first step after the model is built and compiled."""
    with pytest.raises(OptimizerSetupError, match="fused_optimizer_step: implemented for the 'ef' correction or "
                                                  "none, not NesterovLookahead"):
        client_optimizer(_Tiny(), {"optimizer": MUON, "bf16": {"enabled": True}}, {"type": "nesterov"}, None, 1,
                         fused=True)


@pytest.mark.parametrize("fused", [False, True], ids=["class-step", "fused-step"])
def test_4_stage_bf16_muon_ef_equals_emulation(tmp_path, fused):
    """The paper's recipe as the shipped 4-GPU configs run it (bf16 Muon + EF under 2BW, 4 stages, one replica),
    where stages 2 and 3 run the next batch's backward passes while a batch's gradients wait for its step: bit-equal
    to the emulation, with the class step and the fused one."""
    got = run_job(4, "train", tmp_path, stages=4, steps=6, mbs=MBS, gas=4, seq_len=SEQ, schedule="2bw",
                  optimizer=MUON, correction=EF, bf16={"enabled": True}, performance={"fused_optimizer_step": fused})
    losses, want = emulate_run("2bw", 4, 6, 4, 1, MUON, seq_len=SEQ, mbs=MBS, correction=EF, bf16=True)
    torch.testing.assert_close(got["losses"], losses, rtol=1e-6, atol=0)
    assert_params_close(stage_params(tmp_path, 4), want, rel=0)
