"""The 2BW engine under DeepSpeed's bf16 optimizer (bf16 weights, fp32 master) equals DeepSpeed's own bf16 steps.

Real DeepSpeed pipelines on 2 CPU ranks (gloo): the first 2BW update against stock DeepSpeed's, clipping at the
gradient hand-over against clipping in the step, ds_async's bf16 step against ``BF16_Optimizer``'s, and the fused
one-pass step against the unfused one, each compared bit for bit on the fp32 master (and where they apply the bf16
weights and the losses). Split from ``test_async_engine.py`` so that the two run on both test workers.
"""
import pytest
import torch

from distributed import assert_params_close, run_job, stage_params

from ds_async.pipe import schedule, version_rule

ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1, "torch_adam": True}}
MBS, SEQ = 2, 32


@pytest.mark.parametrize("immediate", [False, True], ids=["default", "immediate_grad_update"])
def test_2bw_first_bf16_update_equals_stock_deepspeed(tmp_path, immediate):
    """With DeepSpeed's bf16 optimizer the first 2BW update (gradients at W(0), as 1F1B's) equals stock
    DeepSpeed's bit for bit, fp32 master included: the micro-batch gradients that the version slots collect reach
    the optimizer's fp32 buffers exactly as DeepSpeed's own pipeline hands them over (measured: in either setting
    of ``immediate_grad_update``, stock DeepSpeed's pipeline sums a batch's micro-batch gradients in bf16)."""
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    kw = dict(stages=2, steps=1, mbs=MBS, gas=4, seq_len=SEQ, optimizer=sgd, clip=0.0,
              bf16={"enabled": True, "immediate_grad_update": immediate})
    run_job(2, "train", tmp_path / "ours", schedule="2bw", **kw)
    run_job(2, "train", tmp_path / "stock", stock=True, **kw)
    for s in range(2):
        ours, stock = (torch.load(tmp_path / d / f"master_stage{s}.pt") for d in ("ours", "stock"))
        torch.testing.assert_close(ours, stock, rtol=0, atol=0)


def test_1f1b_bf16_steps_equal_stock_deepspeed(tmp_path):
    """Under 1F1B over one replica the engine skips DeepSpeed's all-reduce and does only what it changes (the
    engine's ``_exec_reduce_grads``): with DeepSpeed's bf16 optimizer, 3 AdamW steps equal stock DeepSpeed's bit for
    bit, losses and fp32 master."""
    kw = dict(stages=2, steps=3, mbs=MBS, gas=4, seq_len=SEQ, optimizer=ADAMW, clip=0.0, bf16={"enabled": True})
    ours = run_job(2, "train", tmp_path / "ours", schedule="1f1b", **kw)
    stock = run_job(2, "train", tmp_path / "stock", stock=True, **kw)
    torch.testing.assert_close(ours["losses"], stock["losses"], rtol=0, atol=0)
    for s in range(2):
        mine, theirs = (torch.load(tmp_path / d / f"master_stage{s}.pt") for d in ("ours", "stock"))
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_2bw_bf16_clipping_at_the_hand_over_equals_clipping_in_the_step(tmp_path):
    """With one replica the engine clips bf16 gradients as it hands them over (norm summed from the bf16 gradients,
    g * factor written into DeepSpeed's gradient buffers in one pass); with replicas it copies them at the batch
    boundary, sums the norm from the copies and clips those in the step. Over several steps with clipping active
    both leave the fp32 master bit-equal, and differ from not clipping."""
    kw = dict(stages=2, steps=4, mbs=MBS, gas=4, seq_len=SEQ, optimizer=ADAMW, schedule="2bw",
              bf16={"enabled": True})
    at_hand_over = run_job(2, "train", tmp_path / "at_hand_over", clip=1e-3, **kw)
    in_step = run_job(2, "train", tmp_path / "in_step", clip=1e-3, clip_at_hand_over=False, **kw)
    run_job(2, "train", tmp_path / "unclipped", clip=0.0, **kw)
    assert at_hand_over["clip_at_hand_over"] is True and in_step["clip_at_hand_over"] is False
    for s in range(2):
        got, want, unclipped = (torch.load(tmp_path / d / f"master_stage{s}.pt")
                                for d in ("at_hand_over", "in_step", "unclipped"))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got, unclipped)


@pytest.mark.parametrize("drop_grad_at", [None, 2], ids=["every-grad", "one-grad-missing-in-batch-2"])
def test_2bw_bf16_steps_equal_deepspeeds_bf16_optimizer(tmp_path, drop_grad_at):
    """Over several 2BW steps, ds_async's bf16 step (norm computed ahead, fp32 gradients overwritten by each hand-over
    instead of zeroed twice per step) leaves the fp32 master bit-equal to DeepSpeed's own ``BF16_Optimizer`` step,
    which adds each hand-over to buffers it zeroes. A gradient left over from an earlier batch would add a whole
    extra update: with one parameter's gradient missing in a batch, its buffer must hold zeros, not batch 1's."""
    kw = dict(stages=2, steps=4, mbs=MBS, gas=4, seq_len=SEQ, optimizer=ADAMW, clip=0.0, schedule="2bw",
              bf16={"enabled": True}, drop_grad_at=drop_grad_at)
    run_job(2, "train", tmp_path / "ours", **kw)
    run_job(2, "train", tmp_path / "deepspeed", deepspeed_bf16_step=True, **kw)
    for s in range(2):
        ours, ref = (torch.load(tmp_path / d / f"master_stage{s}.pt") for d in ("ours", "deepspeed"))
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


@pytest.mark.parametrize("clip, drop_grad_at", [(1e-3, None), (0.0, 2)],
                         ids=["clipped", "unclipped-one-grad-missing-in-batch-2"])
def test_2bw_fused_optimizer_step_equals_the_unfused_step(tmp_path, clip, drop_grad_at):
    """``performance.fused_optimizer_step`` goes from the bf16 gradients to the master, the moments, the bf16
    weights and the next weight version in one pass per tensor. Over several 2BW steps the fp32 master, the bf16
    weights and every loss (computed on the published versions) are bit-equal to the unfused step: with clipping,
    ds_async's clip at the hand-over; without, DeepSpeed's own ``BF16_Optimizer`` step, including a parameter that
    gets no gradient in one batch."""
    kw = dict(stages=2, steps=4, mbs=MBS, gas=4, seq_len=SEQ, optimizer=ADAMW, clip=clip, schedule="2bw",
              bf16={"enabled": True}, drop_grad_at=drop_grad_at)
    fused = run_job(2, "train", tmp_path / "fused", performance={"fused_optimizer_step": True}, **kw)
    ref = run_job(2, "train", tmp_path / "ref", deepspeed_bf16_step=clip == 0.0, **kw)
    torch.testing.assert_close(fused["losses"], ref["losses"], rtol=0, atol=0)
    assert_params_close(stage_params(tmp_path / "fused", 2), stage_params(tmp_path / "ref", 2), rel=0)
    for s in range(2):
        got, want = (torch.load(tmp_path / d / f"master_stage{s}.pt") for d in ("fused", "ref"))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_optimizer_step_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(AssertionError, match="fused_optimizer_step needs"):
        run_job(2, "train", tmp_path, stages=2, steps=1, mbs=MBS, gas=2, seq_len=SEQ, optimizer=ADAMW,
                schedule="2bw", performance={"fused_optimizer_step": True})  # fp32: no bf16 optimizer


def test_4_stage_2bw_gradients_that_wait_for_the_step_survive_the_next_batchs_backwards(tmp_path):
    """From the third stage of a 4-stage 2BW pipeline on, the next batch's backward passes run between a batch's
    gradient gather and its optimizer step. Where the gradients wait on the bf16 parameters for the step (clipped
    as they are handed over, or read by the fused step), DeepSpeed's per-backward zeroing of those parameters'
    gradients must not reach them: both leave every stage's fp32 master, bf16 weights and losses bit-equal to
    handing the gradients over at the batch boundary, where nothing waits."""
    for stage in (2, 3):  # the premise: a backward between the batch's ReduceGrads and its OptimizerStep
        steps = [type(c).__name__ for cmds in schedule.FlushFreeSchedule(4, 4, stage, version_rule.get("2bw"),
                                                                       first_batch=0, end_batch=2).steps()
                 for c in cmds]
        reduce = steps.index("ReduceGrads")
        assert "BackwardPass" in steps[reduce:steps.index("OptimizerStep", reduce)]
    kw = dict(stages=4, steps=3, mbs=MBS, gas=4, seq_len=SEQ, optimizer=ADAMW, clip=1e-3, schedule="2bw",
              bf16={"enabled": True})
    boundary = run_job(4, "train", tmp_path / "boundary", clip_at_hand_over=False, **kw)
    for name, extra in (("at_hand_over", {}), ("fused", {"performance": {"fused_optimizer_step": True}})):
        got = run_job(4, "train", tmp_path / name, **extra, **kw)
        torch.testing.assert_close(got["losses"], boundary["losses"], rtol=0, atol=0)
        assert_params_close(stage_params(tmp_path / name, 4), stage_params(tmp_path / "boundary", 4), rel=0)
        for s in range(4):
            have, want = (torch.load(tmp_path / d / f"master_stage{s}.pt") for d in (name, "boundary"))
            torch.testing.assert_close(have, want, rtol=0, atol=0)
