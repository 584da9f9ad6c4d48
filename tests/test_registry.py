"""One registry of per-optimizer facts: ``meqmuon/optim/registry.py``.

Every registered name trains through ``meqmuon train`` without ``--lr`` (``muoneq-r`` used to fail with
``KeyError``), builds through ``build_optimizer``, and every other table of names or learning rates
(``OPTIMIZERS``, compare's defaults and demo lrs, the memory and ablation rows, labels, CLI lists) is read
from the registry; no other module writes names of more than one optimizer.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import meqmuon
from meqmuon.cli import build_parser, main
from meqmuon.optim.registry import ABLATION_NAMES, DEMO_NAMES, MEMORY_NAMES, REGISTRY, OptimizerSpec, spec

PACKAGE = Path(meqmuon.__file__).resolve().parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_train_every_registered_name_without_lr(cache, tmp_path, capsys, name):
    out = tmp_path / name
    argv = ["train", "--model", "llama-tiny", "--optimizer", name, "--vocab-size", "512", "--seq-len", "16",
            "--global-batch", "2", "--steps", "1", "--val-tokens", "32", "--threads", "1", "--cache-dir", cache,
            "--out", str(out), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert math.isfinite(printed["val_loss"])
    train_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train_rows if r["kind"] == "train"] == [1]
    assert all(math.isfinite(r["loss"]) for r in train_rows if r["kind"] == "train")
    assert json.loads((out / "config.json").read_text())["lr"] == REGISTRY[name].default_lr
    assert json.loads((out / "summary.json").read_text())["lr"] == REGISTRY[name].default_lr


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 7, bias=False)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_builds_and_steps(name):
    entry = REGISTRY[name]
    assert isinstance(entry, OptimizerSpec) and entry.name == name and spec(name.upper()) is entry
    assert entry.default_lr > 0 and entry.demo_lr > 0
    model = Tiny()
    opt = meqmuon.build_optimizer(name, model)
    assert type(opt) is entry.cls and meqmuon.OPTIMIZERS[name] is entry.cls
    for key, value in entry.build_defaults.items():
        assert opt.defaults[key] == value
    model.lm_head(model.body(model.embed(torch.tensor([1, 2])))).sum().backward()
    opt.step()


def test_unknown_name_lists_the_registry():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'; valid optimizers: " + ", ".join(REGISTRY)):
        spec("lion")


def test_the_other_tables_are_read_from_the_registry(monkeypatch, tmp_path):
    from meqmuon.diagnostics import ablation, memory
    from meqmuon.train import compare

    assert meqmuon.OPTIMIZERS == {n: s.cls for n, s in REGISTRY.items()}
    assert list(meqmuon.OPTIMIZERS) == list(REGISTRY)
    # the values the tables held before the registry, in their order
    assert DEMO_NAMES == ("adamw", "muon", "normuon", "meqmuon")
    assert MEMORY_NAMES == ("adamw", "scale", "muon", "normuon", "meqmuon", "meqmuon-only-hidden",
                            "meqmuon-only-embedding", "meqmuon-only-vector", "muoneq-r")
    assert ABLATION_NAMES == ("muon", "meqmuon-only-hidden", "meqmuon-only-embedding", "meqmuon-only-vector",
                              "meqmuon")
    assert {n: s.demo_lr for n, s in REGISTRY.items()} == {
        "adamw": 3e-3, "muon": 1e-2, "normuon": 3e-2, "scale": 1e-2, "meqmuon": 3e-2, "meqmuon-only-hidden": 1e-2,
        "meqmuon-only-embedding": 1e-2, "meqmuon-only-vector": 1e-2, "muoneq-r": 2e-2, "muoneq-c": 1e-2,
        "muoneq-rc": 1e-2, "muon-plus": 4e-2, "muon-plus-shared": 4e-2, "muon-vs": 1e-2, "muon-vs-shared": 1e-2,
        "muonh": 2e-2, "muonh-2026-01": 2e-2, "aurora": 2e-2, "aurora-shared": 2e-2, "meqmuon-shape": 3e-2}
    # the 2026 presets (issue 48) take their own code's lrs where their step has another scale than Muon's, and
    # the recipes (issue 58) their configs' (Muon-VS's NanoGPT config: 6e-4)
    own = {"muon-plus": 4e-2, "muon-plus-shared": 4e-2, "muonh": 2e-2, "muonh-2026-01": 2e-2, "aurora": 2e-2,
           "aurora-shared": 2e-2, "muon-vs": 6e-4}
    assert {n: s.default_lr for n, s in REGISTRY.items()} == {
        n: own.get(n, 1e-3 if n == "adamw" else 2e-3) for n in REGISTRY}
    # defaults of the functions and commands
    assert inspect.signature(ablation.run_ablation).parameters["optimizers"].default is ABLATION_NAMES
    for fn in (memory.memory_mib, memory.measure_state_bytes):
        assert inspect.signature(fn).parameters["optimizers"].default is MEMORY_NAMES
    assert all(memory.label(n) == s.display for n, s in REGISTRY.items())
    assert build_parser().parse_args(["ablation"]).optimizers == list(ABLATION_NAMES)
    # compare: its default optimizers and each one's demo lr
    seen: dict[str, float] = {}

    def fake_run(cfg, *_):
        seen[cfg.optimizer] = cfg.lr
        raise SystemExit(0)

    monkeypatch.setattr(compare, "_train_or_reuse", fake_run)
    for name in REGISTRY:
        with pytest.raises(SystemExit):
            compare.run_compare([name], {}, compare.demo_config(), tmp_path)
    assert seen == {n: s.demo_lr for n, s in REGISTRY.items()}
    captured: dict[str, list[str]] = {}
    monkeypatch.setattr(compare, "run_compare", lambda names, *a, **k: captured.setdefault("names", names) and [])
    monkeypatch.setattr(compare, "format_table", lambda rows: "")
    main(["compare", "--out", str(tmp_path / "c")])
    assert captured["names"] == list(DEMO_NAMES)


def test_no_other_module_writes_a_table_of_optimizer_names():
    """String constants naming more than one registered optimizer appear in registry.py only (a module may
    name one, e.g. the default ``"meqmuon"``; ``"adamw"`` is also a rule name)."""
    tables = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "optim":
            continue
        consts = {n.value for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in REGISTRY}
        if len(consts) > 1:
            tables[str(path.relative_to(PACKAGE))] = sorted(consts)
    assert tables == {}
