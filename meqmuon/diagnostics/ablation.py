"""The bridge from the analysis to ``meqmuon.train``: paper models on the meta device and the Table 7 ablation.

This is the only diagnostics module that imports ``meqmuon.train`` (transformers); the analysis
modules stay torch-only. It provides

- :func:`meta_param_groups`: role groups of registry models built on the meta device (shapes only,
  no weights), for the memory accounting of Table 5;
- :func:`tiny_lm_factory`: a fresh small model plus a random-token loss, for measured state memory;
- :func:`run_ablation`: Table 7, i.e. Muon, the three single-component variants (each replaces one
  kind's rule by MeqMuon's: hidden -> eq. 8, embedding/head -> eq. 9, vectors -> eq. 10) and MeqMuon,
  trained on one setting through :func:`meqmuon.train.compare.run_compare`, with the final validation
  perplexity and the measured optimizer-state memory side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..optim.registry import ABLATION_NAMES
from .memory import label
from .tables import bold, markdown_table

__all__ = ["meta_param_groups", "tiny_lm_factory", "run_ablation", "ablation_table"]


def meta_param_groups(models: Iterable[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``{model: meqmuon.param_groups(model on the meta device)}``; default: the six paper models."""
    from meqmuon import param_groups
    from meqmuon.train.models import PAPER_MODELS, build_model

    names = list(models) if models else list(PAPER_MODELS)
    return {m: param_groups(build_model(m, device="meta")) for m in names}


def tiny_lm_factory(
    model: str = "llama-tiny", batch: int = 2, seq_len: int = 32, seed: int = 0
) -> tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]:
    """``(make_model, loss_fn)``: a seeded registry model and its causal-LM loss on fixed random tokens."""
    from meqmuon.train.models import build_model, get_spec

    vocab = get_spec(model).vocab_size
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))

    def make_model() -> nn.Module:
        return build_model(model, seed=seed)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        x = tokens.to(next(m.parameters()).device)
        return m(input_ids=x, labels=x).loss

    return make_model, loss_fn


def _normalise_row(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    out.setdefault("val_ppl", row.get("perplexity"))
    out.setdefault("optimizer_state_mib", row.get("optimizer state (MiB)"))
    return out


def ablation_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Table 7 layout: variant, final validation PPL and measured optimizer-state memory (MiB); best PPL bold."""
    # Accepts loop summaries (val_ppl, optimizer_state_mib) and run_compare rows (perplexity, ...).
    summaries = [_normalise_row(s) for s in summaries]
    ppls = [s.get("val_ppl") for s in summaries if s.get("val_ppl") is not None]
    best = min(ppls) if ppls else None
    body = []
    for s in summaries:
        ppl = s.get("val_ppl")
        text = "--" if ppl is None else f"{ppl:.2f}"
        if ppl is not None and ppl == best:
            text = bold(text)
        mib = s.get("optimizer_state_mib")
        body.append(
            [
                label(s.get("optimizer", "?")),
                str(s.get("lr", "")),
                text,
                "--" if mib is None else f"{mib:.3f}",
            ]
        )
    return markdown_table(["Variant", "lr", "Val PPL (↓)", "State memory (MiB, ↓)"], body, "lrrr")


def run_ablation(
    *,
    model: str = "llama-tiny",
    steps: int = 150,
    lr: float | None = None,
    out_dir: Path = Path("runs/ablation"),
    optimizers: Sequence[str] = ABLATION_NAMES,
    seq_len: int = 128,
    batch: int = 8,
    seed: int = 0,
    extra: Sequence[str] = (),
) -> str:
    """Train every variant on one setting with ``run_compare`` and return the Table 7 markdown.

    Args:
        model: registry model (default ``llama-tiny`` on the built-in corpus: minutes on 2 CPU cores).
        steps: optimizer updates per run.
        lr: one learning rate for all variants (they share Muon's lr grid); ``None``: each one's ``demo_lr``.
        out_dir: parent directory of the runs; the table is also saved there as ``ablation.md``.
        optimizers: variants, in table order.
        seq_len, batch, seed: sequence length, global batch (sequences) and seed of every run.
        extra: further ``KEY=VALUE`` TrainConfig fields (values parsed as Python literals).
    """
    from meqmuon.train.compare import demo_config, run_compare
    from meqmuon.train.config import TrainConfig, parse_optimizer_args

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = parse_optimizer_args(list(extra))
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}; valid: {', '.join(sorted(fields))}")
    # The harness's CPU demo setting (built-in corpus, evaluation every 25 steps), resized as asked.
    base = demo_config(
        **{"model": model, "steps": steps, "seq_len": seq_len, "global_batch": batch, "seed": seed, **overrides}
    )
    lrs = {o: lr for o in optimizers} if lr is not None else {}  # else: each one's demo_lr (run_compare)
    summaries = run_compare(list(optimizers), lrs, base, Path(out_dir))
    order = {o: i for i, o in enumerate(optimizers)}
    summaries = sorted(summaries, key=lambda s: order.get(s.get("optimizer"), len(order)))
    return "\n".join(
        [
            f"## Component ablation on `{model}`, {steps} steps, seq {seq_len} x batch {batch} (paper Table 7)\n",
            ablation_table(summaries),
            "\nMemory is measured (`optimizer_state_bytes`) at the end of each run; "
            "`meqmuon memory --models llama-60m,llama-130m` gives the paper-scale figures.",
        ]
    )
