"""The study's results page and command line, and its analysis as one namespace.

The page (``launch/study/RESULTS.md``) holds tables generated between ``<!-- table: NAME -->`` ... ``<!-- end -->``
markers and prose written by people around them: :func:`report` computes every block from the committed results
(tables and the lines saying what ran, no sentence that reads them), :func:`render` puts them in and leaves the rest
of the page as it is. What the runs show (the findings, the MoE's choice, the time-to-loss verdict) is that
hand-written prose; every number it states is a generated table's, and ``report`` (``--check`` too) refuses a
page whose prose states a ``m ± h`` figure or a percentage that no table holds (:func:`unquoted`; settings such
as the warm-up's 10% are ``NOT_RESULTS``).

The analysis lives in :mod:`~ds_async.study.rows` (one row per run, from run folders or the committed results),
:mod:`~ds_async.study.tables` (the short study's tables and the definitions of gap and recovered share),
:mod:`~ds_async.study.long` (the study at a real length) and :mod:`~ds_async.study.comparisons` (time to loss, the
engine against the emulation, provenance); the notebook, its plots (``plots.py``) and the tests read them here.

    python -m ds_async.study.runs report [--check]      # (re)write or check the tables of launch/study/RESULTS.md
    python -m ds_async.study.runs table RUNS...         # the main table of the run folders below RUNS
    python -m ds_async.study.runs collect RUNS...       # add run folders to the committed results (replacing same ids)

pandas is needed here (``pip install ds_async[notebooks]``); nothing in ``ds_async`` outside :mod:`ds_async.study`
imports this.
"""
from __future__ import annotations

import argparse
import base64
import difflib
import io
import os
import re
import sys
from pathlib import Path

import pandas as pd

from .. import report as your_runs  # `report` here is the results page's
from ..report import time_to_loss
# The study's analysis as one namespace for the notebook, its plots and the tests (``runs.X``), beside what the
# page and the command line use.
from .comparisons import (engine_summary, engine_table, find_time_to_loss, load_time_to_loss, provenance,
                          time_to_loss_block, time_to_loss_curves, time_to_loss_table, time_to_targets_table,
                          within_noise)
from .long import (LAMBDAS, LONG_GROUPS, LR_GROUPS, VARIANT_CELLS, batch_block, batch_gaps, batch_points, batch_table,
                   clock_markdown, clock_table, delay_block, delay_table, extrapolation_table, full_lambda_block,
                   full_lambda_table, headline_runs, lambda_block, lambda_grid, lambda_rule, lambda_rule_table,
                   length_sweep, length_table, long_lr_table, long_table, main_points, moe_block, moe_choice_table,
                   moe_table, own_best_lr, own_best_table, own_lr_block, own_lr_table, seed_markdown, seed_table,
                   steps_rule, steps_rule_table, sync_tuned_lr)
from .rows import (ENGINE_GROUP, PAGE, PAPER, RESULTS, ROOT, collect, find_runs, llama_parameters, load_results,
                   load_runs, model_key, model_parameters, read_run, write_results)
from .tables import (at_reference, curves, depth_table, formatted, gap_curves, gap_table, gap_with_interval,
                     lambda_table, main_table, markdown, paired_interval, ran_line, recovered_share, reference,
                     reference_parameters, share_cell, share_interval, share_text, sweep)

# ---------------------------------------------------------------------------------------------------------------
# The results page: tables generated between markers, the prose around them hand-written

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end -->)", re.S)
SHORT_GROUPS = ("main", "tokens", "lr", "batch", "depth", "ef_lambda", "nesterov", ENGINE_GROUP)
# The figures the page's prose may state without a table holding them: settings, not results (warm-up over 10% of
# the steps, cosine to 10%, 95% intervals), and the superseded README's figure the depth-8 section quotes as such.
NOT_RESULTS = frozenset({"10%", "95%", "7.415 ± 0.238"})
PROSE_FIGURE = re.compile(r"[+\-−]?\d+(?:\.\d+)? ± \d+(?:\.\d+)?|\d+(?:\.\d+)?%")


def report(runs: pd.DataFrame, ttl: dict | None = None) -> dict[str, str]:
    """The results page's generated blocks, by name, from the rows of the committed results and, with ``ttl``, the
    committed time-to-loss comparison: tables and the lines saying what ran, never a reading of them."""
    study = runs[runs["group"].isin(SHORT_GROUPS)]
    blocks = short_blocks(study)
    blocks.update(engine_blocks(runs, study))
    long = runs[runs["group"].isin(LONG_GROUPS)]
    if not long.empty:
        blocks.update(long_blocks(long))
    blocks["paper"] = paper_block()
    if ttl is not None:
        blocks["time-to-loss"] = time_to_loss_block(ttl)
    prov = provenance(runs).sort_values(["group", "runner"])
    prov["commit"] = [str(c)[:7] for c in prov["commit"]]
    blocks["provenance"] = markdown(prov.fillna("—"), index=False)
    return blocks


def short_blocks(study: pd.DataFrame) -> dict[str, str]:
    """The short study's blocks: the main table, its sweeps, depth, EF's λ and Nesterov."""
    ref = reference(study)
    main = at_reference(study, ref)
    core = main[main["label"].isin(["sync", "2bw", "2bw+ef"]) & (main["group"] == "main")]
    blocks = {"main": markdown(main_table(core, labels=("sync", "2bw", "2bw+ef"), ref=ref)) + "\n" + ran_line(core)}

    def sweep_block(axis: str, group: str, x: str | None = None, scale: float = 1.0, unit: str = "") -> str:
        t = sweep(study, axis, ref, x=x).drop(columns=["gap half"])
        col = x or axis
        t[col] = [f"{v / scale:.3g}{unit}" for v in t[col]]
        t = formatted(t.drop(columns=[c for c in (axis,) if x and c != col]), {"sync": 3, "2bw": 3, "gap": "+3"})
        return markdown(t, index=False) + "\n" + ran_line(study[study["group"] == group])

    blocks["tokens"] = sweep_block("tokens", "tokens", scale=1e6, unit="M")
    blocks["lr"] = sweep_block("lr_scale", "lr", x="lr")
    blocks["batch"] = sweep_block("batch", "batch")
    depth = formatted(depth_table(study, ref), {"pipedream": 3, "gap pipedream": "+3", "gap 2bw": "+3"})
    blocks["depth"] = markdown(depth, index=False) + "\n" + ran_line(study[study["group"] == "depth"])
    lam = lambda_table(study, ref)
    lam["recovered"] = [share_text(v, h, n) for v, h, n in zip(lam["recovered"], lam["recovered half"], lam["seeds"])]
    lam = formatted(lam.drop(columns=["recovered half"]), {"lambda": "g", "loss": 3})
    blocks["ef_lambda"] = markdown(lam, index=False) + "\n" + ran_line(study[study["group"] == "ef_lambda"])
    seed0 = main[(main["group"] == "main") & (main["seed"] == 0)]
    nest = main_table(pd.concat([seed0, main[main["group"] == "nesterov"]]), ref=ref)
    nest = nest[[c for c in nest.columns if c.startswith(("2bw", "recovered"))]]
    blocks["nesterov"] = markdown(nest) + "\n" + ran_line(study[study["group"] == "nesterov"])
    return blocks


def engine_blocks(runs: pd.DataFrame, study: pd.DataFrame) -> dict[str, str]:
    """The engine against the emulation: the 2-stage pairs (σ from the short study's main matrix) and depth 8."""
    cols = ["pairs", "engine", "emulation", "diff engine − emulation", "max |diff|", "seed noise σ", "verdict",
            "train max rel"]
    blocks = {}
    for name, group in (("engine", ENGINE_GROUP), ("depth8-cpu", "depth8-cpu")):
        part = runs[runs["group"] == group]
        table = engine_table(pd.concat([part, study[study["group"] == "main"]]) if group == ENGINE_GROUP else part)
        blocks[name] = markdown(engine_summary(table)[cols]) + "\n" + ran_line(part)
    return blocks


def long_blocks(long: pd.DataFrame) -> dict[str, str]:
    """The study at a real length: its main table with the training clocks, the lengths, each seed, the LR sweep,
    the extrapolation, each variant at its own LR (seed 0 and every seed), λ (the grid and the full length), the delay,
    the MoE and steps against tokens."""
    main_long = main_points(long)
    blocks = {"long": markdown(long_table(long), index=False) + "\n" + ran_line(main_long) + clock_markdown(main_long)}
    lengths = long[long["group"].isin(["long", "long-lengths"])]
    blocks["long-lengths"] = (markdown(length_table(lengths), index=False) + "\n"
                              + ran_line(long[long["group"] == "long-lengths"]))
    blocks["long-seeds"] = seed_markdown(seed_table(lengths))
    blocks["long-lr"] = markdown(long_lr_table(long[long["group"].isin(LR_GROUPS)]), index=False) + "\n" + ran_line(
        long[long["group"].isin(["long-lr", "long-async-lr", "long-tuned"])])
    extrapolation = formatted(extrapolation_table(long), {
        "from tokens/param": 2, "to tokens/param": 2, "gap from": "+3", "gap to": "+3", "exponent": 2,
        "paper's gap": "+3", "reaches it at tokens/param": ".0f"})
    blocks["long-extrapolation"] = markdown(extrapolation, index=False)
    blocks["long-own-seed0"] = own_lr_block(long)
    own = long[long["group"] == "long-own-lr"]
    blocks["long-own"] = markdown(own_best_table(long), index=False) + "\n" + (
        ran_line(own) if len(own) else "Ran: no run of its own yet (`long-own-lr`): every point is another table's.\n")
    blocks["long-lambda"], blocks["long-delay"] = lambda_block(long), delay_block(long)
    blocks["long-moe"] = moe_block(long)
    blocks["long-batch"] = batch_block(long)
    blocks["long-adamw-lambda"] = full_lambda_block(long)
    return blocks


def paper_block() -> str:
    """The paper's final losses (arXiv 2606.30634's Table 1), its gaps and EF's share."""
    paper = pd.DataFrame({"sync": PAPER["sync"], "2bw": PAPER["2bw"], "2bw+ef": PAPER["2bw+ef"],
                          "gap 2bw − sync": PAPER["2bw"] - PAPER["sync"],
                          "recovered by ef": [recovered_share(*PAPER.loc[o, ["sync", "2bw", "2bw+ef"]])
                                              for o in PAPER.index]}).rename_axis("optimizer")
    return markdown(formatted(paper, {"gap 2bw − sync": "+3", "recovered by ef": "%"}))


def unquoted(page: str) -> list[str]:
    """The figures (``m ± h`` and percentages) the page's hand-written prose states that no generated table holds,
    leaving out ``NOT_RESULTS``: every number the prose quotes must recompute from the committed files."""
    tables = "\n".join(m["body"] for m in BLOCK.finditer(page))
    held = set(PROSE_FIGURE.findall(tables))
    prose = BLOCK.sub("", page)
    return [x for x in PROSE_FIGURE.findall(prose) if x not in held and x not in NOT_RESULTS]


def render(page: str, blocks: dict[str, str]) -> str:
    """``page`` with each ``<!-- table: NAME -->`` ... ``<!-- end -->`` block's body replaced by ``blocks[NAME]``."""
    missing = set(blocks) - {m["name"] for m in BLOCK.finditer(page)}
    if missing:
        raise ValueError(f"the page has no block for {sorted(missing)}")
    return BLOCK.sub(lambda m: m[1] + blocks[m["name"]] + m[4], page)


def compact_outputs(nb, colors: int = 32) -> None:
    """Keep the executed notebook small enough to commit: re-encode its PNG outputs with an adaptive palette of
    ``colors`` (line plots need few; about a quarter of the bytes), and drop the ``text/plain`` beside a Markdown or
    PNG output, which for those is only the object's repr (``<IPython.core.display.Markdown object>``)."""
    from PIL import Image

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/markdown" in data or "image/png" in data:
                data.pop("text/plain", None)
            if "image/png" in data:
                image = Image.open(io.BytesIO(base64.b64decode(data["image/png"]))).convert("RGB")
                buf = io.BytesIO()
                image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(buf, "PNG", optimize=True)
                data["image/png"] = base64.b64encode(buf.getvalue()).decode()


def execute_notebook(path: str | Path, runs: str | None = None, timeout: int = 600) -> None:
    """Run the notebook at ``path`` top to bottom (on the run folders ``runs``, ``os.pathsep``-separated, else the
    committed results) and save it in place with its outputs (:func:`compact_outputs`), without per-cell timestamps."""
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    old = os.environ.pop("DS_ASYNC_RUNS", None)
    if runs:
        os.environ["DS_ASYNC_RUNS"] = runs
    try:
        # No per-cell timestamps: the notebook is committed executed, and they would change every line of its diff.
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.pop("DS_ASYNC_RUNS", None)
        if old is not None:
            os.environ["DS_ASYNC_RUNS"] = old
    compact_outputs(nb)
    nbformat.write(nb, path)


def write_page(path: Path, results: Path, check: bool = False) -> int:
    """``report``'s command: regenerate the page's tables at ``path`` from ``results`` and write it, or with
    ``check`` only compare; 1 (with the reason on stderr) where the prose states a figure no table holds or, with
    ``check``, where a table differs."""
    page = path.read_text()
    new = render(page, report(load_results(results), load_time_to_loss(results)))
    loose = unquoted(new)
    if loose:
        print(f"{path}: its prose states figures no table holds: {', '.join(loose)}", file=sys.stderr)
        return 1
    if check:
        if new != page:
            sys.stdout.writelines(difflib.unified_diff(page.splitlines(True), new.splitlines(True), str(path),
                                                       "regenerated"))
            print(f"{path}: its tables differ from what {results} gives", file=sys.stderr)
            return 1
        print(f"{path}: every table matches {results}, and every figure its prose states is a table's")
        return 0
    path.write_text(new)
    print(f"wrote the tables of {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_async.study.runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="write the generated tables of the results page from the committed results")
    rep.add_argument("--check", action="store_true", help="only check that the page shows what the files give")
    rep.add_argument("--page", type=Path, default=PAGE)
    rep.add_argument("--results", type=Path, default=RESULTS)
    tab = sub.add_parser("table", help="print the main table and the engine pairs of run folders")
    tab.add_argument("roots", nargs="+")
    col = sub.add_parser("collect", help="add run folders to the committed results")
    col.add_argument("roots", nargs="+")
    col.add_argument("--results", type=Path, default=RESULTS)
    nb = sub.add_parser("notebook", help="execute the notebook in place (on run folders, else the results)")
    nb.add_argument("roots", nargs="*")
    nb.add_argument("--path", type=Path, default=ROOT / "notebooks" / "loss_curves.ipynb")
    args = parser.parse_args(argv)

    if args.cmd == "report":
        return write_page(args.page, args.results, args.check)
    elif args.cmd == "table":
        runs = load_runs(args.roots)
        print(f"{len(runs)} runs")
        main = main_table(runs) if len(runs) else pd.DataFrame()
        if len(runs) and main.empty:  # no study matrix in them (e.g. a user's own runs): every run side by side
            mine = [your_runs.read_run(path) for path in runs["path"]]
            print(your_runs.table(mine))
            for sync, run in your_runs.pairs(mine):
                print("\n".join(your_runs.comparison_lines(your_runs.compare(sync, run))))
        elif len(runs):
            with pd.option_context("display.width", 200, "display.max_columns", 20):
                print(main.to_string())
                engine = engine_table(runs)
                if len(engine):
                    print("\nThe engine vs the emulation (final validation loss, same config):")
                    print(engine_summary(engine).to_string())
    elif args.cmd == "collect":
        both = collect(args.roots, args.results)
        print(f"{args.results}: {len(both)} runs")
    else:
        execute_notebook(args.path, os.pathsep.join(args.roots) or None)
        print(f"executed {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
