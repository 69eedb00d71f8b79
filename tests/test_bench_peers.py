"""``launch/bench/bench_peers.py`` (torch's pipeline schedules as torchtitan runs them, on ds_async's model) trains
what one process trains: run as a user runs it (torchrun, 2 gloo ranks), every schedule's losses equal bit for bit
those of the whole model stepped in one process here, micro-batch by micro-batch, its gradient clipped by the
norm summed over the two ranks' parameters as the row says the schedule placed them."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from ds_async.models import llama
from ds_async.optim.clip import squared_norm
from ds_async.optim.master import MasterWeights

from distributed import ROOT, free_port, job_env

MODEL = ["--hidden", "64", "--ffn", "128", "--heads", "4", "--layers", "6", "--vocab", "256", "--seq-len", "32",
         "--micro-batch-size", "2", "--micro-batches", "4"]
STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN, CLIP, LR = 3, 4, 2, 32, 0.05, 1e-3


def bench_rows(tmp_path, *flags: str) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "launch" / "bench" / "bench_peers.py"), *MODEL, "--warmup", "1", "--steps", str(STEPS - 1),
           "--clip", str(CLIP), "--lr", str(LR), "--out", str(out), *flags]
    done = subprocess.run(cmd, env=job_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def reference_losses(row: dict) -> list[float]:
    """Each step's mean micro-batch loss, the whole model in this process: the row's model, seed 0 and random
    tokens, AdamW (foreach), gradients of the m micro-batches summed then divided by m, clipped by the model's norm
    (the two ranks' squared norms, each over that rank's parameters in the order its stages hold them)."""
    hf = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    llama.check_supported(hf)
    layers = llama.build_all(llama.layer_specs(hf, seed=0))
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(list(model.parameters()), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    if row["precision"] == "bf16":
        opt = MasterWeights(opt, model)
    bounds = [int(b) for b in row["partition"].split(",")]
    by_rank = [[p for s in row["stages_by_rank"][f"r{r}"] for layer in layers[bounds[s]:bounds[s + 1]]
                for p in layer.parameters()] for r in range(2)]
    assert sorted(id(p) for ps in by_rank for p in ps) == sorted(id(p) for p in model.parameters())
    loss_fn = llama.loss_fn(hf)
    batches = torch.randint(0, 256, (STEPS, MICRO_BATCHES * MICRO_BATCH_SIZE, SEQ_LEN + 1),
                            generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=row["precision"] == "autocast")
    out, norms = [], []
    for k in range(STEPS):
        losses = []
        with autocast:
            for x, y in zip(batches[k, :, :-1].tensor_split(MICRO_BATCHES),
                            batches[k, :, 1:].tensor_split(MICRO_BATCHES)):
                loss = loss_fn(model(x), y)
                loss.backward()
                losses.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(MICRO_BATCHES)
        out.append(torch.stack(losses).float().mean().item())
        norm = (squared_norm([p.grad for p in by_rank[0]]) + squared_norm([p.grad for p in by_rank[1]])).sqrt()
        norms.append(norm.item())
        scale = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
        if row["precision"] == "bf16":
            opt.step_with(scale)
        else:
            torch._foreach_mul_([p.grad for p in model.parameters()], scale)
            opt.step()
        opt.zero_grad(set_to_none=True)
    assert min(norms) > 2 * CLIP  # the clip acts in every step
    return out


@pytest.mark.parametrize("precision,schedules", [
    ("bf16", "1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV"),
    ("autocast", "GPipe,InterleavedZeroBubble"),
])
def test_every_schedule_trains_what_one_process_trains(tmp_path, precision, schedules):
    rows = bench_rows(tmp_path, "--precision", precision, "--schedules", schedules)
    assert [r["schedule"] for r in rows] == schedules.split(",")
    for row in rows:
        multi = row["schedule"] not in ("1F1B", "GPipe")
        assert row["virtual_stages"] == (4 if multi else 2)
        placed = {"ZBVZeroBubble": {"r0": [0, 3], "r1": [1, 2]}, "DualPipeV": {"r0": [0, 3], "r1": [1, 2]}}
        assert row["stages_by_rank"] == placed.get(row["schedule"], {"r0": [0, 2], "r1": [1, 3]} if multi
                                                    else {"r0": [0], "r1": [1]})
        assert len(row["losses"]) == STEPS
        assert row["losses"] == reference_losses(row), row["schedule"]
        assert row["step_time_s"] > 0 and set(row["measured_idle_by_rank"]) == {"r0", "r1"}
