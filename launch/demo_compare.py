"""Side by side: two run folders of ``launch/train.py`` (the demo's sync 1F1B and 2BW + Muon + EF runs).

    python launch/demo_compare.py runs/demo-1f1b runs/demo-2bw [--out runs/demo-compare.png]

Prints, per run: schedule, optimizer and correction, final training loss (mean of the last 10 steps), final
validation loss, tokens/s, and the pipeline bubble each schedule leaves on DeepSpeed's step grid for the run's
shape (stages, micro-batches, drains before each evaluation), from ``ds_async.pipe.simulate``, next to each stage's
measured idle fraction (``summary.json``'s ``stages``). Draws both runs' loss curves into one PNG.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"dir": run_dir, "manifest": manifest, "summary": summary}


def grid_bubble(schedule: str, stages: int, micro_batches: int, steps: int, drain_every: int) -> float:
    """Idle share of the stages' step slots over the run: synchronous 1F1B drains every batch; a flush-free
    schedule runs each segment between drains as one pipeline (warm-up and drain once per segment)."""
    from ds_async.pipe import version_rule
    from ds_async.pipe.simulate import simulate

    rule = version_rule.get(schedule)
    if not rule.flush_free:
        return (stages - 1) / (micro_batches + stages - 1)
    idle = busy = 0
    left = steps
    while left > 0:
        batches = min(left, drain_every or left)
        result = simulate(rule, stages, micro_batches, batches)
        idle, busy = idle + sum(result.idle_steps), busy + sum(result.busy_steps)
        left -= batches
    return idle / (idle + busy)


def describe(run: dict) -> dict:
    m, s = run["manifest"], run["summary"]
    ds, cfg = m["deepspeed"], m["ds_async"]
    train = [loss for _, loss in s["history"]["train"]]
    tail = train[-10:] or [float("nan")]
    corr = cfg["correction"]
    correction = "" if corr["type"] == "none" else f" + {corr['type'].upper()}"
    drain = cfg["eval"]["every"] if cfg["data"]["validation"] else 0
    return {"run": run["dir"].name, "schedule": cfg["schedule"],
            "optimizer": ds.get("optimizer", {}).get("type", "?") + correction,
            "final train loss": sum(tail) / len(tail), "final validation loss": s.get("final_validation_loss"),
            "tokens/s": s.get("tokens_per_s"),
            "bubble (step grid)": grid_bubble(cfg["schedule"], m["pipeline_stages"], m["micro_batches"],
                                              s["steps"], drain),
            "idle (measured)": {name.replace("stage", "s"): v.get("idle_fraction")
                                for name, v in (s.get("stages") or {}).items()} or None}


def fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if value > 100 else f"{value:.4f}"
    if isinstance(value, dict):
        return " ".join(f"{k}={v:.0%}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    return str(value)


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, color in zip(runs, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        label = describe(run)
        label = f"{label['schedule']}, {label['optimizer']}"
        hist = run["summary"]["history"]
        steps, losses = zip(*hist["train"])
        window = 10
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, color=color, label=f"{label}: train (10-step mean)")
        if hist["validation"]:
            vs, vl = zip(*hist["validation"])
            ax.plot(vs, vl, color=color, marker="o", linestyle="--", label=f"{label}: validation")
    ax.set_xlabel("step (same tokens per step in both runs)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with manifest.json and summary.json)")
    parser.add_argument("--out", type=Path, default=None, help="the comparison plot (default: beside the runs)")
    args = parser.parse_args(argv)
    runs = [load(r) for r in args.runs]
    rows = [describe(r) for r in runs]
    width = max(len(k) for k in rows[0])
    print("\n".join(f"{k:<{width}}  " + "  ".join(f"{fmt(r[k]):>28}" for r in rows) for k in rows[0]))
    out = args.out or args.runs[0].parent / "demo-compare.png"
    plot(runs, out)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
