"""Matrix views: stacked experts, Conv1D, split fused projections, learned tokens.

What is proven:

- Exactness. A parameter seen through a view is updated exactly as its matrices would be if each
  were its own 2-D parameter: each expert of an ``(E, out, in)`` stack, each block of a split fused
  projection, the transpose of a ``Conv1D`` weight. Checked for every optimizer with a matrix rule,
  per-tensor and batched, with float32 Newton-Schulz, to 1e-5 relative (the issue's bound; the views
  run the very same code on the same bits, so the difference is 0 in practice). The reference
  optimizers hold the separate 2-D matrices, so this also holds each view to the float64
  references that the 2-D rules are tested against (references.py, the rule families' files
  test_meqmuon.py, test_muon.py, test_normuon.py, test_scale.py, test_adamw.py).
- State: one tensor per parameter (momentum shaped like it; MeqMuon's counter and NorMuon's second
  moment one entry per matrix / per matrix row), round-tripping ``state_dict`` through
  ``torch.load(weights_only=True)``; selection counts per matrix; the memory prediction equals the
  measured state.
- Routing: ``param_groups`` declares the view of each tensor from its module (experts, Conv1D,
  convolutions, fused projections, learned tokens), 1-row matrices are vectors (MeqMuon's update
  there is no longer a sign), per-group overrides work, and bad views are one clear error.
- Op counts: the batched step of a Mixtral-like model with 16 experts dispatches no more than 1.05x
  the ops of the same model with 4 (experts join the buckets of their matrix shape).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from capabilities import having
from torch import nn

import meqmuon
from meqmuon.optim.views import layout_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from op_count import count_step_ops, mixtral_shapes  # noqa: E402

#: Optimizers whose hidden rule works on matrices (the ``views`` check of capabilities.py).
MATRIX_OPTIMIZERS = having(check="views")
FORMS = [False, True]  # foreach: the per-tensor and the batched step, which every one of them has
STEPS = 4


def _build(name, groups, foreach):
    hp = {} if name == "scale" else {"ns_dtype": torch.float32}
    if "clip_norm" in meqmuon.valid_hyperparameters(name):
        # A recipe's clipping to one global norm (upstream's clip_grad_norm_, tests/test_recipes_2026.py) couples
        # every gradient by design; what these tests hold independent is the update rule of each view's matrices.
        hp["clip_norm"] = None
    return meqmuon.build_optimizer(name, groups, lr=2e-2, weight_decay=0.1, foreach=foreach, **hp)


def _run(name, foreach, params, groups, grads_of):
    opt = _build(name, groups, foreach)
    for step in range(STEPS):
        for p, g in zip(params, grads_of(step), strict=True):
            p.grad = g
        opt.step()
    return opt


def _grads(shapes, step):
    g = torch.Generator().manual_seed(100 + step)
    # rows of unequal scale, so that row and column statistics differ (the MeqMuon choice varies)
    return [torch.randn(s, generator=g) * (1 + torch.rand(s[:-1], generator=g)).unsqueeze(-1) for s in shapes]


def _close(a, b, init):
    moved = (b - init).norm()
    assert moved > 0
    assert ((a - b).norm() / moved).item() <= 1e-5


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", MATRIX_OPTIMIZERS)
def test_each_expert_is_updated_as_its_own_matrix(name, foreach):
    """``(E, out, in)`` experts (with a gate/up split, and a transposed stack) equal separate 2-D
    parameters; same-shape dense matrices share the experts' buckets."""
    E, d, inner = 3, 8, 6
    g = torch.Generator().manual_seed(0)
    up = torch.randn(E, 2 * inner, d, generator=g)  # gate and up halves
    down = torch.randn(E, d, inner, generator=g)
    flipped = torch.randn(E, d, inner, generator=g)  # stored (in, out): matrices (inner, d)
    dense = torch.randn(inner, d, generator=g)  # the shape of an up half: joins its bucket

    stacked = [nn.Parameter(t.clone()) for t in (up, down, flipped, dense)]
    groups = [{"params": stacked, "kind": "hidden", "names": ["up", "down", "flipped", "dense"],
               "views": ["stacked", "stacked", "stacked-transposed", "matrix"],
               "splits": [(inner, inner), None, None, None]}]
    shapes = [tuple(t.shape) for t in (up, down, flipped, dense)]

    def stacked_grads(step):
        return _grads(shapes, step)

    separate = ([nn.Parameter(up[e, :inner].clone()) for e in range(E)]
                + [nn.Parameter(up[e, inner:].clone()) for e in range(E)]
                + [nn.Parameter(down[e].clone()) for e in range(E)]
                + [nn.Parameter(flipped[e].T.clone()) for e in range(E)] + [nn.Parameter(dense.clone())])

    def separate_grads(step):
        gu, gd, gf, gx = _grads(shapes, step)
        return ([gu[e, :inner] for e in range(E)] + [gu[e, inner:] for e in range(E)] + list(gd.unbind(0))
                + [gf[e].T.contiguous() for e in range(E)] + [gx])

    opt = _run(name, foreach, stacked, groups, stacked_grads)
    ref = _run(name, foreach, separate, [{"params": separate, "kind": "hidden"}], separate_grads)
    got = ([stacked[0][e, :inner] for e in range(E)] + [stacked[0][e, inner:] for e in range(E)]
           + list(stacked[1].unbind(0)) + [stacked[2][e].T for e in range(E)] + [stacked[3]])
    inits = ([up[e, :inner] for e in range(E)] + [up[e, inner:] for e in range(E)] + list(down.unbind(0))
             + [flipped[e].T for e in range(E)] + [dense])
    for a, b, init in zip(got, separate, inits, strict=True):
        _close(a.detach(), b.detach(), init)
    if meqmuon.rules_of(name)["hidden"] == "meq_hidden":  # eq. 8's choice counts (not meqmuon-shape's)
        counts = opt.selection_counts()
        assert set(counts) == {f"up[{e}]#{j}" for e in range(E) for j in (0, 1)} | {
            f"{n}[{e}]" for n in ("down", "flipped") for e in range(E)} | {"dense"}
        ref_counts = list(ref.selection_counts().values())
        assert sorted(counts.values()) == sorted(ref_counts)
        assert all(r + c == STEPS for r, c in counts.values())


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", MATRIX_OPTIMIZERS)
def test_split_fused_and_conv1d_equal_their_unfused_twins(name, foreach):
    """A fused ``qkv`` with GQA sizes split (q, k, v) equals three separate projections; a GPT-2
    ``Conv1D`` weight ``(in, out)`` viewed transposed, and split in three, equals the ``nn.Linear``
    weights ``(out, in)`` of its blocks."""
    d, q, kv = 8, 8, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(q + 2 * kv, d, generator=g)
    conv = torch.randn(d, 3 * d, generator=g)  # Conv1D: (in, out)
    fused = [nn.Parameter(qkv.clone()), nn.Parameter(conv.clone())]
    groups = [{"params": fused, "kind": "hidden", "views": ["matrix", "transposed"],
               "splits": [(q, kv, kv), (d, d, d)]}]
    shapes = [tuple(qkv.shape), tuple(conv.shape)]
    cuts = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    thirds = [(0, d), (d, 2 * d), (2 * d, 3 * d)]
    separate = ([nn.Parameter(qkv[a:b].clone()) for a, b in cuts]
                + [nn.Parameter(conv[:, a:b].T.clone()) for a, b in thirds])

    def separate_grads(step):
        gq, gc = _grads(shapes, step)
        return [gq[a:b] for a, b in cuts] + [gc[:, a:b].T.contiguous() for a, b in thirds]

    _run(name, foreach, fused, groups, lambda step: _grads(shapes, step))
    _run(name, foreach, separate, [{"params": separate, "kind": "hidden"}], separate_grads)
    got = [fused[0][a:b] for a, b in cuts] + [fused[1][:, a:b].T for a, b in thirds]
    inits = [qkv[a:b] for a, b in cuts] + [conv[:, a:b].T for a, b in thirds]
    for a, b, init in zip(got, separate, inits, strict=True):
        _close(a.detach(), b.detach(), init)


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", ["meqmuon", "scale"])
def test_learned_token_table_equals_2d_embedding(name, foreach):
    """ViT's ``position_embeddings`` ``(1, N, d)``, stacked, is updated as the ``(N, d)`` embedding."""
    table = torch.randn(1, 10, 6, generator=torch.Generator().manual_seed(2))
    stacked, flat = nn.Parameter(table.clone()), nn.Parameter(table[0].clone())
    _run(name, foreach, [stacked], [{"params": [stacked], "kind": "embedding", "views": "stacked"}],
         lambda step: _grads([(1, 10, 6)], step))
    _run(name, foreach, [flat], [{"params": [flat], "kind": "embedding"}],
         lambda step: [_grads([(1, 10, 6)], step)[0][0]])
    _close(stacked.detach()[0], flat.detach(), table[0])


def _folded_and_twins(E=3, f=5, d=8):
    """DBRX's experts ``w1``, ``v1``, ``w2`` folded into ``(E * f, d)`` tensors (``w2`` used per expert as
    ``x @ w2[e]``: stored ``(in, out)``), and their per-expert ``nn.Linear`` weights ``(out, in)``."""
    g = torch.Generator().manual_seed(4)
    w1, v1, w2 = (torch.randn(E * f, d, generator=g) for _ in range(3))
    folded = [nn.Parameter(t.clone()) for t in (w1, v1, w2)]
    groups = [{"params": folded, "kind": "hidden", "names": ["w1", "v1", "w2"], "folds": E,
               "views": ["stacked", "stacked", "stacked-transposed"]}]
    rows = [slice(e * f, (e + 1) * f) for e in range(E)]
    twins = ([nn.Parameter(w1[r].clone()) for r in rows] + [nn.Parameter(v1[r].clone()) for r in rows]
             + [nn.Parameter(w2[r].T.clone()) for r in rows])

    def as_twins(ts):  # the per-expert (out, in) matrices of the three folded tensors
        return [ts[0][r] for r in rows] + [ts[1][r] for r in rows] + [ts[2][r].T for r in rows]
    return folded, groups, twins, as_twins


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", MATRIX_OPTIMIZERS)
def test_folded_experts_equal_per_expert_linears(name, foreach):
    """DBRX-style ``(E * f, d)`` experts (``folds=E``, either orientation) equal separate per-expert
    ``nn.Linear`` weights to 1e-5, and expert 0's update moves by < 1e-6 (relative) when only expert
    1's gradient changes."""
    folded, groups, twins, as_twins = _folded_and_twins()
    shapes = [tuple(p.shape) for p in folded]
    inits = [t.detach().clone() for t in as_twins([p.detach() for p in folded])]
    opt = _run(name, foreach, folded, groups, lambda step: _grads(shapes, step))
    _run(name, foreach, twins, [{"params": twins, "kind": "hidden"}],
         lambda step: [g.contiguous() for g in as_twins(_grads(shapes, step))])
    for a, b, init in zip(as_twins([p.detach() for p in folded]), twins, inits, strict=True):
        _close(a, b.detach(), init)
    if meqmuon.rules_of(name)["hidden"] == "meq_hidden":  # eq. 8's choice counts (not meqmuon-shape's)
        assert set(opt.selection_counts()) == {f"{n}[{e}]" for n in ("w1", "v1", "w2") for e in range(3)}

    def expert0_update(bump):
        ps, gs, _, _ = _folded_and_twins()
        start = [p.detach().clone() for p in ps]

        def grads(step):
            out = _grads(shapes, step)
            for t in out:
                t[5:10] *= bump  # expert 1's rows only
            return out
        _run(name, foreach, ps, gs, grads)
        return torch.cat([(p.detach() - s)[:5].reshape(-1) for p, s in zip(ps, start, strict=True)])
    base, other = expert0_update(1.0), expert0_update(-3.0)
    assert ((base - other).norm() / base.norm()).item() < 1e-6


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", [n for n in having("per-tensor", "batched")])
def test_per_expert_bias_table_equals_separate_vectors(name, foreach):
    """GPT-OSS's per-expert biases ``(E, k)`` (view ``"vectors"``) equal ``E`` separate 1-D parameters
    under every optimizer's vector rule (MeqMuon: eq. 10's RMS per expert; AdamW: elementwise), and
    expert 0's bias moves by < 1e-6 (relative) when only expert 1's gradient changes."""
    E, k = 4, 6
    table = torch.randn(E, k, generator=torch.Generator().manual_seed(5))

    def run(bump=1.0):
        stacked = nn.Parameter(table.clone())
        rows = [nn.Parameter(r.clone()) for r in table]

        def grads(step):
            (gt,) = _grads([(E, k)], step)
            gt[1] *= bump
            return gt
        _run(name, foreach, [stacked], [{"params": [stacked], "kind": "vector", "views": "vectors"}],
             lambda step: [grads(step)])
        _run(name, foreach, rows, [{"params": rows, "kind": "vector"}], lambda step: list(grads(step).unbind(0)))
        return stacked.detach(), torch.stack([r.detach() for r in rows])
    got, ref = run()
    _close(got, ref, table)
    other, _ = run(-3.0)
    assert ((other[0] - got[0]).norm() / (got[0] - table[0]).norm()).item() < 1e-6


def test_vectors_view_needs_a_vector_rule():
    p = nn.Parameter(torch.randn(4, 6))
    with pytest.raises(ValueError, match="view 'vectors' in a 'hidden' group"):
        meqmuon.MeqMuon([{"params": [p], "kind": "hidden", "names": ["b"], "views": "vectors"}])
    for extra, message in (({"views": "matrix", "folds": 2}, "folds=2 needs a 2-D"),
                           ({"views": "stacked", "folds": 3}, "folds=3 needs a 2-D")):
        with pytest.raises(ValueError, match=message):
            meqmuon.MeqMuon([{"params": [p], "kind": "hidden", "names": ["w"], **extra}])


class _Experts(nn.Module):
    """transformers 5's expert storage: ``gate_up_proj`` ``(E, 2I, d)``, ``down_proj`` ``(E, d, I)``."""

    def __init__(self, E=4, d=8, inner=6, transposed=False):
        super().__init__()
        up, down = ((E, d, 2 * inner), (E, inner, d)) if transposed else ((E, 2 * inner, d), (E, d, inner))
        self.gate_up_proj = nn.Parameter(torch.randn(up) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(down) * 0.1)


class MixtralExperts(_Experts):
    pass


class GptOssExperts(_Experts):
    def __init__(self):
        super().__init__(transposed=True)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.embed = nn.Embedding(20, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.position_embeddings = nn.Parameter(torch.randn(1, 5, 8))
        self.conv = nn.Conv2d(3, 8, 2)
        self.experts = MixtralExperts()
        self.oss = GptOssExperts()
        self.bank = nn.Parameter(torch.randn(2, 3, 8, 8))  # a custom stack of matrices
        self.c_fc = Conv1D(16, 8)
        self.gate = nn.Linear(8, 1, bias=False)  # a 1-row matrix
        self.query_key_value = nn.Linear(8, 24)  # a fused name whose layout is not read
        self.lm_head = nn.Linear(8, 20, bias=False)


def _routing(groups):
    return {n: (g["kind"], v, s) for g in groups for n, v, s in zip(g["names"], g["views"], g["splits"], strict=True)}


def test_param_groups_declares_views_from_modules():
    model = _Model()
    groups = meqmuon.param_groups(model)
    r = _routing(groups)
    assert r["embed.weight"] == ("embedding", "matrix", None)
    assert r["cls_token"] == ("vector", "matrix", None)  # (1, 1, d): a vector, not sign-SGD
    assert r["position_embeddings"] == ("embedding", "stacked", None)
    assert r["conv.weight"] == ("hidden", "matrix", None)
    assert r["experts.gate_up_proj"] == ("hidden", "stacked", (6, 6))
    assert r["experts.down_proj"] == ("hidden", "stacked", None)
    assert r["oss.gate_up_proj"] == ("hidden", "stacked-transposed", None)  # may interleave: whole
    assert r["oss.down_proj"] == ("hidden", "stacked-transposed", None)
    assert r["bank"] == ("hidden", "stacked", None)
    assert r["c_fc.weight"] == ("hidden", "transposed", None)
    assert r["gate.weight"] == ("vector", "matrix", None)
    assert r["query_key_value.weight"] == ("hidden", "matrix", None)
    assert r["lm_head.weight"] == ("head", "matrix", None)
    assert len(r) == len(list(model.parameters()))
    text = meqmuon.describe_groups(groups)
    assert "experts.gate_up_proj (4, 12, 8) -> 4 x 12x8, split 2 (6, 6)" in text
    assert "c_fc.weight (8, 16) Conv1D -> 16x8" in text
    assert "bank (2, 3, 8, 8) -> 2 x 3 x 8x8" in text
    assert "oss.gate_up_proj (4, 8, 12) stored (in, out) -> 4 x 12x8" in text
    assert "query_key_value.weight: fused layout of _Model not read: kept whole" in text
    assert "no recognised output head" not in text
    assert all(s is None for g in meqmuon.param_groups(model, split_fused=False) for s in g["splits"])


def test_describe_groups_warns_about_a_missing_head():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    assert "no recognised output head" in meqmuon.describe_groups(meqmuon.param_groups(model))


def test_meqmuon_on_1_row_matrices_is_not_a_sign_update():
    """Routed as vectors, a ``(1, d)`` gate and a ``(1, 1, d)`` token move by ``rho lr B/RMS(B)``, whose
    entries differ in size; through the hidden rule (the old routing) every entry moved by +-rho lr."""
    model = _Model()
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, weight_decay=0.0).step()
    for n in ("gate.weight", "cls_token"):
        step = (dict(model.named_parameters())[n].detach() - before[n]).abs()
        assert step.max() > 1.5 * step.min(), n  # not a constant magnitude
        assert torch.allclose(step.square().mean().sqrt(), torch.tensor(0.2 * 1e-2), rtol=1e-4)


def test_group_overrides_and_bad_views_are_clear_errors():
    p = nn.Parameter(torch.randn(3, 4, 5))
    opt = meqmuon.MeqMuon([{"params": [p], "kind": "hidden", "views": "matrix", "splits": None}])
    assert opt.param_groups[0]["views"] == ["matrix"] and opt.param_groups[0]["splits"] == [None]
    bad = [
        ({"views": ["diagonal"]}, "unknown matrix view 'diagonal'"),
        ({"views": ["transposed"]}, "needs a 2-D (in, out) weight"),
        ({"views": ["stacked"], "splits": [(2, 3)]}, "must be positive integers adding up to the matrix's 4 rows"),
        ({"views": ["stacked", "matrix"]}, "one entry per parameter"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            meqmuon.MeqMuon([{"params": [p], "kind": "hidden", "names": ["w"], **extra}])
    with pytest.raises(ValueError, match="w: view 'stacked' needs a >=3-D"):
        meqmuon.Muon([{"params": [nn.Parameter(torch.randn(4, 5))], "kind": "hidden", "names": ["w"],
                       "views": "stacked"}])


def test_one_matrix_of_a_stack_keeps_its_transposition_and_split():
    """``Layout.one``: one expert of a stack seen as a parameter of its own shape (the exchange's unit of one expert,
    ``placement.by_matrix``) cuts into the same matrices as the stack's view cuts that expert."""
    x = torch.randn(3, 8, 6)
    cases = [("stacked", None, False), ("stacked-transposed", None, False), ("stacked", (3, 5), False),
             ("stacked-transposed", (3, 3), True)]
    for view, split, inter in cases:
        stack = layout_of(x.shape, view, split, interleaved=inter)
        one = stack.one()
        assert (one is None) == (view == "stacked" and split is None), (view, split)
        per = one.matrices(x[1]) if one is not None else [x[1]]
        expected = stack.matrices(x)[len(per) : 2 * len(per)]
        assert len(per) == len(expected) and all(torch.equal(a, b) for a, b in zip(per, expected, strict=True))
        assert (one.shapes() if one is not None else [tuple(x.shape[1:])]) == stack.shapes()[: len(per)]


@pytest.mark.parametrize("name", ["meqmuon", "normuon"])
def test_state_is_one_tensor_per_parameter_and_round_trips(name):
    model = _Model()
    groups = meqmuon.param_groups(model)
    opt = meqmuon.build_optimizer(name, groups, lr=1e-2)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
    st = opt.state[model.experts.gate_up_proj]
    assert st["momentum_buffer"].shape == (4, 12, 8)
    if name == "meqmuon":
        assert st["rows_chosen"].shape == (4, 2)  # one count per expert and block
        assert len(opt.selection_counts()) > len(list(model.parameters()))
    else:
        assert st["second_moment"].shape == (4, 12)  # one per row of every expert
        assert opt.state[model.c_fc.weight]["second_moment"].shape == (16,)  # Conv1D: output rows
    measured = meqmuon.optimizer_state_bytes(opt)
    assert meqmuon.predicted_state_elements(meqmuon.rules_of(name), groups) * 4 == measured
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    clone = _Model()
    clone.load_state_dict(model.state_dict())
    opt2 = meqmuon.build_optimizer(name, meqmuon.param_groups(clone), lr=1e-2)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["splits"] == opt.param_groups[0]["splits"]
    if name == "meqmuon":  # torch casts state to the parameter's dtype on load; counters stay integers
        assert opt2.state[clone.experts.gate_up_proj]["rows_chosen"].dtype == torch.int64
        assert opt2.selection_counts() == opt.selection_counts()
    for m, o in ((model, opt), (clone, opt2)):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(9))
        o.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_exists_for_parameters_without_gradients():
    """Every parameter of the optimizer has its state after the first step, gradient or not, so that
    ranks whose experts got no tokens hold the same state keys (microsoft/dion#89)."""
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(2, 4, 4))
    opt = meqmuon.MeqMuon([{"params": [a, b], "kind": "hidden", "views": ["matrix", "stacked"]}])
    a.grad = torch.randn(4, 4)
    before = b.detach().clone()
    opt.step()
    assert opt.state[b]["step"] == 0 and opt.state[b]["momentum_buffer"].shape == (2, 4, 4)
    assert torch.equal(b, before)  # no gradient: not updated, as in torch.optim
    assert opt.state[a]["step"] == 1


@pytest.mark.parametrize("name", having("batched", check="op-count"))
def test_batched_op_count_is_flat_in_the_number_of_experts(name):
    """On the meta device (shapes only), 16 experts dispatch <= 1.05x the ops of 4."""
    counts = []
    for experts in (4, 16):
        shapes, views = mixtral_shapes(experts, d=64, inner=96, vocab=256)
        counts.append(count_step_ops(name, shapes, True, views).total)
    four, sixteen = counts
    assert sixteen <= 1.05 * four, (four, sixteen)


def test_layout_shapes_and_labels():
    lay = layout_of((2, 12, 8), "stacked", (4, 8))
    assert lay.shapes() == [(4, 8), (8, 8), (4, 8), (8, 8)]
    assert lay.labels() == ["[0]#0", "[0]#1", "[1]#0", "[1]#1"]
    assert lay.counter_shape == (2, 2) and lay.rows_shape == (2, 12)
    t = torch.arange(2 * 12 * 8.0).reshape(2, 12, 8)
    mats = lay.matrices(t)
    assert all(m.data_ptr() >= t.data_ptr() for m in mats)  # views, not copies
    mats[3].zero_()
    assert t[1, 4:].abs().sum() == 0


def test_fused_layouts_read_outside_the_zoo():
    """MLA's ``kv_a_proj_with_mqa`` (DeepSeek V3: ``split([kv_lora_rank, qk_rope_head_dim])``), Jamba's
    Mamba ``in_proj`` (halves) and ``x_proj`` (dt, B, C) with its ``A_log`` a vector, JetMoE's GLU
    experts' ``input_linear`` and ``kv_proj`` (halves; its attention experts' ``input_linear`` is one
    block), and ``nn.MultiheadAttention``'s ``in_proj_weight`` (q, k, v) are read from the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    deepseek = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=0, max_position_embeddings=64))
    r = _routing(meqmuon.param_groups(deepseek))
    assert r["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ("hidden", "matrix", (16, 8))
    jamba = transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False))
    groups = meqmuon.param_groups(jamba)
    r = _routing(groups)
    assert r["model.layers.0.mamba.in_proj.weight"] == ("hidden", "matrix", (64, 64))
    assert r["model.layers.0.mamba.x_proj.weight"] == ("hidden", "matrix", (4, 8, 8))
    assert r["model.layers.0.mamba.A_log"] == ("vector", "matrix", None)  # (64, 8): decays, not a map
    assert "Fused tensors kept whole" not in meqmuon.describe_groups(groups)
    jetmoe = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2, kv_channels=8,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    groups = meqmuon.param_groups(jetmoe)
    r = _routing(groups)
    assert r["model.layers.0.mlp.input_linear.weight"] == ("hidden", "stacked", (48, 48))  # GLU experts
    assert r["model.layers.0.self_attention.experts.input_linear.weight"] == ("hidden", "stacked", None)  # MoA
    assert r["model.layers.0.self_attention.kv_proj.weight"] == ("hidden", "matrix", (16, 16))
    assert "Fused tensors kept whole" not in meqmuon.describe_groups(groups)
    mha = nn.Module()
    mha.attn = nn.MultiheadAttention(12, 3)
    assert _routing(meqmuon.param_groups(mha))["attn.in_proj_weight"] == ("hidden", "matrix", (12, 12, 12))


def test_kinds_override_and_split_fused_false_are_listed():
    """``param_groups(kinds=...)`` routes a tensor to another kind (a bias table moved out of the
    vector kind is one matrix again); ``split_fused=False`` keeps readable blocks whole and says so."""
    model = _Model()
    model.oss.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 12))
    r = _routing(meqmuon.param_groups(model))
    assert r["oss.gate_up_proj_bias"] == ("vector", "vectors", None)
    r = _routing(meqmuon.param_groups(model, kinds={r"_bias$": "hidden", r"^conv\.weight$": "embedding"}))
    assert r["oss.gate_up_proj_bias"] == ("hidden", "matrix", None)
    assert r["conv.weight"] == ("embedding", "matrix", None)
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        meqmuon.param_groups(model, kinds={"nothing": "hidden"})
    with pytest.raises(ValueError, match="is not one of"):
        meqmuon.param_groups(model, kinds={"conv": "matrix"})
    text = meqmuon.describe_groups(meqmuon.param_groups(model, split_fused=False))
    assert "- experts.gate_up_proj: blocks (6, 6) read from the model; kept whole (split_fused=False)" in text


@pytest.mark.parametrize("foreach", FORMS)
@pytest.mark.parametrize("name", MATRIX_OPTIMIZERS)
def test_interleaved_split_equals_gate_and_up_twins(name, foreach):
    """GPT-OSS's experts ``(E, d, 2I)`` stored ``(in, out)`` with gate and up in alternate output
    features (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``): an interleaved split equals separate
    per-expert gate and up ``nn.Linear`` weights."""
    E, d, inner = 3, 8, 5
    w = torch.randn(E, d, 2 * inner, generator=torch.Generator().manual_seed(6))
    p = nn.Parameter(w.clone())
    group = {"params": [p], "kind": "hidden", "names": ["gate_up"], "views": "stacked-transposed",
             "splits": [(inner, inner)], "interleaved": True}

    def twins_of(t):
        return [h for m in t.unbind(0) for h in (m.T[0::2], m.T[1::2])]
    twins = [nn.Parameter(b.clone()) for b in twins_of(w)]
    _run(name, foreach, [p], [group], lambda step: _grads([(E, d, 2 * inner)], step))
    _run(name, foreach, twins, [{"params": twins, "kind": "hidden"}],
         lambda step: [b.contiguous() for b in twins_of(_grads([(E, d, 2 * inner)], step)[0])])
    for a, b, init in zip(twins_of(p.detach()), twins, twins_of(w), strict=True):
        _close(a, b.detach(), init)


def test_interleaved_layout_is_strided_views():
    lay = layout_of((6, 4), "matrix", (3, 3), interleaved=True)
    t = torch.arange(24.0).reshape(6, 4)
    even, odd = lay.matrices(t)
    assert torch.equal(even, t[0::2]) and torch.equal(odd, t[1::2])
    odd.zero_()
    assert t[1::2].abs().sum() == 0 and t[0::2].abs().sum() > 0
    with pytest.raises(ValueError, match="interleaved split needs equal blocks"):
        layout_of((6, 4), "matrix", (2, 4), interleaved=True)
