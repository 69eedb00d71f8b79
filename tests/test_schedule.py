"""The flush-free schedules as data: no processes, every stage simulated together; the version rules by hand,
and where the engine refuses a rule."""
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_async import config as cfgmod
from ds_async.pipe import schedule as fs
from ds_async.pipe.engine import AsyncPipelineEngine
from ds_async.pipe.version_rule import RULES, SCHEDULES, ConstantDelay, get
from ds_async.pipe.simulate import ScheduleError, simulate
from ds_async.trainer import Trainer

GRID = [(2, 2), (2, 5), (3, 3), (3, 5), (4, 4), (4, 8), (5, 7), (8, 8), (8, 16)]


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("batches", [1, 4])
def test_2bw_invariants(p, m, batches):
    r = simulate("2bw", p, m, batches)
    assert r.messages == 2 * (p - 1) * m * batches  # one activation and one gradient per micro-batch and boundary
    for s in range(p):
        assert r.max_alive[s] <= 2
        for t in range(batches):
            assert r.delays[(s, t)] == ({0} if t == 0 else {1}), (s, t)  # W(t+1) = W(t) - U(grad at W(t-1))
    # Warm-up and drain happen once per segment, not once per batch: the idle steps do not grow with batches.
    assert r.idle_steps == [2 * (p - 1)] * p


def _steps_at(delay, p, m, s, batches, kind):
    """{batch: step id} of the ``kind`` instructions (ReduceGrads / OptimizerStep) on stage ``s``."""
    sched = fs.FlushFreeSchedule(m, p, s, delay, end_batch=batches)
    return {c.batch: k for k, cmds in enumerate(sched.steps()) for c in cmds if isinstance(c, kind)}


@pytest.mark.parametrize("p,m", GRID)
def test_2bw_steps_when_stage_0_has_reduced(p, m):
    """Each stage's update waits for the pipeline's gradient norm, which stage 0 completes last: it is issued at
    the step where stage 0 reduces the batch (or, for the last batch, at the drain), never before."""
    batches = 3
    first_stage = _steps_at("2bw", p, m, 0, batches, fs.ReduceGrads)
    for s in range(p):
        reduce = _steps_at("2bw", p, m, s, batches, fs.ReduceGrads)
        step = _steps_at("2bw", p, m, s, batches, fs.OptimizerStep)
        assert sorted(step) == list(range(batches))
        for t in range(batches - 1):
            assert reduce[t] == first_stage[t] - s and step[t] == first_stage[t], (s, t)
        assert step[batches - 1] >= reduce[batches - 1]
    assert _steps_at("pipedream", p, m, p - 1, batches, fs.OptimizerStep) == \
        _steps_at("pipedream", p, m, p - 1, batches, fs.ReduceGrads)  # its slack may be nil: no wait


@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 2), (3, 5), (8, 1)])
def test_pipedream_variable_delay(p, m):
    batches = 3 * p
    r = simulate("pipedream", p, m, batches)
    for s in range(p):
        assert r.max_alive[s] <= RULES["pipedream"].max_versions(s, p, m)
        for t in range(p, batches):
            if m == 1:  # original PipeDream: stage s lags p - 1 - s updates
                assert r.delays[(s, t)] == {p - 1 - s}
            else:
                assert max(r.delays[(s, t)]) == -(-(p - 1 - s) // m)
    assert r.max_alive[0] == RULES["pipedream"].max_versions(0, p, m)


def test_sync_pays_the_bubble_every_batch():
    """DeepSpeed's TrainSchedule idles 2(p-1) steps per batch; the flush-free one 2(p-1) per segment."""
    p, m, batches = 4, 4, 5
    sync_idle = sum(not any(isinstance(c, (ds.ForwardPass, ds.BackwardPass)) for c in cmds)
                    for cmds in ds.TrainSchedule(m, p, 0).steps()) * batches
    assert sync_idle == 2 * (p - 1) * batches
    assert simulate("2bw", p, m, batches).idle_steps[0] == 2 * (p - 1)


def test_schedule_lives_across_calls():
    """end_batch may be set while the generator runs: the stage then drains after that batch."""
    sched = fs.FlushFreeSchedule(4, 2, 0, "2bw")
    steps = iter(sched.steps())
    seen = []
    for cmds in steps:
        seen += cmds
        if any(isinstance(c, fs.OptimizerStep) for c in cmds):
            break
    sched.end_batch = 2
    seen += [c for cmds in steps for c in cmds]
    assert [c.batch for c in seen if isinstance(c, fs.OptimizerStep)] == [0, 1]
    assert max(c.micro_batch for c in seen if isinstance(c, fs.ForwardPass)) == 7


def test_2bw_refuses_fewer_micro_batches_than_stages():
    with pytest.raises(ValueError, match=r"m=3 < p=4"):
        fs.FlushFreeSchedule(3, 4, 0, "2bw")


def test_version_rule():
    assert [RULES["2bw"].weight_version(j, 0, 4, 4) for j in range(12)] == [0] * 8 + [1] * 4
    assert [RULES["pipedream"].weight_version(j, 0, 4, 1) for j in range(6)] == [0, 0, 0, 0, 1, 2]
    assert [RULES["1f1b"].weight_version(j, 0, 4, 4) for j in range(8)] == [0] * 4 + [1] * 4


def test_constant_delay_rule_by_hand():
    """``delay<d>``: batch t on every stage reads W(t - d), W(0) before that, whatever m and p."""
    two = get("delay2")
    for stage in range(5):
        assert [two.weight_version(j, stage, 5, 1) for j in range(6)] == [0, 0, 0, 1, 2, 3]
        assert [two.weight_version(j, stage, 5, 2) for j in range(10)] == [0] * 6 + [1, 1, 2, 2]
        assert two.delay(stage, 5, 1) == 2 and two.delay(stage, 5, 3) == 2
    assert two.max_versions(0, 5, 1) == 3 and two.min_micro_batches(5) == 1 and two.emulation_only
    assert [get("delay0").weight_version(j, 1, 3, 2) for j in range(8)] == \
        [RULES["1f1b"].weight_version(j, 1, 3, 2) for j in range(8)]
    # 2BW's rule at any m, without its m >= p: delay1 at p = 4, m = 1
    assert [get("delay1").weight_version(j, 0, 4, 1) for j in range(4)] == [0, 0, 1, 2]
    get("delay1").check(4, 1)
    # the study's pairs: PipeDream at m = 1 has delays p - 1 - s, mean (p - 1) / 2, which delay<(p - 1) / 2> matches
    for p in (3, 5, 7):
        delays = [RULES["pipedream"].delay(s, p, 1) for s in range(p)]
        assert delays == list(range(p - 1, -1, -1))
        d = get(f"delay{(p - 1) // 2}")
        assert [d.delay(s, p, 1) for s in range(p)] == [sum(delays) // p] * p and sum(delays) % p == 0
    assert get("delay3") == get("delay3") and get("delay3").name == "delay3" and get(two) is two
    for bad in ("delay02", "delay-1", "delay", "delay1.5", "delayed2", "2bw1"):
        with pytest.raises(ValueError, match="unknown schedule"):
            get(bad)
    with pytest.raises(ValueError, match="whole number of steps >= 0"):
        ConstantDelay("d", flush_free=True, steps=-1)


def test_constant_delay_is_emulation_only(tmp_path):
    """The config takes ``delay<d>`` (the emulation runs it); the engine and the trainer refuse it at setup, by key,
    before DeepSpeed or a process group is made."""
    import json

    section = {"model": {"config": {"hidden_size": 8}}, "train": {"steps": 1}}
    assert cfgmod.parse({**section, "schedule": "delay2"}).schedule == "delay2"
    with pytest.raises(cfgmod.ConfigError, match=r"ds_async\.schedule: must be one of \['1f1b', '2bw', 'pipedream'\], "
                                                 r"got 'delay02' \(or 'delay<d>'"):
        cfgmod.parse({**section, "schedule": "delay02"})
    assert SCHEDULES == ("1f1b", "2bw", "pipedream")
    for name in SCHEDULES:
        get(name).check_engine()
    with pytest.raises(ValueError, match=r"^ds_async\.schedule: 'delay2' is emulation only"):
        AsyncPipelineEngine(schedule="delay2")
    raw = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "demo_cpu.json").read_text())
    raw["ds_async"]["schedule"] = "delay1"
    path = tmp_path / "delay1.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(cfgmod.ConfigError, match=r"^ds_async\.schedule: 'delay1' is emulation only .*"
                                                 r"runs \['1f1b', '2bw', 'pipedream'\]"):
        Trainer(str(path))


@pytest.mark.parametrize("p", [2, 3, 5])
def test_simulator_lays_a_constant_delay_on_the_grid_where_it_fits(p):
    """At m = 1 the 1F1B grid gives stage s its forward of micro-batch j after j - (p - 1 - s) updates: a constant
    delay of p - 1 fits every stage (the versions exist, the stash holds them), a shorter one does not on stage 0."""
    batches = 3 * p
    r = simulate(f"delay{p - 1}", p, 1, batches)
    for s in range(p):
        assert r.max_alive[s] <= p
        for t in range(p, batches):
            assert r.delays[(s, t)] == {p - 1}
    with pytest.raises(ScheduleError, match="stage 0: forward of micro-batch .* before it exists"):
        simulate(f"delay{p - 2}", p, 1, batches)


class _DropsASend(fs.FlushFreeSchedule):
    def steps(self):
        dropped = False
        for cmds in super().steps():
            if not dropped and any(isinstance(c, ds.SendActivation) for c in cmds):
                cmds = [c for c in cmds if not isinstance(c, ds.SendActivation)]
                dropped = True
            yield cmds


class _ForwardsTooEarly(fs.FlushFreeSchedule):
    def _version(self, local):
        return super()._version(local) + 1


def test_simulator_finds_deadlocks_and_version_errors():
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate("2bw", 3, 3, 2, schedule_cls=_DropsASend)
    with pytest.raises(ScheduleError, match="before it exists"):
        simulate("2bw", 2, 2, 2, schedule_cls=_ForwardsTooEarly)


def test_grid_renders():
    text = simulate("2bw", 3, 3, 2).render()
    assert "F0v0" in text and "+S1" in text and "bubble" in text
