"""The Hugging Face export is usable as is (issue 22), and export refuses what it must (issue 23).

One real 2-stage 2BW training job (torchrun, gloo, the trainer of ``launch/train.py``) on the Lee corpus with a tiny
LLaMA and a byte-level BPE whose ``<|endoftext|>`` is id 0 writes a checkpoint; ``python -m ds_async.export`` turns
it into a HF folder, and:

- ``config.json`` (also the run's, from ``model_config``), ``generation_config.json`` and the tokenizer agree on the
  end-of-text id (the tokenizer's), the tokenizer pads (with EOS, on the left) and knows the model's length, in the
  checkpoint as in the export;
- ``generate`` with room for 50 tokens stops right after the first EOS on a model edited to always predict EOS;
  batched ``generate`` of prompts of different lengths pads on the left and continues each prompt as alone;
- the exported model's logits equal the pipeline's (a second job: the pipeline read from the checkpoint);
- a checkpoint written before these fixes (HF's default ids, no pad, no generation config) exports right too;
- an export target holding, inside, or equal to the checkpoint, a file, a link, or a non-empty folder that is not
  a previous export is refused with one line, even with ``--overwrite``, and left as it was; a previous export is
  replaced;
- every file the export reads is checked against the manifest: a corrupt tokenizer is refused naming the file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ds_async import checkpoint
from ds_async import config as cfgmod
from ds_async.checkpoint import CheckpointError
from ds_async.data import EOS_TOKEN, LEE_CORPUS, load_text_stream, load_tokenizer
from ds_async.export import ExportError, export, main
from ds_async.models import FAMILIES, model_config
from ds_async.tokenizer import load_from_checkpoint, train_bpe
from distributed import run_ckpt_jobs, run_job

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
STEPS = 3


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A tokenizer trained on the Lee corpus and a 2-stage 2BW run of the trainer that saves its final step."""
    work = tmp_path_factory.mktemp("export")
    train_bpe((row["text"] for row in load_text_stream(LEE_CORPUS, "train")), TINY["vocab_size"],
              str(work / "tokenizer.json"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
              "ds_async": {"model": {"family": "llama", "config": TINY}, "tokenizer": str(work / "tokenizer.json"),
                           "pipeline_stages": 2, "partition": {"method": "uniform"}, "schedule": "2bw",
                           "data": {"train": "gensim:lee", "validation": None, "seq_len": 32, "shuffle_buffer": 50},
                           "train": {"steps": STEPS}, "eval": {"every": 0},
                           "logging": {"dir": str(work / "runs"), "run_name": "R", "progress": False,
                                       "plot": False},
                           "checkpoint": {"every": 0, "keep": 1, "final": True}}}
    (work / "R.json").write_text(json.dumps(config))
    run_ckpt_jobs(work, [{"name": "R", "config": str(work / "R.json")}])
    for rank in range(2):
        assert json.loads((work / "out" / f"R.rank{rank}.json").read_text())["error"] is None
    run_dir = work / "runs" / "R"
    return {"work": work, "run_dir": run_dir, "root": run_dir / "checkpoints",
            "folder": checkpoint.step_dir(run_dir / "checkpoints", STEPS)}


@pytest.fixture(scope="module")
def exported(run) -> Path:
    out = run["work"] / "hf"
    main([str(run["root"]), str(out)])  # the folder of checkpoints: its newest
    return out


@pytest.fixture(scope="module")
def hf(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(exported)


def always_eos(model, eos: int):
    """``model`` edited to predict ``eos`` at every position: one hidden channel of every token's embedding is made
    huge, so after the final RMSNorm the hidden state points along it whatever the layers add, and the head (no
    bias) is zero but for ``eos``'s row, which reads that channel."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1e3
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos, 0] = 10.0
    return model


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and its manifest entry, as a checkpoint written that way would have it."""
    (folder / name).write_bytes(data)
    manifest = checkpoint.read_manifest(folder)
    manifest["files"][name] = {"size": len(data), "sha256": checkpoint.sha256(folder / name)}
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _export_cli(argv: list[str], capsys) -> str:
    """``python -m ds_async.export ARGV`` that must fail: exit 1 and one error line; returns the line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds_async.export: error: ") and "\n" not in err, err
    return err


def _listing(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------- special tokens
def test_config_generation_config_and_tokenizer_agree_on_end_of_text(run, exported, hf):
    from transformers import GenerationConfig

    model, tok = hf
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    assert eos == 0 and tok.eos_token == EOS_TOKEN
    assert model.config.eos_token_id == tok.eos_token_id == eos
    assert model.config.bos_token_id is None and tok.bos_token_id is None  # the BPE has no BOS
    # The three name one pad (the EOS): config.json too, so that HF code reading the model's pad agrees
    assert model.config.pad_token_id == eos
    assert tok.pad_token_id == eos and tok.padding_side == "left"
    assert tok.model_max_length == TINY["max_position_embeddings"]
    gen = GenerationConfig.from_pretrained(exported)
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (eos, eos, None)
    # No stored length: with one, every generate(max_new_tokens=...) warns that both are set
    assert "max_length" not in json.loads((exported / "generation_config.json").read_text())
    assert model.generation_config.eos_token_id == eos
    # The checkpoint itself is written right (not only fixed up by the export).
    saved = json.loads((run["folder"] / "config.json").read_text())
    assert (saved["eos_token_id"], saved["bos_token_id"]) == (eos, None)
    assert json.loads((run["folder"] / "generation_config.json").read_text())["pad_token_id"] == eos
    tok_config = json.loads((run["folder"] / "tokenizer_config.json").read_text())
    assert (tok_config["pad_token"], tok_config["padding_side"], tok_config["model_max_length"]) == \
        (EOS_TOKEN, "left", TINY["max_position_embeddings"])
    checkpoint.verify(run["folder"], checkpoint.read_manifest(run["folder"])["files"])  # all in the manifest


def test_model_config_takes_the_tokenizers_ids_and_leaves_pad_alone(run):
    """``model_config(cfg, tokenizer)``: the run's config carries BOS/EOS from the tokenizer; pad_token_id stays
    unset, since it is the embedding's ``padding_idx`` (EOS as pad would get no gradient)."""
    tok = load_tokenizer(str(run["work"] / "tokenizer.json"))
    cfg = cfgmod.parse({"model": {"config": TINY}, "train": {"steps": 1}})
    hf = model_config(cfg, tok)
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (0, None, None)
    assert (model_config(cfg).eos_token_id, model_config(cfg).bos_token_id) == (2, 1)  # HF's defaults without it
    assert tok.pad_token is None, "the run's own tokenizer is not changed"


def test_generate_with_max_new_tokens_is_quiet(hf, recwarn, caplog):
    """``generate(max_new_tokens=...)`` on the export, single and batched: no warning from transformers (no stored
    length to clash with, a pad for finished rows, an attention mask from the tokenizer)."""
    import logging

    model, tok = hf
    caplog.set_level(logging.WARNING)
    with torch.no_grad():
        model.generate(**tok("Police said", return_tensors="pt"), max_new_tokens=4, do_sample=False)
        model.generate(**tok(["Police said", "The government announced"], return_tensors="pt", padding=True),
                       max_new_tokens=4, do_sample=False)
    assert [str(w.message) for w in recwarn] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_training_from_an_export_keeps_end_of_text_trainable(exported):
    """``model.path`` = an export: its pad is its EOS, which ds_async's training does not take as the embedding's
    padding row (packed rows pad nothing, and that row would get no gradient)."""
    assert json.loads((exported / "config.json").read_text())["pad_token_id"] == 0
    cfg = cfgmod.parse({"model": {"path": str(exported)}, "train": {"steps": 1}})
    hf = model_config(cfg, load_tokenizer(str(exported)))
    assert (hf.eos_token_id, hf.pad_token_id) == (0, None)


def test_generate_stops_right_after_end_of_text(hf):
    model, tok = hf
    eos = tok.eos_token_id
    edited = always_eos(model, eos)
    prompt = tok("The minister said on Tuesday", return_tensors="pt")
    with torch.no_grad():
        assert (edited(**prompt).logits.argmax(-1) == eos).all()
        out = edited.generate(**prompt, max_new_tokens=50, do_sample=False)
        assert out[0, prompt.input_ids.shape[1]:].tolist() == [eos]
        # Control: with HF's default EOS id (what config.json said before) the same model runs on to the limit.
        out = edited.generate(**prompt, max_new_tokens=50, do_sample=False, eos_token_id=2)
        assert out.shape[1] == prompt.input_ids.shape[1] + 50


def test_batched_generate_pads_on_the_left(hf):
    model, tok = hf
    prompts = ["Police said", "The government announced on Monday that the new"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    lengths = [len(tok(p).input_ids) for p in prompts]
    short = lengths[1] - lengths[0]
    assert short > 0
    assert batch.input_ids[0, :short].tolist() == [tok.pad_token_id] * short
    assert batch.attention_mask[0].tolist() == [0] * short + [1] * lengths[0]
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
        for row, prompt in enumerate(prompts):  # each row continues its prompt as if alone
            alone = tok(prompt, return_tensors="pt")
            want = model.generate(**alone, max_new_tokens=6, do_sample=False)[0, alone.input_ids.shape[1]:]
            got = out[row, batch.input_ids.shape[1]:]
            assert got[:len(want)].tolist() == want.tolist()
            assert (got[len(want):] == tok.pad_token_id).all()
        # The edited model stops both rows after one token.
        out = always_eos(model, tok.eos_token_id).generate(**batch, max_new_tokens=20, do_sample=False)
        assert out[:, batch.input_ids.shape[1]:].tolist() == [[tok.eos_token_id]] * 2


def test_exported_logits_equal_the_pipeline(run, hf, tmp_path):
    """The pipeline (2 stages, read from the checkpoint) and the export compute the same logits."""
    model, tok = hf
    rows = tok(["Police said the fire started in the kitchen of the house on Tuesday night.",
                "The Australian cricket team won the third test match in Sydney on Sunday."]).input_ids
    ids = torch.tensor([r[:min(map(len, rows))] for r in rows])
    got = run_job(2, "logits", tmp_path, hf_dir=str(run["folder"]), stages=2, input_ids=ids.tolist())["logits"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the job's ranks (OMP_NUM_THREADS=1): the same kernels, the same rounding
    try:
        with torch.no_grad():
            want = model(ids).logits
    finally:
        torch.set_num_threads(threads)
    # fp32 both, the same HF layer code and kernels: bit-equal (seen on CPU), so compared exactly
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert want.std() > 0.1, "a trained model's logits, not a constant"


def test_checkpoint_written_before_the_fix_exports_right(run, tmp_path):
    """A checkpoint whose config.json has HF's default ids, whose tokenizer has no pad and a ~1e30 length, and
    which has no generation_config.json (as ds_async wrote them before): the export fixes all of it."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    old = tmp_path / "step_00000003"
    shutil.copytree(run["folder"], old)
    config = json.loads((old / "config.json").read_text())
    _rewrite(old, "config.json", json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2}).encode())
    tok_config = json.loads((old / "tokenizer_config.json").read_text())
    for key in ("pad_token", "padding_side"):
        tok_config.pop(key)
    _rewrite(old, "tokenizer_config.json", json.dumps({**tok_config, "model_max_length": int(1e30)}).encode())
    (old / "generation_config.json").unlink()
    manifest = checkpoint.read_manifest(old)
    del manifest["files"]["generation_config.json"]
    (old / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert AutoTokenizer.from_pretrained(old).pad_token is None  # really the old state

    export(old, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id == tok.eos_token_id == 0
    assert (tok.pad_token_id, tok.padding_side, tok.model_max_length) == (0, "left", 64)
    gen = GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (gen.eos_token_id, gen.pad_token_id) == (0, 0)
    assert "max_length" not in json.loads((tmp_path / "hf" / "generation_config.json").read_text())


# ------------------------------------------------------------------------------------------ export targets
def test_target_holding_or_inside_the_checkpoint_is_refused(run, capsys):
    before = _listing(run["run_dir"])
    err = _export_cli([str(run["root"]), str(run["run_dir"]), "--overwrite"], capsys)  # issue 23's command
    assert f"{run['run_dir']}: holds the checkpoint {run['root']}" in err
    err = _export_cli([str(run["folder"]), str(run["root"]), "--overwrite"], capsys)
    assert f"{run['root']}: holds the checkpoint" in err
    err = _export_cli([str(run["folder"]), str(run["folder"]), "--overwrite"], capsys)
    assert f"{run['folder']}: is the checkpoint itself" in err
    err = _export_cli([str(run["root"]), str(run["folder"]), "--overwrite"], capsys)  # the newest one
    assert f"{run['folder']}: lies inside the checkpoint {run['root']}" in err
    err = _export_cli([str(run["root"]), str(run["root"] / "hf")], capsys)
    assert f"{run['root'] / 'hf'}: lies inside the checkpoint {run['root']}" in err
    err = _export_cli([str(run["folder"]), str(run["folder"] / "sub" / "hf")], capsys)
    assert "lies inside the checkpoint" in err
    link = run["work"] / "link-to-run"
    link.symlink_to(run["run_dir"])  # the rule follows links
    err = _export_cli([str(run["root"]), str(link), "--overwrite"], capsys)
    assert "holds the checkpoint" in err
    link.unlink()
    assert _listing(run["run_dir"]) == before, "nothing was removed or written"


def test_target_that_is_not_a_previous_export_is_left_alone(run, exported, tmp_path, capsys):
    src = str(run["root"])
    file = tmp_path / "model.bin"
    file.write_bytes(b"weights")
    assert "model.bin: is a file, not a folder" in _export_cli([src, str(file), "--overwrite"], capsys)
    err = _export_cli([src, str(file / "sub" / "hf")], capsys)  # a file where a parent folder would be
    assert f"{file}: is a file, not a folder (to write" in err

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "config.json").write_text("{}")
    assert "exists and is not empty (pass --overwrite" in _export_cli([src, str(mine)], capsys)
    assert "notes.txt is not a file an export writes" in _export_cli([src, str(mine), "--overwrite"], capsys)
    assert (mine / "notes.txt").read_text() == "my notes"

    other_run = tmp_path / "copy-of-a-checkpoint"
    shutil.copytree(run["folder"], other_run)
    err = _export_cli([src, str(other_run), "--overwrite"], capsys)
    assert "checkpoint.json is not a file an export writes" in err
    assert (other_run / checkpoint.MANIFEST).exists()

    nested = tmp_path / "export-with-a-folder"
    shutil.copytree(exported, nested)
    (nested / "extra").mkdir()
    assert "extra is not a file an export writes" in _export_cli([src, str(nested), "--overwrite"], capsys)

    link = tmp_path / "link"
    link.symlink_to(exported)
    assert "is a symbolic link" in _export_cli([src, str(link), "--overwrite"], capsys)
    assert not list(tmp_path.glob(".*")), "no temporary folders left behind"


def test_overwrite_replaces_a_previous_export(run, exported, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    stale = out / "model-stage01-of-03.safetensors"  # of another pipeline layout: must not survive
    stale.write_bytes(b"old")
    (out / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(run["root"], out)
    export(run["root"], out, overwrite=True)
    assert not stale.exists()
    assert _listing(out) == _listing(exported)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "nothing left beside it"
    empty = tmp_path / "empty"
    empty.mkdir()
    export(run["root"], empty)  # an empty folder needs no --overwrite
    assert _listing(empty) == _listing(exported)


# -------------------------------------------------------------------------- everything read is checked
def test_corrupt_tokenizer_is_refused_naming_the_file(run, tmp_path, capsys):
    folder = tmp_path / "step_00000003"
    shutil.copytree(run["folder"], folder)
    file = folder / "tokenizer.json"
    good = file.read_bytes()
    assert len(load_from_checkpoint(folder)) == TINY["vocab_size"]
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x20
    file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=f"{file}: contents do not match"):
        export(folder, tmp_path / "out")
    with pytest.raises(CheckpointError, match=f"{file}: contents do not match"):
        load_from_checkpoint(folder)  # what --resume of a train:<vocab> run reads
    err = _export_cli([str(folder), str(tmp_path / "out")], capsys)
    assert f"{file}: contents do not match" in err
    file.write_bytes(good[:-3])
    assert f"{file}: " in _export_cli([str(folder), str(tmp_path / "out")], capsys)
    # Listed with the right hash but not a tokenizer (a checkpoint written wrong): still one line naming it.
    _rewrite(folder, "tokenizer.json", b'{"version": "1.0", "model": ')
    assert f"{file}: not valid JSON" in _export_cli([str(folder), str(tmp_path / "out")], capsys)
    with pytest.raises(CheckpointError, match=f"{file}: cannot be loaded as a tokenizer"):
        load_from_checkpoint(folder)
    _rewrite(folder, "tokenizer.json", b'{"version": "1.0"}')
    assert "its tokenizer (tokenizer.json" in _export_cli([str(folder), str(tmp_path / "out")], capsys)
    file.unlink()
    assert f"{file}: missing" in _export_cli([str(folder), str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists()


def test_seeded_init_zeroes_the_padding_row_as_hf_does():
    """With a ``pad_token_id`` the embedding's padding row starts at zero (HF's ``_init_weights``), the rest
    normal."""
    hf = model_config(cfgmod.parse({"model": {"config": {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                                         "num_hidden_layers": 1, "num_attention_heads": 2,
                                                         "pad_token_id": 3}}, "train": {"steps": 1}}))
    weight = FAMILIES["llama"].layer_specs(hf, seed=0)[0].build().embed_tokens.weight
    assert not weight[3].any() and bool((weight.norm(dim=1) > 0).sum() == 63)


def test_a_model_path_checkpoint_that_does_not_fit_names_the_key(tmp_path):
    """A tensor missing from ``model.path``, or one whose shape its ``config.json`` does not describe: a ConfigError
    naming ``ds_async.model.path`` and the tensor, not a KeyError or a load_state_dict traceback."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 tie_word_embeddings=False)
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")

    def build(**change):
        folder = tmp_path / "_".join(change)
        shutil.copytree(tmp_path / "hf", folder)
        if "missing" in change:
            save_file({k: v for k, v in tensors.items() if k != change["missing"]}, folder / "model.safetensors",
                      metadata={"format": "pt"})
        else:
            raw = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**raw, **change}))
        cfg = cfgmod.parse({"model": {"path": str(folder)}, "train": {"steps": 1}})
        for spec in FAMILIES["llama"].layer_specs(model_config(cfg), hf_dir=str(folder)):
            spec.build()

    with pytest.raises(cfgmod.ConfigError, match=r"ds_async.model.path: .*missing: the checkpoint has no tensor\(s\) "
                                                 r"\['model.norm.weight'\]"):
        build(missing="model.norm.weight")
    with pytest.raises(cfgmod.ConfigError, match=r"ds_async.model.path: tensor shapes do not match .*"
                                                 r"mlp.gate_proj.weight \(32, 16\) \(config.json: \(48, 16\)\)"):
        build(intermediate_size=48)
