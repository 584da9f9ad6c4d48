"""Tests of meqmuon.diagnostics: statistics against float64 by hand, memory against the paper, and the
commands on captures of a few real steps of a tiny Llama (MeqMuon and Muon)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

import meqmuon
from meqmuon.diagnostics import cli as dcli
from meqmuon.diagnostics.ablation import ablation_table, meta_param_groups
from meqmuon.diagnostics.capture import layer_index, load_captures, module_type
from meqmuon.diagnostics.imbalance import matrix_stats
from meqmuon.diagnostics.memory import memory_mib, predicted_state_bytes
from meqmuon.diagnostics.selection import selection_shares
from meqmuon.diagnostics.trajectory import exact_orthogonalize, ns_trajectory
from meqmuon.functional import orthogonalize, row_col_cv
from meqmuon.train.capture import CaptureRecorder
from meqmuon.train.models import build_model

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CAPTURE_STEPS = (2, 3)
CAPTURE_LAYERS = (0, 1)


# ---- float64 references written out by hand (paper eq. 4-5) ----------------------------------


def _cv_by_hand(values: list[float], delta: float = 1e-7) -> float:
    kept = [v for v in values if v > delta]
    mean = sum(kept) / len(kept)
    var = sum((v - mean) ** 2 for v in kept) / len(kept)  # population variance (1 / m_+)
    return math.sqrt(var) / mean


def _cvs_by_hand(x: torch.Tensor) -> tuple[float, float]:
    rows = x.double().tolist()
    m, n = len(rows), len(rows[0])
    r = [math.sqrt(sum(v * v for v in row) / n) for row in rows]
    c = [math.sqrt(sum(rows[i][j] ** 2 for i in range(m)) / m) for j in range(n)]
    return _cv_by_hand(r), _cv_by_hand(c)


def test_momentum_cvs_match_hand_computation_with_zero_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 12, generator=g) * torch.rand(40, 1, generator=g) * 3
    x[5] = 0.0  # a zero row (e.g. a vocabulary entry never seen) is excluded from gamma_r
    x[:, 3] = 1e-9  # a column at RMS <= 1e-7 counts as zero for gamma_c
    stats = matrix_stats(x, "embedding")
    want = _cvs_by_hand(x)
    assert stats["before"] == pytest.approx(want, rel=1e-5)
    # Two-sided normalisation (eq. 9) leaves unit-RMS columns: gamma_c after is ~0, gamma_r drops.
    assert stats["after"][1] < 1e-6
    assert stats["after"][0] < stats["before"][0]


def test_hidden_cvs_are_those_of_the_orthogonalised_update():
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(2))
    stats = matrix_stats(x, "hidden", ns_dtype=torch.float32)
    u = orthogonalize(x, 5, dtype=torch.float32)
    assert stats["before"] == pytest.approx(_cvs_by_hand(u), rel=1e-4)
    side = 0 if stats["chose_rows"] else 1
    assert stats["chose_rows"] == (stats["before"][0] >= stats["before"][1])
    assert stats["after"][side] < 1e-6


def test_ns_trajectory_replays_orthogonalize_exactly():
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.bfloat16, torch.float32):
        traj = ns_trajectory(x, 20, dtype=dtype)
        assert len(traj) == 21
        for k in (1, 5, 20):
            gr, gc = row_col_cv(orthogonalize(x, k, dtype=dtype))
            assert traj[k] == (float(gr), float(gc))
    # k = 0 is X / ||X||_F: the CVs of the input (scale invariant).
    assert ns_trajectory(x, 0, dtype=torch.float64)[0] == pytest.approx(_cvs_by_hand(x), rel=1e-9)


@pytest.mark.parametrize("shape, free_side", [((60, 20), 0), ((20, 60), 1)])
def test_exact_orthogonalisation_constrains_only_one_side_of_a_rectangle(shape, free_side):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 3, shape[0])[:, None]
    cvs = _cvs_by_hand(exact_orthogonalize(x))
    assert cvs[1 - free_side] < 1e-6  # tall: Y^T Y = I, equal columns; wide: equal rows
    assert cvs[free_side] > 1e-3  # the other side is not constrained


# ---- memory (Table 5, Table 7) ---------------------------------------------------------------

PAPER_TABLE5 = {
    "muon": (346.57, 699.15, 1653.88, 621.27, 1560.48, 2404.17),
    "normuon": (346.73, 699.51, 1654.85, 621.86, 1561.53, 2405.33),
    "meqmuon": (221.53, 511.57, 1403.69, 513.13, 1380.24, 1884.59),
}
PAPER_TABLE7 = {  # Llama-60M, Llama-130M
    "muon": (346.57, 699.15),
    "meqmuon-only-hidden": (346.57, 699.15),
    "meqmuon-only-embedding": (221.57, 511.65),
    "meqmuon-only-vector": (346.53, 699.07),
    "meqmuon": (221.53, 511.57),
}
PAPER_MODELS = ("llama-60m", "llama-130m", "llama-350m", "smollm2-135m", "smollm2-360m", "qwen2-0.5b")


@pytest.fixture(scope="module")
def paper_groups():
    return meta_param_groups(PAPER_MODELS)


def test_memory_equals_table5_and_table7(paper_groups):
    values = memory_mib(paper_groups)
    for opt, want in PAPER_TABLE5.items():
        for model, w in zip(PAPER_MODELS, want, strict=True):
            assert abs(values[opt][model] - w) <= 0.005 + 1e-9, (opt, model, values[opt][model], w)
    for opt, want in PAPER_TABLE7.items():
        for model, w in zip(PAPER_MODELS[:2], want, strict=True):
            assert abs(values[opt][model] - w) <= 0.005 + 1e-9, (opt, model, values[opt][model], w)
    # SCALE is undefined on the tied models, defined on Llama.
    assert [values["scale"][m] is None for m in PAPER_MODELS] == [False] * 3 + [True] * 3
    # MuonEq (not in the paper) keeps exactly Muon's state: one momentum per hidden matrix, AdamW elsewhere.
    assert values["muoneq-r"] == values["muon"]
    # The paper's headline: MeqMuon saves 21.6 % over Muon on Qwen2-0.5B.
    assert 1 - values["meqmuon"]["qwen2-0.5b"] / values["muon"]["qwen2-0.5b"] == pytest.approx(0.216, abs=5e-4)


def test_bf16_state_halves_everything_but_normuon_row_moments(paper_groups):
    groups = paper_groups["llama-60m"]
    rows = sum(p.shape[0] for g in groups if g["kind"] == "hidden" for p in g["params"])
    for opt in ("muon", "meqmuon", "adamw"):
        assert 2 * predicted_state_bytes(opt, groups, 2) == predicted_state_bytes(opt, groups, 4)
    assert 2 * predicted_state_bytes("normuon", groups, 2) == predicted_state_bytes("normuon", groups, 4) + 4 * rows


# ---- captures of a real tiny run -------------------------------------------------------------


def _train(name: str, run_dir: Path, steps: int = 3) -> dict:
    model = build_model("llama-tiny", vocab_size=256, seed=0)
    opt = meqmuon.build_optimizer(name, model, lr=2e-3)
    rec = CaptureRecorder(run_dir, CAPTURE_STEPS, CAPTURE_LAYERS)
    rec.attach(opt)
    gen = torch.Generator().manual_seed(0)
    files_after_step, hook_installed = {}, {}
    for step in range(1, steps + 1):
        x = torch.randint(0, 256, (4, 64), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        hook_installed[step] = opt._capture_hook is not None
        rec.begin_step(step)
        opt.step()
        rec.end_step()
        opt.zero_grad(set_to_none=True)
        files_after_step[step] = sorted(p.name for p in (run_dir / "captures").glob("*.pt"))
    counts = opt.selection_counts() if hasattr(opt, "selection_counts") else {}
    if counts:  # the harness's format
        (run_dir / "selection_counts.json").write_text(
            json.dumps({"step": steps, "optimizer": name, "counts": {k: list(v) for k, v in counts.items()}})
        )
    return {"dir": run_dir, "files": files_after_step, "hook": hook_installed, "opt": opt}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.manual_seed(0)
    return {name: _train(name, tmp_path_factory.mktemp(name)) for name in ("meqmuon", "muon")}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meqmuon")
    dcli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run_cli(*argv: str) -> int:
    args = _parser().parse_args(list(argv))
    return args.func(args)


def test_recorder_writes_only_capture_steps_and_then_unhooks(runs):
    for run in runs.values():
        assert run["files"][1] == []  # nothing for a non-capture step
        assert run["files"][2] == ["step_2.pt"]
        assert run["files"][3] == ["step_2.pt", "step_3.pt"]
        assert run["hook"] == {1: True, 2: True, 3: True}
        assert run["opt"]._capture_hook is None  # removed after the last capture step
        cap = torch.load(run["dir"] / "captures" / "step_2.pt", weights_only=True)
        assert cap["step"] == 2
        hidden = [n for n, k in cap["kinds"].items() if k == "hidden"]
        assert sorted({layer_index(n) for n in hidden}) == list(CAPTURE_LAYERS)
        assert sorted(module_type(n) for n in hidden) == sorted(MODULES * len(CAPTURE_LAYERS))
        assert sorted(k for k in cap["kinds"].values() if k != "hidden") == ["embedding", "head"]
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in cap["tensors"].values())
    muon = load_captures(runs["muon"]["dir"], [2])[2]
    emb = next(n for n, k in muon["kinds"].items() if k == "embedding")
    assert muon["sources"][emb] == "accumulated_momentum" and muon["momentum_steps"][emb] == 2
    meq = load_captures(runs["meqmuon"]["dir"], [3])[3]
    assert set(meq["sources"].values()) == {"pre_ns", "momentum"}


class _FakeOptimizer:
    def __init__(self):
        self.hook = None

    def set_capture_hook(self, fn):
        self.hook = fn


def test_recorder_accumulates_momentum_of_gradient_only_kinds(tmp_path):
    opt = _FakeOptimizer()
    rec = CaptureRecorder(tmp_path, steps=[2], layers=[0])
    rec.attach(opt)
    g1, g2 = torch.randn(6, 4), torch.randn(6, 4)
    w = torch.randn(5, 5)
    for step, g in ((1, g1), (2, g2)):
        rec.begin_step(step)
        opt.hook("lm_head.weight", "head", "gradient", g)
        opt.hook("model.layers.0.mlp.up_proj.weight", "hidden", "momentum_input", w)
        opt.hook("model.layers.3.mlp.up_proj.weight", "hidden", "momentum_input", w)  # layer not chosen
        rec.end_step()
    cap = torch.load(tmp_path / "captures" / "step_2.pt", weights_only=True)
    torch.testing.assert_close(cap["tensors"]["lm_head.weight"], 0.95 * g1 + g2)
    assert set(cap["tensors"]) == {"lm_head.weight", "model.layers.0.mlp.up_proj.weight"}
    assert opt.hook is None and rec._momentum == {}  # unhooked and buffers freed after the last step


def test_recorder_off_installs_nothing(tmp_path):
    opt = _FakeOptimizer()
    rec = CaptureRecorder(tmp_path, steps=[])
    rec.attach(opt)
    rec.begin_step(1)
    rec.end_step()
    assert opt.hook is None and not rec.active
    assert not (tmp_path / "captures").exists()


def test_imbalance_command(runs):
    for name, run in runs.items():
        assert _run_cli("diagnose", "imbalance", "--run", str(run["dir"]), "--layers", "0,1") == 0
        records = json.loads((run["dir"] / "imbalance.json").read_text())
        hidden = [r for r in records if r["kind"] == "hidden"]
        assert len(hidden) == len(CAPTURE_STEPS) * len(CAPTURE_LAYERS) * len(MODULES)
        for r in hidden:  # the chosen side is balanced after eq. 8
            assert r["after"][0 if r["chose_rows"] else 1] < 1e-6, (name, r["name"])
        others = [r for r in records if r["kind"] != "hidden"]
        assert sorted(r["module"] for r in others) == sorted(["embed_tokens", "lm_head"] * len(CAPTURE_STEPS))
        assert all(r["after"][1] < 1e-6 for r in others)  # eq. 9 ends with column normalisation
        text = (run["dir"] / "imbalance.md").read_text()
        first = text.split("\n\n")[1].splitlines()  # Tables 1/8-10 block
        assert first[0].count("|") - 1 == 3 + 2 * len(CAPTURE_STEPS)
        assert len(first) == 2 + len(CAPTURE_LAYERS) * len(MODULES)
        assert all(line.count("**") == 2 * len(CAPTURE_STEPS) for line in first[2:])  # one bold per pair


def test_imbalance_layer_filter(runs, tmp_path):
    assert _run_cli("diagnose", "imbalance", "--run", str(runs["muon"]["dir"]), "--layers", "1", "--steps", "3",
                    "--out", str(tmp_path)) == 0  # fmt: skip
    records = json.loads((tmp_path / "imbalance.json").read_text())
    assert {r["step"] for r in records} == {3}
    assert {r["layer"] for r in records if r["kind"] == "hidden"} == {1}


def test_ns_trajectory_command(runs):
    run = runs["muon"]["dir"]
    assert _run_cli("diagnose", "ns-trajectory", "--run", str(run), "--layer", "1", "--step", "2") == 0
    res = json.loads((run / "ns_trajectory_layer1_step2.json").read_text())
    assert sorted(module_type(n) for n in res) == sorted(MODULES)
    for n, r in res.items():
        assert len(r["traj"]) == 21
        m, k = r["shape"]
        if m > k:  # tall (gate/up_proj): exact orthogonalisation equalises columns
            assert r["exact"][1] < 1e-6, n
        elif m < k:  # wide (down_proj): rows
            assert r["exact"][0] < 1e-6, n
    png = run / "ns_trajectory_layer1_step2.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = (run / "ns_trajectory_layer1_step2.md").read_text()
    assert "k=0 γ_r" in table and "k=20 γ_c" in table and "SVD γ_r" in table


def test_selection_command(runs):
    run = runs["meqmuon"]["dir"]
    assert _run_cli("diagnose", "selection", "--run", str(run)) == 0
    shares = json.loads((run / "selection.json").read_text())
    assert [a["module"] for a in shares] == list(MODULES)
    for a in shares:
        assert a["row_pct"] + a["col_pct"] == pytest.approx(100.0)
        assert a["rows"] + a["cols"] == 3 * 4  # 3 steps x 4 layers of llama-tiny
        assert len(a["shapes"]) == 1
    by = {a["module"]: a for a in shares}
    assert by["gate_proj"]["shapes"] == [[344, 128]] and by["down_proj"]["shapes"] == [[128, 344]]
    with pytest.raises(ValueError, match="only MeqMuon-type runs"):  # Muon has no counts
        _run_cli("diagnose", "selection", "--run", str(runs["muon"]["dir"]))


def test_selection_shares_arithmetic():
    counts = {"model.layers.0.self_attn.q_proj.weight": (3, 1), "model.layers.1.self_attn.q_proj.weight": (0, 4),
              "model.layers.0.mlp.down_proj.weight": (0, 0)}  # fmt: skip
    shares = selection_shares(counts)
    assert [a["module"] for a in shares] == ["q_proj"]  # a module with no counted step is left out
    assert shares[0]["row_pct"] == pytest.approx(37.5)


def test_memory_command(tmp_path):
    assert _run_cli("memory", "--models", "llama-60m,smollm2-135m", "--out", str(tmp_path)) == 0
    values = json.loads((tmp_path / "memory.json").read_text())
    assert values["meqmuon"] == pytest.approx({"llama-60m": 221.53, "smollm2-135m": 513.13}, abs=0.005)
    assert values["scale"]["smollm2-135m"] is None
    assert "| SCALE | 62.57 | -- |" in (tmp_path / "memory.md").read_text()


def test_memory_measure_matches_prediction(tmp_path):
    assert _run_cli("memory", "--models", "llama-60m", "--optimizers", "muon,normuon,meqmuon", "--measure",
                    "--out", str(tmp_path)) == 0  # fmt: skip
    text = (tmp_path / "memory.md").read_text()
    measured = text.split("Measured after one step")[1]
    assert measured.count("| yes |") == 3


def test_ablation_table_bolds_best_and_keeps_order():
    rows = [
        {"optimizer": "muon", "val_ppl": 30.0, "optimizer_state_mib": 11.0, "lr": 0.002, "steps": 10},
        {"optimizer": "meqmuon", "val_ppl": 29.5, "optimizer_state_mib": 7.0, "lr": 0.002, "steps": 10},
    ]
    text = ablation_table(rows).splitlines()
    assert text[2].startswith("| Muon |") and "**" not in text[2]
    assert "**29.50**" in text[3] and "7.000" in text[3]


def test_ns_dtype_auto_follows_the_run_then_the_hardware(tmp_path, monkeypatch):
    """`diagnose ... --ns-dtype auto` (default) analyses in the NS dtype the run recorded; without a
    record, in what ns_dtype=None gives on this CPU (injected both ways); explicit names win."""
    from meqmuon import precision
    from meqmuon.diagnostics.cli import _ns_dtype_name

    def name(run, ns_dtype="auto"):
        return _ns_dtype_name(argparse.Namespace(run=str(run), ns_dtype=ns_dtype))

    for recorded in ("bfloat16", "float32"):
        run = tmp_path / recorded
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"optimizer_args": {"ns_dtype": recorded}}))
        for cap in ("AVX2", "AVX512+AVX512_BF16"):
            monkeypatch.setattr(precision, "detect_cpu_capability", lambda cap=cap: cap)
            assert name(run) == recorded
        assert name(run, "float64") == "float64"
    bare = tmp_path / "old"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"optimizer_args": {}}))
    monkeypatch.setattr(precision, "detect_cpu_capability", lambda: "AVX2")
    assert name(bare) == "float32" and name(tmp_path / "missing") == "float32"
    monkeypatch.setattr(precision, "detect_cpu_capability", lambda: "AVX512+AVX512_BF16")
    assert name(bare) == "bfloat16"
