"""How often eq. 8's choice differs from the shape rule, per matrix and over training (issue 58, item 3).

MeqMuon normalises the rows of ``U = Orth(X)`` when their CV is at least the columns' and the columns otherwise
(eq. 8); ``meqmuon-shape`` fixes the side by shape: rows for tall and square matrices (``m >= n``, ``m`` the
output dimension of the weight ``(m, n)``), columns for wide ones. MeqMuon counts its row choices per matrix in
its optimizer state (``rows_chosen``, ``opt.selection_counts()``), and every checkpoint of a run keeps that state,
so the difference between two checkpoints is the choices of the steps between them. This reads a run directory's
checkpoints and prints, per interval and overall:

* per **shape class** (square, tall, wide) and module type (q, k, v, o, gate, up, down): the share of steps on
  which eq. 8 chose the side the shape rule does not ("differs"), and
* per **layer** for the square matrices, where the two rules can differ;
* with ``--gap``, at the last checkpoint of the first run, per matrix: the CVs of eq. 8 (``gamma_r``, ``gamma_c``)
  of ``U = Orth(B)`` (``B`` the momentum buffer, float32 Newton-Schulz) and how far apart the two candidate
  directions are, ``||N_r(U) - N_c(U)||_F / ||N_r(U)||_F``: what a different choice changes in the update.

Usage::

    python docs/results/field-2026/selection.py RUN_DIR [RUN_DIR ...] [--json OUT] [--gap]   # runs of one setting
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def checkpoint_counts(path: Path) -> tuple[int, dict[str, tuple[int, int, tuple[int, int]]]]:
    """``(step, {name: (row steps, steps, (m, n))})`` of one checkpoint's MeqMuon state."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    opt, model = ck["optimizer"], ck["model"]
    out = {}
    for group in opt["param_groups"]:
        for i, name in zip(group["params"], group.get("names") or [], strict=True):
            st = opt["state"].get(i, {})
            if "rows_chosen" in st:
                shape = tuple(model[name].shape) if name in model else tuple(st["momentum_buffer"].shape)
                out[name] = (int(st["rows_chosen"]), int(st["step"]), shape)
    return int(ck["step"]), out


def shape_side_is_rows(shape: tuple[int, int]) -> bool:
    """The shape rule's side: rows for ``m >= n`` (tall and square), columns for wide."""
    return shape[0] >= shape[1]


def shape_class(shape: tuple[int, int]) -> str:
    return "square" if shape[0] == shape[1] else "tall" if shape[0] > shape[1] else "wide"


def module_of(name: str) -> str:
    return next((m for m in MODULES if m in name), name.rsplit(".", 2)[-2])


def layer_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m[1]) if m else None


def differing(runs: list[Path]) -> dict:
    """Per interval (between consecutive checkpoints, summed over ``runs``): per (class, module) and per (square
    module, layer) the steps and the steps on which eq. 8 differs from the shape rule."""
    intervals: dict[tuple[int, int], dict] = {}
    for run in runs:
        points = sorted((checkpoint_counts(p) for p in (run / "checkpoints").glob("step_*.pt")), key=lambda t: t[0])
        prev_step, prev = 0, {}
        for step, counts in points:
            cell = intervals.setdefault((prev_step, step), {"by_module": defaultdict(lambda: [0, 0]),
                                                           "by_layer": defaultdict(lambda: [0, 0]), "shapes": {}})
            for name, (rows, steps, shape) in counts.items():
                r0, s0, _ = prev.get(name, (0, 0, shape))
                d_rows, d_steps = rows - r0, steps - s0
                differs = d_steps - d_rows if shape_side_is_rows(shape) else d_rows
                key = (shape_class(shape), module_of(name))
                cell["by_module"][key][0] += differs
                cell["by_module"][key][1] += d_steps
                cell["shapes"][key] = shape
                if shape_class(shape) == "square":
                    lk = (module_of(name), layer_of(name))
                    cell["by_layer"][lk][0] += differs
                    cell["by_layer"][lk][1] += d_steps
            prev_step, prev = step, counts
    return intervals


def gap(run: Path) -> str:
    """Per matrix at ``run``'s last checkpoint: eq. 8's CVs of ``Orth(B)`` and the relative distance between the
    row- and the column-normalised ``Orth(B)``."""
    import meqmuon.functional as F

    last = sorted((run / "checkpoints").glob("step_*.pt"))[-1]
    ck = torch.load(last, map_location="cpu", weights_only=False)
    opt = ck["optimizer"]
    lines = [f"At {last.name} of {run.name} (U = Orth(momentum), float32):", "",
             "| matrix | shape | gamma_r | gamma_c | eq. 8 picks | shape rule | ||N_r(U) - N_c(U)|| / ||N_r(U)|| |",
             "|---|---|---:|---:|---|---|---:|"]
    for group in opt["param_groups"]:
        for i, name in zip(group["params"], group.get("names") or [], strict=True):
            st = opt["state"].get(i, {})
            if "rows_chosen" not in st:
                continue
            U = F.orthogonalize(st["momentum_buffer"].float(), 5, F.NS_COEFFICIENTS, torch.float32)
            g_r, g_c = (float(v) for v in F.row_col_cv(U))
            r, c = F.row_normalize(U), F.col_normalize(U)
            dist = float((r - c).norm() / r.norm())
            shape = tuple(U.shape)
            lines.append(f"| {name.removeprefix('model.')} | {shape[0]} x {shape[1]} | {g_r:.4f} | {g_c:.4f} | "
                         f"{'rows' if g_r >= g_c else 'cols'} | {'rows' if shape_side_is_rows(shape) else 'cols'} | "
                         f"{dist:.4f} |")
    return "\n".join(lines)


def _pct(d: list[int]) -> str:
    return f"{100 * d[0] / d[1]:.1f}" if d[1] else "-"


def report(intervals: dict) -> tuple[str, dict]:
    """Markdown tables and a JSON-able summary."""
    spans = sorted(intervals)
    keys = sorted({k for c in intervals.values() for k in c["by_module"]},
                  key=lambda k: (("square", "tall", "wide").index(k[0]), MODULES.index(k[1]) if k[1] in MODULES else 9))
    total = {k: [sum(intervals[s]["by_module"][k][i] for s in spans) for i in (0, 1)] for k in keys}
    shapes = {k: next(intervals[s]["shapes"][k] for s in spans if k in intervals[s]["shapes"]) for k in keys}
    lines = ["| class | module | shape | " + " | ".join(f"steps {a + 1}-{b}" for a, b in spans) + " | all |",
             "|---|---|---|" + "---:|" * (len(spans) + 1)]
    for k in keys:
        lines.append(f"| {k[0]} | {k[1]} | {shapes[k][0]} x {shapes[k][1]} | "
                     + " | ".join(_pct(intervals[s]["by_module"][k]) for s in spans) + f" | {_pct(total[k])} |")
    lkeys = sorted({k for c in intervals.values() for k in c["by_layer"]},
                   key=lambda k: (MODULES.index(k[0]) if k[0] in MODULES else 9, k[1] or 0))
    ltotal = {k: [sum(intervals[s]["by_layer"][k][i] for s in spans) for i in (0, 1)] for k in lkeys}
    layers = sorted({k[1] for k in lkeys})
    mods = [m for m in MODULES if any(k[0] == m for k in lkeys)]
    lines += ["", "Square matrices by layer (all steps):", "",
              "| module | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
              "|---|" + "---:|" * len(layers)]
    for m in mods:
        lines.append(f"| {m} | " + " | ".join(_pct(ltotal.get((m, layer), [0, 0])) for layer in layers) + " |")
    summary = {"intervals": [list(s) for s in spans],
               "by_module": {f"{k[0]}/{k[1]}": {"shape": list(shapes[k]), "differs": total[k][0],
                                                "steps": total[k][1],
                                                "per_interval": [intervals[s]["by_module"][k] for s in spans]}
                             for k in keys},
               "square_by_layer": {f"{k[0]}/{k[1]}": ltotal[k] for k in lkeys}}
    return "\n".join(lines), summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="MeqMuon run directories (checkpoints kept)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--gap", action="store_true", help="also the CVs and the two directions' distance per matrix")
    args = ap.parse_args()
    table, summary = report(differing(args.runs))
    print("Share of steps (%) on which eq. 8's side differs from the shape rule's (rows for m >= n), "
          f"{len(args.runs)} run(s):\n")
    print(table)
    if args.gap:
        print("\n" + gap(args.runs[0]))
    if args.json:
        summary["runs"] = [str(r) for r in args.runs]
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
