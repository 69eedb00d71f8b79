"""What a run leaves behind: tensorboard scalars, a progress bar, a manifest and a loss plot.

Only the reporting rank (last stage, first data-parallel replica: it holds the loss) writes anything.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path


def code_version() -> dict:
    """The code that ran: git commit and dirty flag of the ds_async checkout, and library versions.

    ``DS_ASYNC_COMMIT`` in the environment names the commit instead, for a copy of the tree whose ``.git`` is not
    that commit's (the GPU machine gets the working tree with a ``.git`` that may be older).
    """
    import deepspeed
    import torch
    import transformers

    import ds_async

    root = Path(ds_async.__file__).resolve().parents[1]

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            return None

    named = os.environ.get("DS_ASYNC_COMMIT")
    return {"ds_async": ds_async.__version__, "commit": named or git("rev-parse", "HEAD"),
            "dirty": None if named else bool(git("status", "--porcelain", "--untracked-files=no")),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


class HostValue:
    """A device scalar on its way to the host without stopping the host.

    ``float(t)`` on a GPU tensor waits for everything queued on the stream before it. Here the copy into pinned
    memory is queued behind the work that makes the value, and ``float(HostValue)`` waits for that copy alone:
    read a step later, it has long landed, and the host never loses its lead over the GPU (which a flush-free
    pipeline turns straight into idle time). On CPU it is the value itself.
    """

    def __init__(self, t):
        t = t.detach()
        self._event = None
        if t.device.type == "cuda":
            import torch

            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            t = host
        self._value = t

    def __float__(self) -> float:
        if self._event is not None:
            self._event.synchronize()
        return float(self._value)


class RunLogger:
    """Scalars to tensorboard, a tqdm bar with tokens/s, a manifest, a summary line and ``loss.png``."""

    def __init__(self, run_dir: Path, total_steps: int, tokens_per_step: int, enabled: bool, progress: bool = True,
                 every: int = 1, start_step: int = 0):
        """``start_step``: steps done before this process started (a resumed run); rates count only the rest."""
        self.run_dir, self.enabled, self.every, self.start_step = Path(run_dir), enabled, every, start_step
        self.tokens_per_step = tokens_per_step
        self.history = {"train": [], "validation": []}
        self.writer = self.bar = None
        self._t0 = self._t_last = time.perf_counter()
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.run_dir))
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def manifest(self, **sections) -> None:
        """Write ``manifest.json`` (code version, resolved config, ...) once at start."""
        if not self.enabled:
            return
        doc = {"code": code_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **sections}
        (self.run_dir / "manifest.json").write_text(json.dumps(doc, indent=2, default=str))
        self.writer.add_text("manifest", "```\n" + json.dumps(doc, indent=2, default=str) + "\n```")

    def train_step(self, step: int, loss: float, lr: float) -> None:
        now = time.perf_counter()
        tok_s = self.tokens_per_step / max(now - self._t_last, 1e-9)
        self._t_last = now
        if not self.enabled:
            return
        self.history["train"].append((step, loss))
        if step % self.every == 0:
            tokens = step * self.tokens_per_step
            for tag, value in (("train/loss", loss), ("train/lr", lr), ("train/tokens_per_s", tok_s),
                               ("train/tokens", tokens)):
                self.writer.add_scalar(tag, value, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")

    def validation(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self.history["validation"].append((step, loss))
        self.writer.add_scalar("validation/loss", loss, step)
        if self.bar is not None:
            self.bar.write(f"step {step}: validation loss {loss:.4f}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def close(self, steps: int, plot: bool = True, extra: dict | None = None) -> dict:
        """Print the summary line, write ``summary.json`` and ``loss.png``; returns the summary (``extra`` added)."""
        elapsed = time.perf_counter() - self._t0
        run = steps - self.start_step
        summary = {"steps": steps, "tokens": steps * self.tokens_per_step, "seconds": round(elapsed, 2),
                   "tokens_per_s": round(run * self.tokens_per_step / max(elapsed, 1e-9), 1),
                   "final_train_loss": self.history["train"][-1][1] if self.history["train"] else None,
                   "final_validation_loss": self.history["validation"][-1][1] if self.history["validation"] else None,
                   **(extra or {})}
        if not self.enabled:
            return summary
        if self.bar is not None:
            self.bar.close()
        self.writer.flush()
        self.writer.close()
        (self.run_dir / "summary.json").write_text(json.dumps({**summary, "history": self.history}, indent=2))
        if plot:
            self._plot()
        print("ds_async summary: " + " ".join(f"{k}={v}" for k, v in summary.items()) + f" run_dir={self.run_dir}",
              flush=True)
        return summary

    def _plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, points in self.history.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=name, marker="o" if name == "validation" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "loss.png", dpi=100)
        plt.close(fig)

