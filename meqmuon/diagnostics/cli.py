"""Command-line entry points of the analysis: ``meqmuon memory``, ``meqmuon diagnose ...``, ``meqmuon ablation``.

``register(subparsers)`` adds the commands to the package CLI (``meqmuon/cli.py``); every command
sets ``func`` (called as ``args.func(args)``, returning an exit status). Tables are printed as
markdown and saved next to the run (or under ``--out``); figures are PNG files in the same place.

| paper                          | command                                                   |
|--------------------------------|-----------------------------------------------------------|
| Table 5, Table 7 (memory)      | ``meqmuon memory [--models ...] [--state-dtype ...] [--measure]`` |
| Tables 1, 3, 4, 8-10           | ``meqmuon diagnose imbalance --run DIR [--layers 0,4,7] [--steps ...]`` |
| Figure 1                       | ``meqmuon diagnose ns-trajectory --run DIR --layer 4 [--step K]`` |
| Table 6                        | ``meqmuon diagnose selection --run DIR``                  |
| Table 7 (PPL and memory)       | ``meqmuon ablation [--model ...] [--steps ...] [--out ...]`` |
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meqmuon.registry_names import registry_names

__all__ = ["register", "main"]


#: ``--state-dtype`` / ``--ns-dtype`` names (and a run's recorded ``ns_dtype``) -> torch's name of the dtype.
_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "float64": "float64"}


def _dtype(name: str) -> Any:
    """The torch dtype of a dtype name (torch is imported by the commands, not by :func:`register`: the
    ``meqmuon`` command answers ``--help`` and argument errors without it)."""
    import torch

    return getattr(torch, _DTYPE_NAMES[name])


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _emit(text: str, path: Path | None) -> None:
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"\n(saved {path})")


def _out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else Path(args.run)


def _run_dir(args: argparse.Namespace) -> Path:
    """``--run``, which must be a directory (a ``ValueError`` for the command's one-line error otherwise)."""
    run = Path(args.run)
    if not run.is_dir():
        raise ValueError(f"run directory does not exist: {run}" if not run.exists() else f"--run {run} is not a "
                         "directory (give the run directory, e.g. runs/llama-tiny-meqmuon-lr0.002-s0)")
    return run


# ---- memory ----------------------------------------------------------------------------------


def cmd_memory(args: argparse.Namespace) -> int:
    """Table 5 / Table 7 memory from meta-device models; ``--measure`` adds a measured one-step check."""
    from ..optim.registry import MEMORY_NAMES, spec
    from .ablation import meta_param_groups, tiny_lm_factory
    from .memory import measure_state_bytes, measure_table, memory_mib, memory_table

    dtype = _dtype(args.state_dtype)
    nbytes = dtype.itemsize
    optimizers = [spec(n).name for n in args.optimizers] if args.optimizers else list(MEMORY_NAMES)  # unknown: error
    groups = meta_param_groups(args.models or None)
    values = memory_mib(groups, optimizers, nbytes)
    parts = [
        f"## Optimizer-state memory (MiB, {args.state_dtype} state; paper Table 5 and Table 7's memory)\n",
        memory_table(values),
        "\n`--`: undefined (SCALE cannot update a tied embedding/LM head). Predicted from parameter shapes "
        "(meta device); scalar step counters excluded.",
    ]
    if args.measure:
        make_model, loss_fn = tiny_lm_factory(args.measure_model)
        rows = measure_state_bytes(make_model, loss_fn, optimizers, dtype)
        parts += [f"\n## Measured after one step on `{args.measure_model}` (bytes and MiB)\n", measure_table(rows)]
    _emit("\n".join(parts), Path(args.out) / "memory.md" if args.out else None)
    if args.out:
        (Path(args.out) / "memory.json").write_text(json.dumps(values, indent=1) + "\n")
    return 0


# ---- diagnose --------------------------------------------------------------------------------


def _ns_dtype_name(args: argparse.Namespace) -> str:
    """``--ns-dtype auto``: the Newton-Schulz dtype the run itself used (``optimizer_args.ns_dtype`` of
    its ``config.json``, concrete in every run since 2026-11-23), so the analysis sees what the optimizer computed;
    for a run that does not record one, what ``ns_dtype=None`` gives on this CPU (bf16 where native,
    else float32: bf16 is ~170x slower on an AVX2-only CPU). Explicit names are used as given."""
    if args.ns_dtype != "auto":
        return args.ns_dtype
    cfg = Path(args.run) / "config.json"
    if cfg.is_file():
        recorded = (json.loads(cfg.read_text()).get("optimizer_args") or {}).get("ns_dtype")
        if recorded in _DTYPE_NAMES:
            return recorded
    from meqmuon.precision import resolve_ns_dtype

    return str(resolve_ns_dtype(None, "cpu")).removeprefix("torch.")


def cmd_imbalance(args: argparse.Namespace) -> int:
    """Tables 1, 8-10 (hidden U = Orth(pre-NS)), Table 3 (embedding/head momentum), Table 4 (before/after)."""
    from .capture import layer_index, load_captures
    from .imbalance import hidden_cv_table, imbalance_records, momentum_cv_table, normalization_table

    caps = load_captures(_run_dir(args), args.steps)
    have = sorted({i for c in caps.values() for n, k in c["kinds"].items()
                   if k == "hidden" and (i := layer_index(n)) is not None})
    missing = sorted(set(args.layers or []) - set(have))
    if missing:
        raise ValueError(f"no captured matrix matches --layers {','.join(map(str, missing))} in {args.run}; "
                         f"captured layers: {','.join(map(str, have)) or 'none'}")
    args.ns_dtype = _ns_dtype_name(args)
    records = imbalance_records(caps, args.layers, ns_steps=args.ns_steps, ns_dtype=_dtype(args.ns_dtype))
    if not records:
        raise ValueError(f"no hidden, embedding or head matrix captured in {args.run}")
    steps = sorted(caps)
    parts = [
        f"## Row and column CVs of the orthogonalised updates U = Orth(pre-NS), {args.ns_steps} NS steps "
        f"({args.ns_dtype}) (paper Tables 1, 8-10; larger of each pair in bold)\n",
        hidden_cv_table(records) if any(r["kind"] == "hidden" for r in records) else "(no hidden matrix captured)",
    ]
    if any(r["kind"] != "hidden" for r in records):
        parts += [
            "\n## Row and column CVs of the unorthogonalised embedding/head momentum (paper Table 3)\n",
            momentum_cv_table(records),
        ]
    for s in steps:
        parts += [
            f"\n## Before and after MeqMuon's normalisation, step {s} (paper Table 4; hidden: eq. 8 on U, "
            "embedding/head: eq. 9 on the momentum)\n",
            normalization_table(records, s),
        ]
    out = _out_dir(args)
    _emit("\n".join(parts), out / "imbalance.md")
    slim = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()} for r in records]
    (out / "imbalance.json").write_text(json.dumps(slim, indent=1) + "\n")
    return 0


def cmd_ns_trajectory(args: argparse.Namespace) -> int:
    """Figure 1: CVs of X_k for k = 0..max_k for every hidden matrix of one layer, with SVD references."""
    from .capture import captured_steps, layer_index, load_captures
    from .imbalance import module_sort_key
    from .trajectory import plot_trajectories, trajectories, trajectory_table

    steps = captured_steps(_run_dir(args))
    step = args.step if args.step is not None else (steps[0] if steps else 0)
    cap = load_captures(args.run, [step])[step]
    hidden = {n: t for n, t in cap["tensors"].items() if cap["kinds"][n] == "hidden"}
    layers = sorted({layer_index(n) for n in hidden if layer_index(n) is not None})
    layer = args.layer if args.layer is not None else (layers[0] if layers else None)
    chosen = {n: hidden[n] for n in sorted(hidden, key=module_sort_key) if layer_index(n) == layer}
    if not chosen:
        raise ValueError(f"no hidden matrix of layer {layer} captured at step {step} in {args.run}; captured "
                         f"layers: {','.join(map(str, layers)) or 'none'}")
    args.ns_dtype = _ns_dtype_name(args)
    results = trajectories(chosen, args.max_k, dtype=_dtype(args.ns_dtype))
    ks = sorted({k for k in (0, 5, args.max_k) if k <= args.max_k})
    out = _out_dir(args)
    stem = f"ns_trajectory_layer{layer}_step{step}"
    png = plot_trajectories(
        results, out / f"{stem}.png", f"layer {layer}, step {step}: NS iterations ({args.ns_dtype})"
    )
    text = "\n".join(
        [
            f"## Row/column CVs along Newton-Schulz, layer {layer}, step {step} ({args.ns_dtype}; paper Figure 1)\n",
            trajectory_table(results, ks),
            f"\nSVD: exact orthogonalisation (float64 polar factor). Figure: {png}",
        ]
    )
    _emit(text, out / f"{stem}.md")
    payload = {n: {"shape": list(r["shape"]), "traj": r["traj"], "exact": list(r["exact"])} for n, r in results.items()}
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def _shapes_for_run(run: Path) -> dict[str, tuple[int, ...]]:
    """Hidden-matrix shapes of a run: from its captures, else from its config's model on the meta device."""
    from .capture import captured_steps, load_captures

    steps = captured_steps(run)
    if steps:
        cap = load_captures(run, steps[:1])[steps[0]]
        return {n: tuple(t.shape) for n, t in cap["tensors"].items()}
    cfg_path = run / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("model"):
            from .ablation import meta_param_groups

            groups = meta_param_groups([cfg["model"]])[cfg["model"]]
            return {n: tuple(p.shape) for g in groups for n, p in zip(g["names"], g["params"], strict=True)}
    return {}


def cmd_selection(args: argparse.Namespace) -> int:
    """Table 6: share of steps choosing row vs column normalisation per module type."""
    from .selection import read_selection_counts, selection_shares, selection_table

    run = _run_dir(args)
    path = run / "selection_counts.json"
    if not path.exists():
        raise ValueError(f"{path} not found: only MeqMuon-type runs (meqmuon, meqmuon-only-hidden) write "
                         "selection counts")
    shares = selection_shares(read_selection_counts(path), _shapes_for_run(run))
    text = "\n".join(
        [
            "## Row-wise vs column-wise normalisation selections, aggregated over layers and steps (paper Table 6)\n",
            selection_table(shares),
        ]
    )
    out = _out_dir(args)
    _emit(text, out / "selection.md")
    (out / "selection.json").write_text(json.dumps(shares, indent=1) + "\n")
    return 0


# ---- ablation --------------------------------------------------------------------------------


def cmd_ablation(args: argparse.Namespace) -> int:
    """Table 7: Muon, the three single-component variants and MeqMuon on one setting."""
    from .ablation import run_ablation

    text = run_ablation(
        model=args.model,
        steps=args.steps,
        lr=args.lr,
        out_dir=Path(args.out),
        optimizers=args.optimizers,
        seq_len=args.seq_len,
        batch=args.batch,
        seed=args.seed,
        extra=args.set or [],
    )
    _emit(text, Path(args.out) / "ablation.md")
    return 0


# ---- registration ----------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``memory``, ``diagnose {imbalance,ns-trajectory,selection}`` and ``ablation`` to ``subparsers``."""
    names = registry_names()
    p = subparsers.add_parser("memory", help="optimizer-state memory per optimizer and model (Tables 5, 7)")
    p.add_argument("--models", type=_names, default=None, help="comma list (default: the six paper models)")
    p.add_argument("--optimizers", type=_names, default=None, help=f"comma list (default: {','.join(names.memory)})")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the optimizer state (float32; bfloat16 halves all but NorMuon's row moments)")
    p.add_argument("--measure", action="store_true", help="also take one real step per optimizer on a small model")
    p.add_argument("--measure-model", default="llama-tiny", help="model for --measure (default llama-tiny)")
    p.add_argument("--out", default=None, help="directory for memory.md / memory.json (default: print only)")
    p.set_defaults(func=cmd_memory)

    d = subparsers.add_parser("diagnose", help="the paper's section 3.1 analysis of a captured run")
    dsub = d.add_subparsers(dest="diagnosis", required=True)

    q = dsub.add_parser("imbalance", help="row/column CVs before and after normalisation (Tables 1, 3, 4, 8-10)")
    q.add_argument("--run", required=True, help="run directory with captures/step_*.pt")
    q.add_argument("--layers", type=_ints, default=None, help="comma list (default: every captured layer)")
    q.add_argument("--steps", type=_ints, default=None, help="comma list (default: every captured step)")
    q.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations of U = Orth(pre-NS) (5)")
    q.add_argument("--ns-dtype", choices=["auto", "bfloat16", "float32", "float64"], default="auto",
                   help="auto: the run's own NS dtype (config.json), else bf16 where native, float32 elsewhere")
    q.add_argument("--out", default=None, help="output directory (default: the run directory)")
    q.set_defaults(func=cmd_imbalance)

    t = dsub.add_parser("ns-trajectory", help="CVs along Newton-Schulz iterations k=0..20 (Figure 1)")
    t.add_argument("--run", required=True, help="run directory with captures/step_*.pt")
    t.add_argument("--layer", type=int, default=None, help="default: the lowest captured layer")
    t.add_argument("--step", type=int, default=None, help="default: the first captured step")
    t.add_argument("--max-k", type=int, default=20, help="last Newton-Schulz iteration to follow (20)")
    t.add_argument("--ns-dtype", choices=["auto", "bfloat16", "float32", "float64"], default="auto",
                   help="auto: the run's own NS dtype (config.json), else bf16 where native, float32 elsewhere")
    t.add_argument("--out", default=None, help="output directory (default: the run directory)")
    t.set_defaults(func=cmd_ns_trajectory)

    s = dsub.add_parser("selection", help="row vs column normalisation shares per module type (Table 6)")
    s.add_argument("--run", required=True, help="run directory with selection_counts.json")
    s.add_argument("--out", default=None, help="output directory (default: the run directory)")
    s.set_defaults(func=cmd_selection)

    a = subparsers.add_parser("ablation", help="Muon vs single-component variants vs MeqMuon (Table 7)",
                              description="Trains Muon, the three variants that give one parameter kind "
                                          "MeqMuon's rule, and MeqMuon on the same model, data and seed "
                                          "(built-in corpus), then prints final validation perplexity and "
                                          "measured optimizer-state memory side by side (paper Table 7).")
    a.add_argument("--model", default="llama-tiny", help="registry model (default llama-tiny)")
    a.add_argument("--steps", type=int, default=150, help="optimizer updates per variant (150)")
    a.add_argument("--lr", type=float, default=None, help="one lr for every variant (default: each one's demo lr)")
    a.add_argument("--optimizers", type=_names, default=list(names.ablation),
                   help=f"comma list (default {','.join(names.ablation)})")
    a.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    a.add_argument("--batch", type=int, default=8, help="global batch in sequences (8)")
    a.add_argument("--seed", type=int, default=0, help="initial weights and data order (0)")
    a.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any other TrainConfig field, e.g. --set vocab_size=512 (repeatable)")
    a.add_argument("--out", default="runs/ablation", help="directory of the runs and ablation.md (runs/ablation)")
    a.set_defaults(func=cmd_ablation)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m meqmuon.diagnostics.cli ...``)."""
    parser = argparse.ArgumentParser(prog="meqmuon", description=__doc__.splitlines()[0])
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
