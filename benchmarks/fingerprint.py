"""Bit-level fingerprint of every optimizer in every form: the check that a refactor changed no result.

Usage::

    python benchmarks/fingerprint.py --out before.pt                       # on the old commit
    python benchmarks/fingerprint.py --out after.pt --compare before.pt    # on the new one
    python benchmarks/fingerprint.py --compile --out after.pt              # + the compile=True forms

Every registered optimizer (``meqmuon.OPTIMIZERS``, torch's AdamW excepted) takes three steps from the
same float32 parameters and gradients, in each form it accepts: per-tensor (``foreach=False``), batched
(``foreach=True``) and, with ``--compile``, each of them with ``compile=True``. The parameters cover every
kind and matrix view: same-shape and transposable hidden matrices, a conv kernel, 3-D experts with a
split, experts stored ``(E, in, out)``, a GPT-2-style ``Conv1D`` split in three, an embedding, a head and
1-D / 1-row vectors. Newton-Schulz runs in float32 (``ns_dtype``), so the result does not depend on
whether the CPU has native bf16.

``--compare`` reports, for each (optimizer, form, parameter) that both files hold, whether the final
values are bit-identical, and for those that are not the largest relative difference; ``N differ`` is
the summary line.
"""

from __future__ import annotations

import argparse
import inspect

import torch

import meqmuon

STEPS = 3
E, D, F, V = 3, 16, 40, 37

#: (kind, name, shape, view, split): one row per parameter of the fingerprint's model.
PARAMS: list[tuple[str, str, tuple[int, ...], str, tuple[int, ...] | None]] = [
    ("hidden", "q", (D, D), "matrix", None),
    ("hidden", "k", (D, D), "matrix", None),
    ("hidden", "up", (F, D), "matrix", None),
    ("hidden", "down", (D, F), "matrix", None),
    ("hidden", "conv", (D, D, 3), "matrix", None),
    ("hidden", "experts.gate_up", (E, F, D), "stacked", (F // 2, F // 2)),
    ("hidden", "experts.down", (E, F, D), "stacked-transposed", None),
    ("hidden", "c_attn", (D, 3 * D), "transposed", (D, D, D)),
    ("embedding", "embed", (V, D), "matrix", None),
    ("head", "lm_head", (V, D), "matrix", None),
    ("vector", "norm", (D,), "matrix", None),
    ("vector", "token", (1, D), "matrix", None),
]


def make_groups(seed: int = 0) -> tuple[list[dict], list[torch.Tensor]]:
    """The fingerprint's param groups (float32, fixed seed) and their parameters in ``PARAMS`` order."""
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, dict] = {}
    params = []
    for kind, name, shape, view, split in PARAMS:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) / shape[-1] ** 0.5)
        grp = groups.setdefault(kind, {"params": [], "names": [], "kind": kind, "views": [], "splits": []})
        grp["params"].append(p)
        grp["names"].append(name)
        grp["views"].append(view)
        grp["splits"].append(split)
        params.append(p)
    return list(groups.values()), params


def forms(name: str, with_compile: bool) -> list[tuple[str, dict]]:
    """The (form, keyword arguments) that optimizer ``name`` accepts."""
    accepted = inspect.signature(meqmuon.optim.registry.spec(name).cls.__init__).parameters
    out = [("per-tensor", {"foreach": False}), ("batched", {"foreach": True})]
    if with_compile and "compile" in accepted:
        out += [(f"{f}+compile", {**kw, "compile": True}) for f, kw in out]
    return out


def run(name: str, kwargs: dict) -> list[torch.Tensor]:
    """The parameters after ``STEPS`` steps of optimizer ``name`` with ``kwargs``."""
    groups, params = make_groups()
    accepted = inspect.signature(meqmuon.optim.registry.spec(name).cls.__init__).parameters
    if "ns_dtype" in accepted:
        kwargs = {**kwargs, "ns_dtype": torch.float32}
    opt = meqmuon.build_optimizer(name, groups, lr=2e-2, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def fingerprint(with_compile: bool) -> dict[str, torch.Tensor]:
    """``optimizer/form/parameter`` -> final value, for every optimizer and form."""
    out = {}
    for name in meqmuon.OPTIMIZERS:
        if name == "adamw":
            continue
        for form, kwargs in forms(name, with_compile):
            for (_, pname, *_), value in zip(PARAMS, run(name, kwargs), strict=True):
                out[f"{name}/{form}/{pname}"] = value
    return out


def compare(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> int:
    """Print every key whose values differ (with the largest relative difference); return the count."""
    common = sorted(set(new) & set(old))
    differ = 0
    for key in common:
        a, b = new[key], old[key]
        if a.shape != b.shape or not torch.equal(a, b):
            differ += 1
            rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if a.shape == b.shape else float("nan")
            print(f"differ {key}: max relative difference {rel:.3g}")
    only = sorted(set(new) ^ set(old))
    print(f"{differ} differ, {len(common) - differ} identical of {len(common)} compared"
          + (f"; {len(only)} in one file only (e.g. {only[0]})" if only else ""))
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the fingerprint here (torch.save)")
    ap.add_argument("--compare", help="a fingerprint file to compare with")
    ap.add_argument("--compile", action="store_true", help="add the compile=True forms")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    fp = fingerprint(args.compile)
    if args.out:
        torch.save(fp, args.out)
    if args.compare:
        compare(fp, torch.load(args.compare, weights_only=True))
    else:
        print(f"{len(fp)} tensors from {len({k.rsplit('/', 1)[0] for k in fp})} optimizer forms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
