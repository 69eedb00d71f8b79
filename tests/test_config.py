"""The ds_async config section fails at start, with one message naming the key."""
import json
import os
from pathlib import Path

import pytest
import torch

from ds_async import config
from ds_async.config import ConfigError, recomputed_layers
from ds_async.job import default_run_name, use_deterministic
from ds_async.models import check_seq_len, model_config
from ds_async.models.partition import stage_bounds
from ds_async.resume import stream_recipe

ROOT = Path(__file__).resolve().parents[1]

BASE = {"model": {"config": {"hidden_size": 64}}, "train": {"steps": 3}}


def parse(**overrides):
    return config.parse({**BASE, **overrides})


def test_defaults_fill_in():
    cfg = parse()
    assert cfg.schedule == "1f1b" and cfg.data.seq_len == 128 and cfg.train.steps == 3


def test_misspelled_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"ds_async\.data\.seq_lenght: unknown key \(did you mean 'ds_async\.data\.seq_len'\?\)"):
        parse(data={"seq_lenght": 256})


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"ds_async\.shedule: unknown key \(did you mean 'ds_async\.schedule'"):
        parse(shedule="2bw")


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"ds_async\.data\.seq_len: expected int, got str '128'"):
        parse(data={"seq_len": "128"})
    with pytest.raises(ConfigError, match=r"ds_async\.logging\.progress: expected bool, got int 1"):
        parse(logging={"progress": 1})


def test_bad_choice_is_named():
    with pytest.raises(ConfigError, match=r"ds_async\.schedule: must be one of \['1f1b', '2bw', 'pipedream'\], got '3bw'"):
        parse(schedule="3bw")


def test_steps_or_tokens():
    with pytest.raises(ConfigError, match="exactly one of 'steps' and 'tokens'"):
        parse(train={"steps": 3, "tokens": 100})


@pytest.mark.parametrize("ds,world,message", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2,
     r"train_batch_size: 30 != train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps \(4\) x "
     r"data-parallel degree \(1\) = 16"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 4,
     r"train_batch_size: 30 is not a multiple of train_micro_batch_size_per_gpu \(4\) x data-parallel degree \(2\)"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 3,
     r"ds_async\.pipeline_stages: 2 does not divide the world size 3"),
])
def test_inconsistent_batch_sizes(ds, world, message):
    with pytest.raises(ConfigError, match=message):
        config.check_batch(ds, parse(), world)


def test_batch_sizes_resolve():
    assert config.check_batch({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, parse(), 4) == (32, 4, 4)


def test_async_schedule_needs_enough_micro_batches():
    with pytest.raises(ConfigError, match=r"needs at least as many micro-batches as stages \(m=1 < p=2\)"):
        config.check_batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
                           parse(schedule="2bw"), 2)


def test_shipped_configs_parse(tmp_path):
    from pathlib import Path
    for path in sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json")):
        ds, cfg = config.load(str(path))
        assert "ds_async" not in ds and cfg.pipeline_stages >= 1, path


def test_missing_section(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    with pytest.raises(ConfigError, match="no \"ds_async\" section"):
        config.load(str(path))


def test_compile_scope_needs_compile_and_no_checkpointing():
    assert parse(performance={"compile": True, "compile_scope": "stage"}).performance.compile_scope == "stage"
    with pytest.raises(ConfigError, match=r"compile_scope: 'stage' needs compile: true"):
        parse(performance={"compile_scope": "stage"})
    with pytest.raises(ConfigError, match=r"compile_scope: 'stage' needs activation_checkpoint_interval 0"):
        parse(performance={"compile": True, "compile_scope": "stage", "activation_checkpoint_interval": 1})


def test_recomputed_layers_per_stage():
    """``activation_checkpoint_layers``: one count for every stage or one per stage; refused naming the key."""
    assert recomputed_layers(parse(performance={"activation_checkpoint_layers": 2}).performance, 2) == [2, 2]
    perf = parse(performance={"activation_checkpoint_layers": [3, 0]}).performance
    assert perf.activation_checkpoint_layers == [3, 0] and recomputed_layers(perf, 2) == [3, 0]
    key = "ds_async.performance.activation_checkpoint_layers"
    for perf, why in (({"activation_checkpoint_layers": [1, 2, 3]}, "one count per stage"),
                      ({"activation_checkpoint_layers": -1}, "counts must be >= 0"),
                      ({"activation_checkpoint_layers": True}, "expected int or list"),
                      ({"activation_checkpoint_layers": 1, "activation_checkpoint_interval": 1}, "not with"),
                      ({"activation_checkpoint_layers": [0, 1], "compile": True, "compile_scope": "stage"},
                       "needs activation_checkpoint_layers 0")):
        with pytest.raises(ConfigError, match=why) as e:
            parse(performance=perf)
        assert str(e.value).startswith(key) or "compile_scope" in str(e.value)
    assert parse(performance={"activation_checkpoint_layers": [0, 0], "compile": True,
                              "compile_scope": "stage"}).performance.compile_scope == "stage"


def test_resolved_config_loads_back():
    """The manifest's ``ds_async`` (every default filled in) is a valid section that parses to the same config,
    JSON key names included (``correction.lambda``)."""
    _, cfg = config.load(str(ROOT / "ds_configs" / "llama_0.9b_4gpu_2bw_muon_ef.json"))
    section = config.resolved(cfg)
    assert section["correction"]["lambda"] == 1.0 and "lam" not in section["correction"]
    assert config.parse(json.loads(json.dumps(section))) == cfg


def test_scheduler_length_comes_from_the_run_length():
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3}}}
    assert config.with_schedule_length(ds, 40)["scheduler"]["params"] == {"warmup_num_steps": 3, "total_num_steps": 40}
    same = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 40}}}
    assert config.with_schedule_length(same, 40) == same
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps: 12, but ds_async.train makes the run "
                                          r"40 steps long"):
        config.with_schedule_length({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 12}}}, 40)
    warmup_only = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    assert config.with_schedule_length(warmup_only, 40) == warmup_only


def test_model_config_keys_stage_count_and_batch_key_typos_are_named():
    """Hugging Face configs keep unknown kwargs silently; more stages than layers and a misspelled DeepSpeed batch
    key used to fail later with unrelated messages."""
    cfg = config.parse({"model": {"config": {"hidden_sise": 64}}, "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"ds_async.model.config.hidden_sise: not a llama config key \(did you "
                                          r"mean 'ds_async.model.config.hidden_size'\?\)"):
        model_config(cfg)
    ok = {"hidden_size": 64, "num_hidden_layers": 2, "rope_theta": 10000.0, "num_key_value_heads": 2}
    model_config(config.parse({"model": {"config": ok}, "train": {"steps": 1}}))  # rope_theta: taken, not kept
    deep = config.parse({"model": {"config": ok}, "train": {"steps": 1}, "pipeline_stages": 5})
    with pytest.raises(ConfigError, match=r"ds_async.pipeline_stages: 5 stages for 4 layers"):
        model_config(deep)
    cfg = config.parse({"model": {"config": ok}, "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"gradient_accumulation_step: not a DeepSpeed key \(did you mean "
                                          r"'gradient_accumulation_steps'\?\)"):
        config.check_batch({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_step": 4}, cfg, 2)


def test_seq_len_longer_than_the_model_is_named():
    cfg = config.parse({"model": {"config": {"max_position_embeddings": 64}}, "train": {"steps": 1},
                        "data": {"seq_len": 128}})
    with pytest.raises(ConfigError, match=r"ds_async.data.seq_len: 128 is longer than the model's "
                                          r"max_position_embeddings \(64\)"):
        check_seq_len(cfg, model_config(cfg))


def test_default_run_name_without_an_optimizer_block():
    cfg = config.parse({"model": {"config": {"vocab_size": 64}}, "train": {"steps": 1}})
    for ds_config in ({}, {"optimizer": None}, {"optimizer": {"type": "Muon"}}):
        name = default_run_name(cfg, ds_config)
        assert name.startswith(f"1f1b-{'Muon' if ds_config.get('optimizer') else 'none'}-"), name


def test_the_stream_recipe_a_resume_compares_names_what_moves_the_saved_position():
    def recipe(**over):
        section = {"model": {"config": {"vocab_size": 64}}, "train": {"steps": 1},
                   "data": {"train": "x", "validation": {"from_train": 5}}}
        for key, value in over.items():
            *path, last = key.split("__")
            node = section
            for k in path:
                node = node.setdefault(k, {})
            node[last] = value
        return stream_recipe(config.resolved(config.parse(section)))

    base = recipe()
    assert base["data.validation.from_train"] == 5 and base["data.train"] == "x"
    for key, value in (("data__validation", {"from_train": 6}), ("data__seq_len", 64), ("seed", 3),
                       ("data__shuffle_buffer", 10)):
        assert recipe(**{key: value}) != base, key
    assert recipe(eval={"every": 7}, data__validation={"from_train": 5}) == base  # evaluation does not move it


def test_gradient_clipping_defaults_to_deepspeeds():
    """The emulation and the planner read the clip the engine applies: DeepSpeed's default without the key."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert config.GRADIENT_CLIPPING_DEFAULT == GRADIENT_CLIPPING_DEFAULT
    assert config.gradient_clipping({}) == GRADIENT_CLIPPING_DEFAULT
    assert config.gradient_clipping({"gradient_clipping": 0}) == 0.0
    assert config.gradient_clipping({"gradient_clipping": 0.5}) == 0.5


@pytest.mark.parametrize("extra, error", [
    ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, "KeyError: 'bogus'"),
    ({"rope_theta": "abc"}, "TypeError: unsupported operand"),
])
def test_rotary_settings_that_cannot_be_built_are_refused_at_start(extra, error):
    """HF checks them only when a stage builds its rotary embedding, with an error that names no key."""
    section = {"model": {"config": {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, **extra}}, "train": {"steps": 1}}
    with pytest.raises(ConfigError, match=r"^ds_async.model.config.rope_\*: the rotary embedding cannot be built "
                                          rf"from rope_theta / rope_scaling \({error}"):
        model_config(config.parse(section))


@pytest.mark.parametrize("boundaries", [[0, 3, 5], [1, 3, 6], [0, 3, 3, 6], [0, 4, 2, 6], [0, 6], None])
def test_explicit_boundaries_must_cut_every_layer_into_the_stages_in_order(boundaries):
    """Three stages over 6 layers (embedding, 4 decoder layers, head): the last index must be 6, the first 0, and
    each stage must own at least one layer. The check (which build_pipeline runs) and the emulation's stage_bounds
    refuse alike, naming the key."""
    from torch import nn

    with pytest.raises(ConfigError, match=r"^ds_async\.partition\.boundaries: need 4 strictly increasing indices "
                                          r"from 0 to 6 \(embedding \+ 4 decoder layers \+ head\)"):
        config.check_boundaries(boundaries, 3, 6)
    with pytest.raises(ConfigError, match=r"^ds_async\.partition\.boundaries: need 4"):
        stage_bounds("explicit", [nn.Identity() for _ in range(6)], 3, boundaries)
    assert config.check_boundaries((0, 1, 5, 6), 3, 6) == [0, 1, 5, 6]


def test_deterministic_turns_on_torch_s_deterministic_algorithms(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        use_deterministic(parse().performance.deterministic)
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        use_deterministic(parse(performance={"deterministic": True}).performance.deterministic)
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)
