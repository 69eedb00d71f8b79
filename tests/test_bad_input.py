"""Bad input that is not a config key typo: each case stops the job at start with one line naming the key or the
source (``ds_async: error: ...``, exit 1), or prints a warning line where training on is legitimate.

In-process where the check is not distributed (model configs, optimizer blocks, tokenizers, the launcher check);
hub names in subprocesses (the hub's offline switch is read at import); the one-process world without a launcher
as a real ``python launch/train.py`` run. The distributed cases (data without usable text, another optimizer type
on resume) run in ``tests/test_checkpoint.py``'s 2-rank setup job.
"""
from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ds_async import config
from ds_async.config import ConfigError
from ds_async.data import load_tokenizer
from ds_async.models import model_config
from ds_async.optim.client import OptimizerSetupError, check_optimizer_block, client_optimizer
from ds_async.resume import check_optimizer_type
from ds_async.tokenizer import train_for_run

from distributed import LAUNCHER_ENV, free_port, train_py_error

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def parse(model: dict, **section):
    return config.parse({"model": model, "train": {"steps": 1}, **section})


def train_cli(argv: list[str], capsys) -> str:
    """``launch/train.py ARGV`` in this process: must exit 1 with one error line, which is returned."""
    return train_py_error(argv, capsys)


@pytest.mark.parametrize("family, kwargs, message", [
    ("llama", {"hidden_size": 64, "num_attention_heads": 5},
     r"ds_async.model.config.hidden_size: 64 is not a multiple of num_attention_heads \(5\)"),
    ("llama", {"hidden_size": 60, "num_attention_heads": 4}, r"ds_async.model.config.head_dim: 15 .* is odd"),
    ("llama", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 9}, r"ds_async.model.config.head_dim: 9 "),
    ("llama", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
     r"ds_async.model.config.num_key_value_heads: 3 does not divide num_attention_heads \(4\)"),
    ("llama", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 0},
     r"ds_async.model.config.num_key_value_heads: must be a positive integer, got 0"),
    ("llama", {"tie_word_embeddings": True}, r"ds_async.model.config.tie_word_embeddings: true is not supported"),
    ("llama", {"vocab_size": "many"}, r"ds_async.model.config: .*vocab_size"),
    ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 3},
     r"ds_async.model.config.num_experts_per_tok: 3 must be in 1..num_local_experts \(2\)"),
    ("mixtral", {"sliding_window": 64}, r"ds_async.model.config.sliding_window: 64 is not supported"),
])
def test_hf_config_errors_name_the_key(family, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        model_config(parse({"family": family, "config": {**TINY, **kwargs}}))


def test_model_folder_config_errors_and_remote_code_name_model_path(tmp_path, capsys):
    """A folder's config.json is checked like an inline config; one with ``auto_map`` is refused before
    transformers reads it (no code of its own runs, nothing asks on stdin)."""
    from transformers import LlamaConfig

    tied = tmp_path / "tied"
    LlamaConfig(**TINY, tie_word_embeddings=True).save_pretrained(tied)
    with pytest.raises(ConfigError, match=rf"ds_async.model.path: {tied}: config.json's tie_word_embeddings: true"):
        model_config(parse({"path": str(tied)}))
    remote = tmp_path / "remote"
    LlamaConfig(**TINY).save_pretrained(remote)
    raw = json.loads((remote / "config.json").read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (remote / "config.json").write_text(json.dumps(raw))
    (remote / "configuration_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    with pytest.raises(ConfigError, match=rf"ds_async.model.path: {remote}: config.json has auto_map .* never runs "
                                          "remote code"):
        model_config(parse({"path": str(remote)}))
    tok = tmp_path / "remote-tokenizer"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}))
    with pytest.raises(ConfigError, match=rf"ds_async.tokenizer: {tok}: tokenizer_config.json has auto_map"):
        load_tokenizer(str(tok), key="ds_async.tokenizer")
    assert not (tmp_path / "ran").exists()
    with pytest.raises(ConfigError, match=rf"ds_async.model.path: {tmp_path / 'absent'}: cannot read its config"):
        model_config(parse({"path": str(tmp_path / "absent")}))


_HUB_PROBE = """
import json, sys
from ds_async import config
from ds_async.config import ConfigError
from ds_async.data import DataError, load_text_stream, load_tokenizer
from ds_async.models import model_config

name = "nonexistent-org/nonexistent-model"
errors = []
for attempt in (lambda: model_config(config.parse({"model": {"path": name}, "train": {"steps": 1}})),
                lambda: load_tokenizer(name, key="ds_async.tokenizer"),
                lambda: load_text_stream(name, "train", key="ds_async.data.train")):
    try:
        attempt()
        errors.append(None)
    except (ConfigError, DataError) as e:
        errors.append(str(e))
print(json.dumps(errors))
"""


class _NotFound(http.server.BaseHTTPRequestHandler):
    """A hub that knows no repository (answers 404 at once, so nothing is retried)."""

    def _answer(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


def test_hub_names_that_cannot_be_fetched_name_the_key(tmp_path):
    """model.path, tokenizer and data.train as hub names, offline (HF_HUB_OFFLINE=1) and with a hub that does
    not have them: one line each, naming the key and the name."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    runs = {"offline": {**base, "HF_HUB_OFFLINE": "1"},
            "not on the hub": {**base, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}}
    procs = {k: subprocess.Popen([sys.executable, "-c", _HUB_PROBE], env=env, cwd=tmp_path, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, env in runs.items()}
    try:
        for case, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            model, tokenizer, data = json.loads(out.strip().splitlines()[-1])
            name = "nonexistent-org/nonexistent-model"
            assert model.startswith(f"ds_async.model.path: {name}: cannot read its config ("), (case, model)
            assert tokenizer.startswith(f"ds_async.tokenizer: {name}: cannot load the tokenizer ("), (case, tokenizer)
            assert data.startswith(f"ds_async.data.train: {name}: cannot open the data ("), (case, data)
            assert all("\n" not in e for e in (model, tokenizer, data))
    finally:
        server.shutdown()


def test_a_run_that_fails_at_start_leaves_no_empty_folders(tmp_path):
    """A job stopped at start (here: a training file without usable text, found after the run and checkpoint
    folders were made) removes the checkpoint folder it made and the then empty run folder; one that had trained a
    tokenizer keeps it."""
    (tmp_path / "empty.txt").write_text("\n \n")
    runs = tmp_path / "runs"
    for name, tokenizer in (("plain", str(ROOT.parent / "shared" / "corpus" / "tokenizers" / "bpe8192.json")),
                            ("trained", "train:300")):
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
               "ds_async": {"model": {"config": {**TINY, "vocab_size": 8192}}, "tokenizer": tokenizer,
                            "pipeline_stages": 1,
                            "data": {"train": str(tmp_path / "empty.txt") if name == "plain" else "python:docs",
                                     "validation": str(tmp_path / "empty.txt"), "seq_len": 16},
                            "train": {"steps": 2}, "eval": {"every": 0, "batches": 1},
                            "logging": {"dir": str(runs), "run_name": name, "progress": False}}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
        env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
        proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path)], env=env,
                              cwd=tmp_path, text=True, capture_output=True, timeout=300)
        assert proc.returncode == 1 and "ds_async: error: ds_async.data." in proc.stderr, proc.stderr[-3000:]
    assert not (runs / "plain").exists()
    assert sorted(p.name for p in (runs / "trained").iterdir()) == ["tokenizer.json"]


def test_a_hub_dataset_with_the_hub_unreachable_fails_at_once(tmp_path):
    """A hub dataset (a name, or an hf:// URL) when the hub cannot be reached: one line naming the key, the hub and
    what to do, within seconds (datasets alone retries with growing pauses for half a minute before saying it)."""
    code = ("import json, sys\nfrom ds_async.data import DataError, load_text_stream\nout = []\n"
            "for source in sys.argv[1:]:\n    try:\n        load_text_stream(source, 'train', key='ds_async.data.train')\n"
            "    except DataError as e:\n        out.append(str(e))\nprint(json.dumps(out))\n")
    port = free_port()  # nothing listens there: connections are refused
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    sources = ["someorg/somedata", "hf://datasets/someorg/somedata/data/*.parquet"]
    proc = subprocess.run([sys.executable, "-c", code, *sources], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [e.split(": cannot reach")[0] for e in errors] == [f"ds_async.data.train: {s}" for s in sources]
    for e in errors:
        assert f"cannot reach the Hugging Face hub (127.0.0.1:{port}: Connection refused); without a network set " \
               "HF_HUB_OFFLINE=1" in e, e
    assert "Retrying" not in proc.stderr, proc.stderr[-2000:]  # datasets' retries with growing pauses never start


@pytest.mark.parametrize("block, message", [
    ({"type": "AdamX", "params": {"lr": 1e-3}},
     r"optimizer.type: 'AdamX' is not an optimizer DeepSpeed or ds_async knows \(did you mean 'Adam'\?\)"),
    ({"type": "sgd", "params": {"lr": 0.1}}, r"optimizer.type: 'sgd' .*\(did you mean 'SGD'\?\)"),
    ({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}},
     r"optimizer.params.betas: not a parameter of 'SGD' \(SGD\)"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decy": 0.1}},
     r"optimizer.params.weight_decy: not a parameter of 'AdamW' \(AdamW\) \(did you mean 'weight_decay'\?\)"),
    ({"type": "AdamW", "params": {"lr": -1.0, "torch_adam": True}},
     r"optimizer.params: 'AdamW' \(AdamW\) rejects them: ValueError: Invalid learning rate: -1.0"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}, r"optimizer.params.max_grad_norm: .*gradient_clipping"),
    ({"type": 3}, r"optimizer.type: required"),
])
def test_optimizer_blocks_deepspeed_cannot_build_name_the_key(tmp_path, capsys, monkeypatch, block, message):
    """Checked when the job starts, before the model is built (DeepSpeed raised AssertionError/TypeError deep in
    its engine)."""
    with pytest.raises(OptimizerSetupError, match=message):
        check_optimizer_block({"optimizer": block})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": block,
                                "ds_async": {"model": {"config": TINY}, "train": {"steps": 1}}}))
    monkeypatch.setenv("RANK", "0")  # as if launched: refused before the process group is joined
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_cli(["--config", str(path)], capsys).startswith("ds_async: error: optimizer.")


def test_ds_async_optimizer_params_are_named_as_they_are_built():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(OptimizerSetupError, match=r"optimizer.params.lrr: unknown key for type 'Lion' \(did you mean "
                                                  r"'lr'\?\)"):
        client_optimizer(model, {"optimizer": {"type": "Lion", "params": {"lrr": 1e-3}}}, None, None, 1)
    with pytest.raises(OptimizerSetupError, match=r"optimizer.params: 'Lion' rejects them: TypeError"):
        client_optimizer(model, {"optimizer": {"type": "Lion", "params": {"lr": 1e-3, "betas": 0.9}}}, None, None, 1)


def test_resume_with_another_optimizer_type_is_refused():
    """The type a checkpoint was saved with against the resumed run's (the 2-rank refusal is in
    tests/test_checkpoint.py); a checkpoint saved before the type was recorded is not checked."""
    saved = {"optimizer": {"type": "AdamW"}}
    check_optimizer_type(saved, {"optimizer": {"type": "adamw"}}, "ckpt")
    with pytest.raises(ConfigError, match=r"optimizer.type: 'SGD', but the checkpoint ckpt was saved with 'AdamW'"):
        check_optimizer_type(saved, {"optimizer": {"type": "SGD"}}, "ckpt")
    check_optimizer_type({"step": 4}, {"optimizer": {"type": "SGD"}}, "ckpt")


def test_train_tokenizer_is_retrained_when_its_recipe_changes(tmp_path, capsys):
    """``train:<vocab>`` reuses the run folder's tokenizer only if the folder's previous run (its manifest, which
    every run writes at start) trained it with the same vocabulary size and data; otherwise, or without a record,
    it trains a new one and says so."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(f"document number {i} says something about topic {i % 7} and more" for i in range(300)))
    run = tmp_path / "run"
    run.mkdir()

    def start(spec, **data):  # a run's start: the tokenizer, then the manifest
        cfg = parse({"config": TINY}, tokenizer=spec, data={"train": str(docs), "validation": None, **data})
        path = train_for_run(cfg, run)
        (run / "manifest.json").write_text(json.dumps({"ds_async": config.resolved(cfg)}))
        return path

    path = start("train:300")
    size = len(json.loads(path.read_text())["model"]["vocab"])
    assert "training a byte-level BPE tokenizer (300 tokens)" in capsys.readouterr().out
    stamp = path.stat().st_mtime_ns
    assert start("train:300") == path and path.stat().st_mtime_ns == stamp
    assert capsys.readouterr().out == ""
    start("train:280")
    out = capsys.readouterr().out
    assert f"{path} was trained with another ds_async.tokenizer (train:300): training a new one" in out, out
    assert len(json.loads(path.read_text())["model"]["vocab"]) < size
    start("train:280", min_chars=5)
    assert "was trained with another ds_async.data.min_chars" in capsys.readouterr().out
    (run / "manifest.json").unlink()
    start("train:280", min_chars=5)
    assert "has no record of how it was trained" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"ds_async.tokenizer: train:100: a byte-level BPE has at least 257"):
        start("train:100")


def test_no_launcher_runs_one_stage_as_one_process_and_refuses_more(tmp_path, capsys, monkeypatch):
    """``python launch/train.py``: with pipeline_stages 1 a world of one process, on CPU without building
    DeepSpeed's shared-memory op (a fresh TORCH_EXTENSIONS_DIR stays empty); with more stages one line naming the
    launcher command."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "ds_async": {"model": {"config": TINY}, "tokenizer": "train:300", "pipeline_stages": 1,
                        "data": {"train": "python:docs", "validation": None, "seq_len": 16},
                        "train": {"steps": 2}, "eval": {"every": 0}, "checkpoint": {"final": False},
                        "logging": {"dir": str(tmp_path / "runs"), "run_name": "one", "progress": False,
                                    "plot": False}}}
    path = tmp_path / "one.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path)], env=env,
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    for key in LAUNCHER_ENV:  # meanwhile, in this process: more stages than one need a launcher
        monkeypatch.delenv(key, raising=False)
    cfg["ds_async"]["pipeline_stages"] = 2
    two = tmp_path / "two.json"
    two.write_text(json.dumps(cfg))
    assert train_cli(["--config", str(two)], capsys) == (
        f"ds_async: error: no launcher: ds_async.pipeline_stages is 2, so the job needs 2 processes (or a multiple "
        f"of 2): deepspeed --num_gpus 2 launch/train.py --config {two} (or torchrun --nproc_per_node 2 "
        f"launch/train.py --config {two})")

    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "ds_async summary:" in out and re.search(r"^  steps +2 \(", out, re.M), out[-4000:]
    built = list((tmp_path / "extensions").rglob("*")) if (tmp_path / "extensions").exists() else []
    assert not built, built
