"""The delay emulation on models small enough to follow by hand."""
import pytest
import torch
from torch import nn

from ds_async.emulate import DelayedTrainer


def scalar_run(schedule: str, steps: int, lr: float = 0.5, w0: float = 1.0, stages: int = 1):
    """f(w) = w^2 / 2 (a 1x1 linear layer fed x=1 against target 0), plain SGD: gradient = w."""
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(w0)
    trainer = DelayedTrainer([layer], [0], lambda out, y: 0.5 * ((out - y) ** 2).mean(),
                             torch.optim.SGD(layer.parameters(), lr=lr), schedule, micro_batches=1, stages=stages)
    batch = [(torch.ones(1, 1), torch.zeros(1, 1))]
    ws = [w0]
    for _ in range(steps):
        trainer.train_batch(batch)
        ws.append(layer.weight.item())
    return ws


def test_sync_trajectory():
    assert scalar_run("1f1b", 4) == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_2bw_trajectory_by_hand():
    # w(t+1) = w(t) - 0.5 * w(t-1), with w(-1) = w(0) = 1:
    # w1 = 1 - .5*1 = .5;  w2 = .5 - .5*1 = 0;  w3 = 0 - .5*.5 = -.25;  w4 = -.25 - .5*0 = -.25;  w5 = -.25 + .125
    assert scalar_run("2bw", 5) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]


def test_pipedream_first_stage_of_three_lags_two_steps():
    # Stage 0 of 3 with m = 1 runs on W(t-2): w(t+1) = w(t) - 0.5 * w(t-2), W(<0) = W(0) = 1:
    # w1 = .5, w2 = 0, w3 = 0 - .5*1 = -.5, w4 = -.5 - .5*.5 = -.75, w5 = -.75 - 0 = -.75
    assert scalar_run("pipedream", 5, stages=3) == [1.0, 0.5, 0.0, -0.5, -0.75, -0.75]


def test_wrong_micro_batch_count_is_refused():
    layer = nn.Linear(1, 1, bias=False)
    trainer = DelayedTrainer([layer], [0], lambda o, y: o.sum(), torch.optim.SGD(layer.parameters(), lr=0.1),
                             "2bw", micro_batches=2, stages=1)
    with pytest.raises(ValueError, match="needs 2 micro-batches, got 1"):
        trainer.train_batch([(torch.ones(1, 1), torch.zeros(1, 1))])
