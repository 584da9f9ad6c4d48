"""The benchmark scripts run end to end (tiny models, a few steps) and print the tables the docs quote.

These check that the scripts work and that their numbers are well-formed, never how fast anything
is: timings belong in docs/benchmarks.md, measured by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cli_startup  # noqa: E402
import gpu  # noqa: E402
import scaling  # noqa: E402
import shapes  # noqa: E402
import step_time  # noqa: E402

RATIO = r"(\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\)"  # "median (low-high)"


def test_cli_startup_times_every_row(capsys):
    cli_startup.main(["--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [label for label, _ in cli_startup.ROWS]
    assert all(re.search(r"\| \d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\) \|$", r) for r in rows), rows


def test_model_shapes_route_every_tensor_of_the_tiny_llama():
    got = shapes.model_shapes("llama-tiny")
    # 4 layers x (q, k, v, o, gate, up, down) hidden matrices; untied embedding and head.
    assert len(got["hidden"]) == 28 and len(got["embedding"]) == 1 and len(got["head"]) == 1
    assert set(got["hidden"]) == {(128, 128), (344, 128), (128, 344)}


def test_step_time_prints_medians_and_paired_ratios(capsys):
    step_time.main(["--model", "llama-tiny", "--repeats", "3", "--warmup", "1", "--optimizers", "meqmuon"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"optimizer", "meqmuon", "torch Muon+AdamW"}, out
    ref = rows["torch Muon+AdamW"]
    m = re.search(RATIO, ref)
    assert m and m.groups() == ("1.00", "1.00", "1.00")  # the reference against itself, every round
    cells = re.findall(RATIO, rows["meqmuon"])
    assert len(cells) == 2  # against torch Muon+AdamW and against the floor
    for cell in cells:
        median, low, high = map(float, cell)
        assert 0 < low <= median <= high
    assert "FLOP floor" in out


def test_step_time_ns_variants_add_one_meqmuon_row_each(capsys):
    """``--ns-variants`` times MeqMuon once per Newton-Schulz method (and iteration count) in the same
    round-robin, with the method reaching the optimizer's groups; ``--clock cpu`` says so."""
    step_time.main(["--model", "llama-tiny", "--repeats", "1", "--warmup", "0", "--optimizers", "meqmuon",
                    "--ns-variants", "gram", "aol", "quintic:3", "--clock", "cpu"])
    out = capsys.readouterr().out
    assert "clock: process CPU time (--clock cpu)" in out
    rows = {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")}
    assert rows == {"optimizer", "meqmuon", "torch Muon+AdamW", "meqmuon (gram)", "meqmuon (aol)",
                    "meqmuon (quintic, 3 steps)"}, out
    assert step_time.parse_variant("quintic:4") == ("meqmuon (quintic, 4 steps)",
                                                    {"ns_method": "quintic", "ns_steps": 4})
    assert step_time.parse_variant("quintic:4:polar_express") == (
        "meqmuon (quintic, 4 steps, polar_express)",
        {"ns_method": "quintic", "ns_steps": 4, "ns_coefficients": "polar_express"})
    params = step_time.make_params(shapes.model_shapes("llama-tiny"), "cpu")
    opt = step_time.build("meqmuon", params, ns_method="gram", ns_steps=4)
    hidden = [g for g in opt.param_groups if g.get("ns_method") is not None]
    assert hidden and all(g["ns_method"] == "gram" and g["ns_steps"] == 4 for g in hidden)


def test_step_time_names_capability_and_ns_dtype_and_torch_ns_copy_is_faithful(capsys):
    """The FLOP floor and every optimizer use the resolved NS dtype, and the output says which and on
    what CPU; the copy of torch's Newton-Schulz with another cast equals torch's own in bf16."""
    import torch
    import torch.optim._muon as torch_muon

    from meqmuon.precision import detect_cpu_capability, resolve_ns_dtype

    step_time.main(["--model", "llama-tiny", "--repeats", "1", "--warmup", "0", "--optimizers", "muon"])
    out = capsys.readouterr().out
    name = str(resolve_ns_dtype(None, "cpu")).removeprefix("torch.")
    assert f"CPU capability {detect_cpu_capability()}" in out and f"{name} NS)" in out
    assert f"best measured {name} matmul rate" in out and "--ns-dtype auto" in out
    g = torch.Generator().manual_seed(0)
    for shape in ((12, 8), (8, 12)):
        x = torch.randn(shape, generator=g)
        args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(step_time.torch_ns_in(torch.bfloat16)(x, *args),
                           torch_muon._zeropower_via_newtonschulz(x, *args))
        assert step_time.torch_ns_in(torch.float32)(x, *args).dtype == torch.float32


def test_scaling_pairs_one_rank_with_two_ranks(capsys):
    scaling.main(["--model", "llama-tiny", "--cores", "2", "--world", "2", "--threads-per-rank", "1",
                  "--repeats", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    m = re.search(r"2 ranks / 1 rank, per round: median (\d+\.\d\d), range (\d+\.\d\d)-(\d+\.\d\d)", out)
    assert m, out
    median, low, high = map(float, m.groups())
    assert 0 < low <= median <= high
    assert re.search(r"^\| 1 \| 1 \| \d+ \|$", out, re.M) and re.search(r"^\| 2 \| 1 \| \d+ \|$", out, re.M)


@pytest.mark.parametrize("per_matrix, foreach", [(False, "auto"), (True, "auto"), (False, "on")])
def test_gpu_benchmark_smoke_runs_on_cpu(capsys, per_matrix, foreach, monkeypatch):
    """The GPU benchmark has never had a GPU here; its --tiny mode at least proves the script runs,
    on the per-tensor step and on the batched one (--foreach on)."""
    from meqmuon.optim import newton_schulz

    monkeypatch.setattr(newton_schulz, "BATCHED_NS_DEVICES", newton_schulz.BATCHED_NS_DEVICES)  # restored after
    args = ["--tiny", "--no-compile", "--steps", "2", "--warmup", "1", "--device", "cpu", "--foreach", foreach]
    gpu.main(args + (["--ns-per-matrix"] if per_matrix else []))
    out = capsys.readouterr().out
    assert f"foreach={foreach}" in out
    m = re.search(r"\| ([\d,]+) tok/s \| MFU [\d.]+% \| optimizer [\d.]+ ms \((\d+)%\) \| loss (\d+\.\d+) \|", out)
    assert m, out
    assert int(m[1].replace(",", "")) > 0 and 0 < int(m[2]) <= 100 and 0 < float(m[3]) < 20


def test_seed_pairs_pairs_by_seed_at_each_best_lr(tmp_path):
    """Two sweeps' results.json: B - A per optimizer at each sweep's own best lr, paired by seed,
    with the t interval; pairs within a sweep the same way. Values hand-made so each sum is known."""
    import json

    import seed_pairs

    def rows(values):  # {(optimizer, lr): [loss per seed 0, 1, 2]}
        return [{"optimizer": o, "lr": lr, "seed": s, "final val loss": v}
                for (o, lr), vs in values.items() for s, v in enumerate(vs)]

    a = rows({("x", 0.01): [5.0, 5.1, 5.2], ("x", 0.02): [4.0, 4.1, 4.2], ("y", 0.01): [4.5, 4.5, 4.5]})
    b = rows({("x", 0.01): [3.9, 4.1, 4.3], ("x", 0.02): [6.0, 6.0, 6.0], ("y", 0.01): [4.4, 4.6, 4.5]})
    (tmp_path / "a.json").write_text(json.dumps({"runs": a, "summary": []}))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = seed_pairs.report(seed_pairs.load_rows(tmp_path / "a.json"), seed_pairs.load_rows(tmp_path / "b.json"),
                            ("A", "B"))
    lines = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    # x: best lr 0.02 in A, 0.01 in B; differences -0.1, 0, +0.1: mean 0, interval +-t(2) * 0.1 / sqrt(3).
    half = 4.302652729911275 * 0.1 / 3 ** 0.5
    cells = lines["x"].split("|")[2:7]
    assert cells[:2] == [" 0.02 ", " 0.01 "] and abs(float(cells[2])) < 1e-4
    assert cells[3:] == [f" [{-half:+.4f}, {half:+.4f}] ", " 3 "]
    assert lines["x"].rstrip().endswith("| no |")
    # Within A: x (0.02) - y differences -0.5, -0.4, -0.3: interval excludes 0.
    assert "| x - y | 0.02 | 0.01 | -0.4000 |" in out and out.split("B: Δ")[0].count("| yes |") == 1
    # One sweep: only its pairs, the same rows.
    one = seed_pairs.report(seed_pairs.load_rows(tmp_path / "a.json"), None, ("A",))
    assert one.startswith("A: Δ = first minus second") and "| x - y | 0.02 | 0.01 | -0.4000 |" in one
    assert "B" not in one and one.count("| yes |") == 1


def test_train_phases_prints_cpu_seconds_per_phase(tmp_path):
    """benchmarks/train_phases.py in its own process (its imports are a phase): one row per phase, numbers."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "train_phases.py"), "--steps", "2", "--", "--seq-len", "16",
         "--global-batch", "2", "--vocab-size", "512", "--val-tokens", "64", "--cache-dir", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| phase")}
    assert list(rows)[:2] == ["import meqmuon.cli + loop", "import meqmuon.train.models (transformers)"]
    assert {"data, model, optimizer", "updates", "evaluation", "checkpoints"} <= set(rows)
    assert all(float(v) >= 0 for v in rows.values()) and float(rows["updates"]) > 0


def test_traffic_counter_counts_each_read_and_write_once_and_leaves_matmuls_out():
    """``op_count.py --bytes``: an in-place add of float32 lists moves 12 B per element (two reads, one write),
    an ``out=`` product of a bf16 matrix and a float32 column 2 + 4 B per element plus the column, a matmul
    nothing (the FLOP floor counts it); MeqMuon's batched step moves more than Muon's (eq. 8's passes)."""
    import op_count
    import torch

    a, b = torch.empty(1000, device="meta"), torch.empty(1000, device="meta")
    x = torch.empty(10, 100, device="meta", dtype=torch.bfloat16)
    col, z = torch.empty(10, 1, device="meta"), torch.empty(10, 100, device="meta")
    with op_count.TrafficCounter() as counted:
        torch._foreach_add_([a], [b])
        torch.mul(x, col, out=z)
        torch.mm(z, z.T)
    assert counted.bytes == {"_foreach_add_": 12_000, "mul": 2_000 + 40 + 4_000}, counted.bytes
    shapes_ = op_count.model_shapes("llama-tiny")
    muon, meq = (op_count.count_step_ops(n, shapes_, True, counter=op_count.TrafficCounter).total_bytes
                 for n in ("muon", "meqmuon"))
    assert meq > muon > 0
