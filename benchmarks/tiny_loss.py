"""Held-out loss after 10 float32 steps of llama-tiny, per optimizer and form: a refactor's end-to-end check.

Usage::

    python benchmarks/tiny_loss.py --out before.pt                       # on the old commit
    python benchmarks/tiny_loss.py --out after.pt --compare before.pt    # on the new one

Muon, NorMuon and MeqMuon, per-tensor and batched, each train llama-tiny (float32 model, float32
Newton-Schulz, one thread) on 10 random-token batches of 4 x 64 at lr 2e-2 from the same seed; the
loss of one held-out batch of 8 x 64 is printed, and with ``--compare`` its relative difference from
the other file's.
"""

from __future__ import annotations

import argparse

import torch

import meqmuon
from meqmuon.train.models import build_model

OPTIMIZERS = ("muon", "normuon", "meqmuon")


def held_out_loss(name: str, foreach: bool, steps: int = 10) -> float:
    torch.manual_seed(0)
    model = build_model("llama-tiny").float()
    vocab = model.config.vocab_size
    opt = meqmuon.build_optimizer(name, model, lr=2e-2, foreach=foreach, ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 64), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    with torch.no_grad():
        ids = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(99))
        return model(input_ids=ids, labels=ids).loss.item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the losses here (torch.save)")
    ap.add_argument("--compare", help="a file of losses to compare with")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    losses = {f"{n}/{'batched' if fe else 'per-tensor'}": held_out_loss(n, fe)
              for n in OPTIMIZERS for fe in (False, True)}
    old = torch.load(args.compare, weights_only=True) if args.compare else {}
    for key, loss in losses.items():
        rel = f"  relative difference {abs(loss - old[key]) / abs(old[key]):.3g}" if key in old else ""
        print(f"{key}: {loss:.8f}{rel}")
    if args.out:
        torch.save(losses, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
