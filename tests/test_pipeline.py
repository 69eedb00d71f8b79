"""The pipeline is the model: logits equal Hugging Face's, and pipelined training equals 1-stage training."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from distributed import run_job
from jobs import TINY_LLAMA


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY_LLAMA, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("stages,partition", [(2, {"method": "parameters"}),
                                              (3, {"method": "explicit", "boundaries": [0, 2, 4, 6]})])
def test_pipeline_logits_equal_hf(hf_model, tmp_path, stages, partition):
    model, path = hf_model
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    got = run_job(stages, "logits", tmp_path, hf_dir=str(path), stages=stages, input_ids=ids.tolist(),
                  partition=partition)["logits"]
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_stage_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("p1")
    return run_job(1, "train", out, stages=1, steps=6, mbs=2, gas=4, export=True), out


def _params(out, stages):
    merged = {}
    for s in range(stages):
        merged.update(torch.load(out / f"params_stage{s}.pt", weights_only=True))
    return merged


@pytest.mark.parametrize("nproc,stages,gas", [(2, 2, 4), (4, 2, 2)], ids=["p2", "p2xdp2"])
def test_pipelined_training_matches_one_stage(one_stage_run, tmp_path, nproc, stages, gas):
    ref, ref_dir = one_stage_run
    got = run_job(nproc, "train", tmp_path, stages=stages, steps=6, mbs=2, gas=gas)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference run must actually learn"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    want, have = _params(ref_dir, 1), _params(tmp_path, stages)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_hf_export_round_trip(one_stage_run):
    """Export -> from_pretrained -> the same logits the trained pipeline computes."""
    result, out = one_stage_run
    model = AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="sdpa").eval()
    params = _params(out, 1)
    assert model.state_dict().keys() == params.keys()
    with torch.no_grad():
        logits = model(result["input_ids"]).logits
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)
