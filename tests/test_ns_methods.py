"""Newton-Schulz methods behind ``ns_method`` (``optim/newton_schulz.py``'s table), against float64 references
written from their papers' equations here, in every form.

- ``"gram"`` (Dao-AILab/gram-newton-schulz): the quintic iteration (paper eq. 3) carried on the Gram
  matrix, so in exact arithmetic it *is* the quintic: its float64 result equals eq. 3's to 1e-12 and its
  float32 result is within 1e-5 of it, with and without restarts, wide, tall and square.
- ``"aol"`` (Turbo-Muon, arXiv 2512.04632): ``D = diag(sum_j |A_ij|)^{-1/2}`` of ``A = X X^T``, then
  ``steps - 1`` quintic iterations from ``D X``: float64 equals the reference to 1e-12, float32 within 1e-5,
  and the scaled input's spectral norm is at most 1 (AOL's guarantee).
- ``"cubic"`` (cubic5, arXiv 2606.00371; NVIDIA-NeMo/Emerging-Optimizers PR #217): ``X_0 = X / ||X||_F``,
  ``X <- a X + b (X X^T) X`` with the five ``(a, b)`` of upstream's ``_COEFFICIENT_SETS["cubic5"]`` (written
  out again below): float64 equals the reference to 1e-12, float32 within 1e-5, bf16 near float32; in every
  step form it is the quintic iteration with those coefficients (``c = 0``); ``ns_steps``/``ns_coefficients``
  that make no sense for it are refused when the optimizer is built.
- every method runs per matrix and batched with the same result, and steps every Muon-family optimizer in
  every step form (float64 against the quintic's optimizer for ``gram``).
"""

from __future__ import annotations

import pytest
import torch

import meqmuon
from meqmuon import functional as F
from meqmuon.optim.newton_schulz import NS_METHODS

SHAPES = [(12, 40), (40, 12), (16, 16), (3, 10, 24)]


def quintic_reference(x: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    """Paper eq. 3 in float64, one matrix at a time, the wide orientation: ``X_0 = X / ||X||_F``,
    ``A = X X^T``, ``X <- a X + (b A + c A^2) X``."""
    schedule, scale = F.ns_schedule(coefficients, steps)
    out = []
    for m in x.double().reshape(-1, *x.shape[-2:]):
        tall = m.shape[0] > m.shape[1]
        X = m.T if tall else m
        X = X / (scale * torch.linalg.matrix_norm(X))
        for a, b, c in schedule:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        out.append(X.T if tall else X)
    return torch.stack(out).reshape(x.shape)


def aol_reference(x: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    """Turbo-Muon's AOL scaling ``D X`` with ``D = diag(sum_j |(X X^T)_ij|)^{-1/2}`` (wide orientation), then
    ``steps - 1`` iterations of eq. 3 without the Frobenius normalisation, in float64."""
    schedule, _ = F.ns_schedule(coefficients, steps - 1)
    out = []
    for m in x.double().reshape(-1, *x.shape[-2:]):
        tall = m.shape[0] > m.shape[1]
        X = m.T if tall else m
        X = X / (X @ X.T).abs().sum(dim=1).sqrt()[:, None]
        for a, b, c in schedule:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        out.append(X.T if tall else X)
    return torch.stack(out).reshape(x.shape)


#: cubic5's ``(a, b)`` as in NVIDIA-NeMo/Emerging-Optimizers a4c2c262 ``muon_utils.py`` (``c = 0`` there).
CUBIC5_AB = [(3.3656576, -3.3420992), (2.5744352, -1.4957376), (2.5368962, -1.4312570), (2.4418906, -1.2764040),
             (2.2230472, -0.9630650)]


def cubic_reference(x: torch.Tensor, ab=CUBIC5_AB) -> torch.Tensor:
    """cubic5 in float64, one matrix at a time, the wide orientation: ``X_0 = X / ||X||_F``, ``A = X X^T``,
    ``X <- a X + b A X``."""
    out = []
    for m in x.double().reshape(-1, *x.shape[-2:]):
        tall = m.shape[0] > m.shape[1]
        X = m.T if tall else m
        X = X / torch.linalg.matrix_norm(X)
        for a, b in ab:
            X = a * X + b * (X @ X.T) @ X
        out.append(X.T if tall else X)
    return torch.stack(out).reshape(x.shape)


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", [F.NS_COEFFICIENTS, "polar_express"])
def test_gram_is_the_quintic_iteration(shape, coefficients):
    x = _x(shape)
    ref = quintic_reference(x, coefficients, 5)
    for restarts in ((), (2,), (1, 3)):
        got = F.gram_orthogonalize(x, 5, coefficients, torch.float64, restarts=restarts)
        assert (got - ref).abs().max() < 1e-12, restarts
    got32 = F.gram_orthogonalize(x, 5, coefficients, torch.float32)
    assert got32.dtype == torch.float32 and (got32.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_aol_is_scaled_quintic_iterations(shape):
    x = _x(shape, seed=1)
    ref = aol_reference(x, F.NS_COEFFICIENTS, 5)
    assert (F.aol_orthogonalize(x, 5, F.NS_COEFFICIENTS, torch.float64) - ref).abs().max() < 1e-12
    assert (F.aol_orthogonalize(x, 5, F.NS_COEFFICIENTS, torch.float32).double() - ref).abs().max() < 1e-5
    m = x.reshape(-1, *x.shape[-2:])[0]
    wide = m.T if m.shape[0] > m.shape[1] else m
    scaled = wide / (wide @ wide.T).abs().sum(dim=1).sqrt()[:, None]
    assert torch.linalg.matrix_norm(scaled, ord=2) <= 1 + 1e-12  # AOL's bound


@pytest.mark.parametrize("shape", SHAPES)
def test_cubic_is_cubic5(shape):
    x = _x(shape, seed=4)
    ref = cubic_reference(x)
    assert F.CUBIC5 == tuple((a, b, 0.0) for a, b in CUBIC5_AB)
    for batched in (False, True):
        got = F.cubic_orthogonalize(x, 5, F.NS_COEFFICIENTS, torch.float64, batched=batched)
        assert (got - ref).abs().max() < 1e-12
        got32 = F.cubic_orthogonalize(x.float(), 5, F.NS_COEFFICIENTS, torch.float32, batched=batched)
        assert got32.dtype == torch.float32 and (got32.double() - ref).abs().max() < 1e-5
        got16 = F.cubic_orthogonalize(x.float(), 5, F.NS_COEFFICIENTS, torch.bfloat16, batched=batched)
        assert got16.dtype == torch.bfloat16 and (got16.double() - ref).abs().max() < 0.05
    # explicit (a, b, 0) triples: the same iteration with those; one triple repeats
    assert (F.cubic_orthogonalize(x, 5, F.CUBIC5, torch.float64) - ref).abs().max() < 1e-12
    one = cubic_reference(x, [(2.0, -1.5)] * 3)
    assert (F.cubic_orthogonalize(x, 3, (2.0, -1.5, 0.0), torch.float64) - one).abs().max() < 1e-12


@pytest.mark.parametrize("kw, match", [({"ns_steps": 4}, "fixed 5-step schedule; got ns_steps=4"),
                                        ({"ns_coefficients": "polar_express"}, "no named schedule"),
                                        ({"ns_coefficients": (3.0, -4.0, 2.0)}, "needs c = 0")])
def test_cubic_refuses_steps_and_coefficients_it_cannot_run(kw, match):
    for cls in (meqmuon.MeqMuon, meqmuon.Muon):
        with pytest.raises(ValueError, match=match):
            cls(_model().parameters(), ns_method="cubic", **kw)
    cls(_model().parameters(), ns_method="cubic", ns_steps=3, ns_coefficients=[(2.0, -1.5, 0.0)] * 3)


def _hidden_run(cls, foreach, **kw):
    model = _model().double()
    params = [p for p in model.parameters() if p.ndim == 2]
    opt = cls(params, lr=0.02, ns_dtype=torch.float64, foreach=foreach, **kw)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    return params


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", [meqmuon.MeqMuon, meqmuon.Muon])
def test_cubic_in_optimizers_is_the_quintic_iteration_with_cubic5(cls, foreach):
    cubic = _hidden_run(cls, foreach, ns_method="cubic")
    quintic = _hidden_run(cls, foreach, ns_coefficients=F.CUBIC5)  # c = 0: the same polynomial, one matmul more
    assert max((a - b).abs().max().item() for a, b in zip(cubic, quintic, strict=True)) < 1e-10
    jordan = _hidden_run(cls, foreach)
    assert max((a - b).abs().max().item() for a, b in zip(cubic, jordan, strict=True)) > 1e-6  # another update


def test_gram_falls_back_to_the_quintic_on_square_matrices():
    x = _x((3, 16, 16), seed=3)
    assert torch.equal(F.gram_orthogonalize(x, 5, F.NS_COEFFICIENTS, torch.float32),
                       F.orthogonalize(x, 5, F.NS_COEFFICIENTS, torch.float32))


@pytest.mark.parametrize("method", ["gram", "aol", "cubic"])
def test_methods_per_matrix_equal_batched_and_write_out(method):
    x = _x((4, 12, 40), seed=2)
    fn = NS_METHODS[method].function
    per = fn(x, 5, F.NS_COEFFICIENTS, torch.float64)
    out = torch.empty_like(per)
    assert fn(x.clone(), 5, F.NS_COEFFICIENTS, torch.float64, batched=True, inplace=True, out=out) is out
    assert (out - per).abs().max() < 1e-12
    assert torch.equal(fn(x[1:2], 5, F.NS_COEFFICIENTS, torch.float64)[0], per[1])  # bits of a matrix alone


@pytest.mark.parametrize("method", ["quintic", "gram", "aol", "cubic"])
@pytest.mark.parametrize("shape", [(3, 12, 40), (2, 40, 12), (2, 16, 16)])
@pytest.mark.parametrize("steps", [5, 4])
def test_per_matrix_inplace_is_the_same_bits_and_spends_its_input(method, shape, steps):
    """Matrix by matrix with ``inplace`` (an owner's received matrices, ``driver.directions``' ``consume``): the
    same bits as with a copy; the quintic and cubic iterate in the input's own buffer (it is overwritten, so
    no copy of it was made) and, for an odd number of steps, in the result (no third buffer kept), the others
    make no copy; an input in another dtype or not contiguous is left alone."""
    fn = NS_METHODS[method].function
    coefficients = F.CUBIC5[:steps] if method == "cubic" else F.NS_COEFFICIENTS
    x = _x(shape, seed=4).float()
    ref = fn(x, steps, coefficients, torch.float32)
    scratch, workspace = x.clone(), {}
    out = torch.empty_like(ref)
    assert fn(scratch, steps, coefficients, torch.float32, inplace=True, out=out, workspace=workspace) is out
    assert torch.equal(out, ref)
    iterates = method in ("quintic", "cubic") or (method == "gram" and shape[-1] == shape[-2])
    assert torch.equal(scratch, x) != iterates  # overwritten exactly where Newton-Schulz iterated in it
    # what Newton-Schulz keeps beside the input and the result: the Gram buffers, and an iterate for even steps
    assert [sorted(ws) for ws in workspace.values()] == ([["G"] if steps % 2 else ["G", "Y"]] if iterates else [])
    for other in (x.double(), x.mT.contiguous().mT):  # a cast, a strided input: copied, not written
        kept = other.clone()
        assert torch.equal(fn(other, steps, coefficients, torch.float32, inplace=True),
                           fn(kept, steps, coefficients, torch.float32))
        assert torch.equal(other, kept)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 24), torch.nn.Linear(24, 8),
                               torch.nn.LayerNorm(8), torch.nn.Linear(8, 20))


def _run(name, steps=3, **kw):
    model = _model().double()
    opt = meqmuon.build_optimizer(name, model, lr=0.02, ns_dtype=torch.float64, **kw)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["meqmuon", "muon", "normuon", "muoneq-r"])
@pytest.mark.parametrize("foreach", [False, True])
def test_every_muon_family_optimizer_takes_ns_method(name, foreach):
    quintic = _run(name, foreach=foreach)
    gram = _run(name, foreach=foreach, ns_method="gram")
    assert max((a - b).abs().max().item() for a, b in zip(gram, quintic, strict=True)) < 1e-10
    aol = _run(name, foreach=foreach, ns_method="aol")
    assert max((a - b).abs().max().item() for a, b in zip(aol, quintic, strict=True)) > 1e-6  # another update
    assert all(torch.isfinite(p).all() for p in aol)


@pytest.mark.parametrize("method", ["gram", "aol", "cubic"])
def test_compiled_step_with_each_method_equals_eager(method):
    eager = _run("meqmuon", steps=2, ns_method=method, foreach=True)
    compiled = _run("meqmuon", steps=2, ns_method=method, foreach=True, compile=True)
    assert max((a - b).abs().max().item() for a, b in zip(compiled, eager, strict=True)) < 1e-10


def test_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match=r"quintic, quintic\+1e-7, quintic\+1e-8, gram, aol, cubic"):
        meqmuon.build_optimizer("muon", _model(), ns_method="newton")


def test_ns_methods_benchmark_prints_every_method_and_its_flops(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ns_methods

    assert ns_methods.main(["--models", "llama-tiny", "--repeats", "1"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| llama-tiny")]
    assert {r[3].strip() for r in rows} == set(NS_METHODS) and len(rows) == 3 * len(NS_METHODS)
    flops = {(r[2].strip(), r[3].strip()): float(r[4]) for r in rows}
    assert flops[("128x344", "gram")] < flops[("128x344", "quintic")]  # the Gram form's point: fewer FLOPs
    assert flops[("128x128", "gram")] == flops[("128x128", "quintic")]  # squares fall back to the quintic
    quintic = {r[2].strip(): float(r[9]) for r in rows if r[3].strip() == "quintic"}
    gram = {r[2].strip(): float(r[9]) for r in rows if r[3].strip() == "gram"}
    assert gram == quintic  # same distance to the polar factor: the same iteration
    assert flops[("128x344", "cubic")] < flops[("128x344", "quintic")]  # 10 matmuls, not 15


@pytest.mark.parametrize("method", ["gram", "aol", "cubic"])
def test_batched_op_counts_are_flat_in_depth(method):
    """``benchmarks/op_count.py`` at Llama-60M shapes (meta tensors): the batched step with each method
    dispatches the same number of ops at 1x and 3x the depth."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from op_count import count_step_ops, deepen
    from shapes import model_shapes

    shapes = model_shapes("llama-60m")
    counts = [count_step_ops("meqmuon", deepen(shapes, d), True, ns_method=method).total for d in (1, 3)]
    assert counts[0] == counts[1], counts


# ---- one record per method: its FLOPs are what balancing reads (issue 46, item 10) ----------------


@pytest.mark.parametrize("method", list(NS_METHODS))
@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (16, 16)])
@pytest.mark.parametrize("batched", [False, True])
def test_each_method_record_counts_the_flops_its_function_runs(method, shape, batched):
    """A record's ``flops`` equals the matmul FLOPs torch's own ``FlopCounterMode`` counts when the record's
    function runs (5 steps, the default coefficients: cubic5 for ``"cubic"``)."""
    from torch.utils.flop_counter import FlopCounterMode

    record = NS_METHODS[method]
    x = _x((1, *shape), seed=5)
    with FlopCounterMode(display=False) as counter:
        record.function(x, 5, F.NS_COEFFICIENTS, torch.float64, batched=batched)
    assert counter.get_total_flops() == record.flops(*shape, 5), (method, shape)


@pytest.mark.parametrize("method", ["gram", "aol", "cubic"])
def test_owners_are_balanced_by_the_running_method_flops(method):
    """``driver.cost`` (what DDP owners, bucket slices and the owner path balance by) reads the group's
    ``ns_method``'s record, not the quintic's: with ``ns_method="cubic"`` a hidden matrix costs cubic5's
    FLOPs (10 matmuls of ``2 a^2 b``), with the quintic 5 * (4 a^2 b + 2 a^3)."""
    from meqmuon.optim import driver
    from meqmuon.optim.newton_schulz import ns_flops

    w = torch.nn.Parameter(torch.zeros(24, 64))
    opt = meqmuon.Muon([{"params": [w], "kind": "hidden"}], ns_method=method, ns_dtype=torch.float64)
    group = opt.param_groups[0]
    rule = opt._rules["hidden"]
    elementwise = driver.ELEMENTWISE_COST * w.numel()
    assert driver.cost(rule, w.shape, group) == NS_METHODS[method].flops(24, 64, 5) + elementwise
    assert NS_METHODS[method].flops(24, 64, 5) != ns_flops(24, 64, 5)
    if method == "cubic":
        assert driver.cost(rule, w.shape, group) == 5 * 4 * 24 * 24 * 64 + elementwise


@pytest.mark.parametrize("shape", [(3, 6, 10), (3, 10, 6), (2, 7, 7)])
def test_symmetric_stack_products_equal_the_plain_ones(shape, monkeypatch):
    """``SYMMETRIC_STACK_MIN`` (the batched form's switch, off by default): the block-symmetric products give
    the plain iteration's result (float64; each entry the same dot product, rounding only), tall, wide, odd k."""
    from meqmuon import orthogonalization as O

    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain = O.orthogonalize_stack(x)
    monkeypatch.setattr(O, "SYMMETRIC_STACK_MIN", 2)
    blocks = O.orthogonalize_stack(x)
    assert torch.allclose(blocks, plain, rtol=0, atol=1e-12), (blocks - plain).abs().max()
    A = O._symmetric_baddbmm(None, x, x.mT)
    assert torch.equal(A, A.mT) and torch.allclose(A, x @ x.mT, atol=1e-12)
