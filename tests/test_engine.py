"""The named optimizers against the float64 references of references.py (paper and upstream code).

Each reference there is a direct transcription of one update rule (paper Algorithm 1 / eq. 2-11;
Moonlight toy_train.py; NorMuon normuon.py; SCALE scale_optimizer.py, see baselines.md), written
per parameter with plain loops. The optimizers run in float64 with float64 Newton-Schulz, so the
only differences are rounding: tolerance 1e-10 after several steps.
"""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from capabilities import ALL, CAPABILITIES, ENGINE, WITH_MEQ_RULES
from references import MUONEQ_MODE, RefOptimizer, kinds_of
from tinynet import batches, loss_fn, make_model, train
from torch import nn

import meqmuon

# Every step form of every meqmuon optimizer, with and without Nesterov where it has the option (SCALE's
# head momentum is a plain EMA, so it runs once).
CASES = [pytest.param(n, nest, form == "batched", id=f"{n}-{nest}-{form}")
         for n, c in CAPABILITIES.items() for nest in ((True, False) if c.nesterov else (True,))
         for form in ("per-tensor", "batched") if form in c.forms]


@pytest.mark.parametrize("name, nesterov, foreach", CASES)
def test_matches_float64_reference(name, nesterov, foreach):
    """Per-tensor and batched (foreach) steps both equal the float64 transcription; in the batched
    step TinyNet's down (12 x 36) and conv view ride transposed in the up (36 x 12) bucket."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    kw = dict(lr=0.03, weight_decay=0.1, foreach=foreach)
    if name != "scale":
        kw.update(ns_dtype=torch.float64, nesterov=nesterov)
    opt = meqmuon.build_optimizer(name, model, **kw)
    ref = RefOptimizer(kinds_of(ref_model), meqmuon.rules_of(name), lr=0.03, nesterov=nesterov,
                       eq_mode=MUONEQ_MODE.get(name))
    for ids in batches(4):
        for m in (model, ref_model):
            m.zero_grad()
            loss_fn(m, ids).backward()
        opt.step()
        ref.step()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-10, rtol=0), n
    if CAPABILITIES[name].rules["hidden"] == "meq_hidden":  # MeqMuon's row/column choices, too
        counts = opt.selection_counts()
        names = dict(ref_model.named_parameters())
        for pname, (rows, cols) in counts.items():
            assert rows + cols == 4
            assert rows == ref.rows_chosen[id(names[pname])], pname


def test_rule_tables():
    assert meqmuon.rules_of("meqmuon") == {
        "hidden": "meq_hidden",
        "embedding": "equilibrate",
        "head": "equilibrate",
        "vector": "rms_normalize",
    }
    muon = meqmuon.rules_of("muon")
    for ablation, kinds in [
        ("meqmuon-only-hidden", {"hidden"}),
        ("meqmuon-only-embedding", {"embedding", "head"}),
        ("meqmuon-only-vector", {"vector"}),
    ]:
        table = meqmuon.rules_of(ablation)
        assert {k for k in table if table[k] != muon[k]} == kinds
        for k in kinds:
            assert table[k] == meqmuon.rules_of("meqmuon")[k]


# ---- Muon parity with torch.optim.Muon + torch.optim.AdamW -------------------------------------


class SmallTransformer(nn.Module):
    def __init__(self, vocab=40, d=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        # bias=False: an attention key bias has an exactly-zero true gradient (softmax is invariant
        # to it), so AdamW would amplify pure rounding noise there and no parity test could pass.
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.lm_head(self.norm(self.blocks(self.embed_tokens(ids), mask=mask, is_causal=True)))


def test_muon_parity_with_torch_muon_and_adamw(monkeypatch):
    """Moonlight-form Muon == torch.optim.Muon(match_rms_adamw) + torch.optim.AdamW((0.9, 0.95)).

    torch's Newton-Schulz always runs in bf16, whose rounding noise is about a third of one step
    (6.6e-4 to 7.5e-4 against float32 NS at lr 1e-2), so both sides run NS in float32 here: torch's
    function is patched to compute in float32 and ours gets ns_dtype=float32. Tolerance 2e-6 after 6 steps.
    """
    import torch.optim._muon as tm

    original = tm._zeropower_via_newtonschulz

    def ns_fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        X = grad.float()
        if grad.size(0) > grad.size(1):
            X = X.T
        X = X / X.norm().clamp(min=eps)
        for _ in range(ns_steps):
            G = X @ X.T
            X = torch.addmm(X, torch.addmm(G, G, G, beta=b, alpha=c), X, beta=a)
        return X.T if grad.size(0) > grad.size(1) else X

    monkeypatch.setattr(tm, "_zeropower_via_newtonschulz", ns_fp32)
    assert tm._zeropower_via_newtonschulz is not original

    torch.manual_seed(0)
    ours_model = SmallTransformer()
    torch_model = copy.deepcopy(ours_model)
    initial = copy.deepcopy(ours_model)
    # split_fused=False: torch.optim.Muon orthogonalises nn.MultiheadAttention's in_proj_weight whole,
    # where param_groups would split it into q, k, v.
    ours = meqmuon.Muon(meqmuon.param_groups(ours_model, split_fused=False), lr=2e-2, weight_decay=0.1,
                        ns_dtype=torch.float32)
    groups = meqmuon.param_groups(torch_model, split_fused=False)
    hidden = [p for g in groups if g["kind"] == "hidden" for p in g["params"]]
    rest = [p for g in groups if g["kind"] != "hidden" for p in g["params"]]
    assert all(p.ndim == 2 for p in hidden) and len(hidden) == 8
    t_muon = torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    t_adamw = torch.optim.AdamW(rest, lr=2e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        ids = torch.randint(0, 40, (4, 10), generator=g)
        for m in (ours_model, torch_model):
            m.zero_grad()
            loss_fn(m, ids).backward()
        ours.step()
        t_muon.step()
        t_adamw.step()
    worst = max(
        (p - q).abs().max().item() for p, q in zip(ours_model.parameters(), torch_model.parameters(), strict=True)
    )
    moved = max((p - q).abs().max().item() for p, q in zip(ours_model.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-2  # the parameters really moved
    assert worst < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_muon_adamw_part_equals_torch_adamw_bit_for_bit(dtype):
    """The AdamW rule (Muon's embedding/head/vectors) runs torch.optim.AdamW's single-tensor
    arithmetic in the same order (its CPU default), so the two agree bit for bit, weight decay on,
    also for bf16 parameters (whose decay factor a ``_foreach_mul_`` would round to bf16)."""
    g = torch.Generator().manual_seed(11)
    shapes = [(40, 16), (40, 16), (16,), (7,)]
    ours_params = [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    torch_params = [nn.Parameter(p.detach().clone()) for p in ours_params]
    kinds = ["embedding", "head", "vector", "vector"]
    ours = meqmuon.Muon(
        [{"params": [p], "kind": k} for p, k in zip(ours_params, kinds, strict=True)],
        lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
    )
    ref = torch.optim.AdamW(torch_params, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(5):
        for p, q in zip(ours_params, torch_params, strict=True):
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q, s in zip(ours_params, torch_params, shapes, strict=True):
        assert torch.equal(p, q), (s, (p - q).abs().max().item())
        assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_meqmuon_updates_a_non_contiguous_conv_kernel_in_place():
    """A 3-D hidden parameter whose storage is not contiguous (no matrix view) gets the same update
    as a contiguous copy of it, in place (the fast path updates through a view; this one cannot)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
    strided = nn.Parameter(base.transpose(1, 2).contiguous().transpose(1, 2))  # shape (6, 5, 4), not contiguous
    dense = nn.Parameter(base.clone())
    assert not strided.is_contiguous() and dense.is_contiguous()
    storage = strided.data_ptr()
    opts = [
        meqmuon.MeqMuon([{"params": [p], "kind": "hidden"}], lr=0.05, ns_dtype=torch.float64) for p in (strided, dense)
    ]
    for _ in range(3):
        grad = torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
        for p, opt in zip((strided, dense), opts, strict=True):
            p.grad = grad.clone()
            opt.step()
    assert strided.data_ptr() == storage and not strided.is_contiguous()
    assert torch.allclose(strided, dense, rtol=0, atol=1e-12)
    assert (dense - base).abs().max() > 1e-2


# ---- behaviour -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WITH_MEQ_RULES)
def test_meqmuon_step_rms_is_rho_lr(name):
    """Every MeqMuon-normalised kind moves by exactly rho*lr in RMS (weight decay off)."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = meqmuon.build_optimizer(name, model, lr=0.05, weight_decay=0.0, ns_dtype=torch.float64)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    meq = {k for k, r in meqmuon.rules_of(name).items() if r in ("meq_hidden", "equilibrate", "rms_normalize")}
    checked = 0
    for g in meqmuon.param_groups(model):
        if g["kind"] not in meq:
            continue
        for n, p in zip(g["names"], g["params"], strict=True):
            # Rows of absent tokens stay zero; columns are normalised over all rows (eq. 4 divides
            # by sqrt(m)), so the whole-matrix RMS is still exactly 1.
            delta = p.detach() - before[n]
            assert delta.square().mean().sqrt().item() == pytest.approx(0.2 * 0.05, rel=1e-9), n
            checked += 1
    assert checked > 0


def test_zero_gradients_and_tiny_values_are_finite():
    model = make_model(dtype=torch.float32)
    for name in ALL:
        opt = meqmuon.build_optimizer(name, model, lr=1e-2)
        for scale in (0.0, 1e-30, 1e-12):
            for p in model.parameters():
                p.grad = torch.full_like(p, scale)
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), name


def test_zero_rows_stay_zero_in_embedding_update():
    model = make_model()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=0.1, weight_decay=0.0, ns_dtype=torch.float64)
    before = model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[1, 2, 3, 4]])
    loss_fn(model, ids).backward()
    opt.step()
    changed = (model.embed_tokens.weight - before).abs().sum(1) > 0
    assert changed.nonzero().flatten().tolist() == [1, 2, 3, 4]


def test_selection_follows_geometry():
    """A tall matrix's NS output has near-equal columns, so MeqMuon normalises rows; wide: columns."""
    tall = nn.Parameter(torch.zeros(64, 16))
    wide = nn.Parameter(torch.zeros(16, 64))
    opt = meqmuon.MeqMuon([{"params": [tall, wide], "names": ["tall", "wide"], "kind": "hidden"}], lr=0.1)
    for s in range(5):
        g = torch.Generator().manual_seed(s)
        tall.grad = torch.randn(64, 16, generator=g) * torch.linspace(0.1, 3, 64)[:, None]
        wide.grad = tall.grad.T.contiguous()
        opt.step()
    assert opt.selection_counts() == {"tall": (5, 0), "wide": (0, 5)}


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_is_bit_exact(name):
    """k steps, save, load into a fresh optimizer and model copy, k more == 2k uninterrupted."""
    data = batches(6, seed=11)

    straight = make_model(dtype=torch.float32)
    train(straight, meqmuon.build_optimizer(name, straight, lr=1e-2), data)

    first = make_model(dtype=torch.float32)
    opt = meqmuon.build_optimizer(name, first, lr=1e-2)
    train(first, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = make_model(dtype=torch.float32, seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt2 = meqmuon.build_optimizer(name, resumed, lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    train(resumed, opt2, data[3:])
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    if hasattr(opt2, "selection_counts") and CAPABILITIES[name].rules["hidden"] == "meq_hidden":
        assert sum(r + c for r, c in opt2.selection_counts().values()) == 6 * 5  # 5 hidden tensors


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_steps_like_the_original(name, how):
    """``copy.deepcopy`` / pickling of (model, optimizer) mid-run: both go on to the same bits.

    torch's ``Optimizer.__getstate__`` keeps only defaults, state and param groups; the engine's own
    settings (``compile``) must survive too, or the copy fails at its first step."""
    data = batches(6, seed=5)

    model = make_model(dtype=torch.float32)
    opt = meqmuon.build_optimizer(name, model, lr=1e-2)
    train(model, opt, data[:3])
    both = {"model": model, "opt": opt}
    copied = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    train(model, opt, data[3:])
    train(copied["model"], copied["opt"], data[3:])
    for (n, p), q in zip(model.named_parameters(), copied["model"].parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not any(p is q for p, q in zip(model.parameters(), copied["model"].parameters(), strict=True))


def test_copy_keeps_compile_and_refuses_an_explicit_process_group():
    model = make_model(dtype=torch.float32)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, compile=True)
    assert copy.deepcopy(opt)._compile is True
    assert pickle.loads(pickle.dumps(opt))._compile is True
    # A process group cannot be pickled: an optimizer bound to an explicit one says so instead of
    # coming back bound to the default group.
    bound = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, process_group=object())
    with pytest.raises(RuntimeError, match="explicit process_group"):
        copy.deepcopy(bound)


@pytest.mark.parametrize("foreach", [False, True])
def test_step_makes_no_host_device_sync(monkeypatch, foreach):
    """Any Python read of a tensor value (item, bool, float, int, tolist) inside step() fails the test,
    on the per-tensor and on the batched (foreach) step."""
    model = make_model(dtype=torch.float32)
    opts = [meqmuon.build_optimizer(n, model, lr=1e-2, foreach=foreach) for n in ENGINE]
    loss_fn(model, batches(1)[0]).backward()

    def forbidden(*a, **k):
        raise AssertionError("host-device synchronisation in step()")

    for attr in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, attr, forbidden)
    for opt in opts:
        opt.step()
        opt.step()
    monkeypatch.undo()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_inside_torch_compile_runs_eagerly_without_recompiles():
    """A compiled function that calls ``opt.step()``: the step is not traced (it recompiled at every
    step when it was: the step count and lr are Python numbers), runs exactly the eager step, and
    says so once."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_model = make_model(dtype=torch.float32)
    compiled_model = copy.deepcopy(eager_model)
    eager = meqmuon.MeqMuon(meqmuon.param_groups(eager_model), lr=1e-2)
    inside = meqmuon.MeqMuon(meqmuon.param_groups(compiled_model), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)) for o in (eager, inside)]
    compiled_step = torch.compile(lambda: inside.step())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in batches(5, seed=2):
            for model in (eager_model, compiled_model):
                model.zero_grad()
                loss_fn(model, ids).backward()
            eager.step()
            compiled_step()
            for sched in schedules:
                sched.step()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs <= 1  # at most the empty graph before the break; none per step or per lr
    assert sum("inside torch.compile" in str(w.message) for w in caught) == 1
    for (n, p), q in zip(eager_model.named_parameters(), compiled_model.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    "param_dtype, direction_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_apply_update_with_mixed_dtypes_equals_torch_promotion(param_dtype, direction_dtype):
    """A bf16 direction is cast into a float32 buffer before the add (no fresh temporary); the
    result must be ``p.add_(d)``'s type promotion bit for bit, also when the parameter is the
    narrower one (then nothing may be cast down before the add)."""
    from meqmuon.optim.step import Item, apply_update

    g = torch.Generator().manual_seed(4)
    p = torch.randn(48, 40, generator=g).to(param_dtype)
    d = torch.randn(48, 40, generator=g).to(direction_dtype)
    expected = p.clone().mul_(1 - 0.03 * 0.1).add_(d, alpha=-0.03 * 0.7)
    scratch: dict = {}
    apply_update([Item(p, d, {}, "w")], [d], [0.7], {"lr": 0.03, "weight_decay": 0.1}, scratch)
    assert torch.equal(p, expected)
    assert bool(scratch) == (direction_dtype == torch.bfloat16)  # the buffer is used only to widen


def test_state_dtype_follows_parameter_unless_configured():
    model = make_model(dtype=torch.bfloat16)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    assert {s["momentum_buffer"].dtype for s in opt.state.values()} == {torch.bfloat16}
    opt32 = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, state_dtype=torch.float32)
    opt32.step()
    assert {s["momentum_buffer"].dtype for s in opt32.state.values()} == {torch.float32}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_lr_scheduler_and_compiled_model():
    model = make_model(dtype=torch.float32)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    compiled = torch.compile(model)
    losses = []
    for ids in batches(4):
        opt.zero_grad()
        loss = loss_fn(compiled, ids)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    assert all(math.isfinite(x) for x in losses)


def test_groups_without_kind_are_inferred_with_a_warning():
    model = make_model(dtype=torch.float32)
    with pytest.warns(UserWarning, match="param_groups"):
        opt = meqmuon.MeqMuon(model.parameters(), lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    opt.step()
    st = opt.state[model.q.weight]
    assert "rows_chosen" in st  # 2-D -> hidden rule
    assert "rows_chosen" not in opt.state[model.norm.weight]


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(rho=0.0), "rho"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(nesterov="yes"), "nesterov"),
        (dict(lr=float("nan")), "lr"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(kwargs, match):
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        meqmuon.MeqMuon(meqmuon.param_groups(model), **kwargs)


def test_invalid_betas_and_beta2():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="betas"):
        meqmuon.Muon(meqmuon.param_groups(model), betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="beta2"):
        meqmuon.NorMuon(meqmuon.param_groups(model), beta2=1.0)


def test_bad_kinds_complex_and_sparse():
    w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="kind"):
        meqmuon.MeqMuon([{"params": [w], "kind": "bias"}])
    with pytest.raises(ValueError, match=r"needs a >=2-D tensor"):
        meqmuon.MeqMuon([{"params": [nn.Parameter(torch.zeros(3))], "kind": "hidden", "names": ["b"]}])
    with pytest.raises(ValueError, match="complex"):
        meqmuon.MeqMuon([{"params": [nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))], "kind": "hidden"}])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = meqmuon.MeqMuon([{"params": list(emb.parameters()), "kind": "embedding", "names": ["emb.weight"]}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse.*emb.weight"):
        opt.step()


def test_build_optimizer_errors_list_valid_choices():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="valid optimizers: adamw, muon"):
        meqmuon.build_optimizer("lion", model)
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['betaz'\].*valid: lr"):
        meqmuon.build_optimizer("muon", model, betaz=(0.9, 0.9))
    opt = meqmuon.build_optimizer("adamw", model, lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1


def test_scale_rejects_tied_embeddings():
    model = make_model(dtype=torch.float32, tied=True)
    groups = meqmuon.param_groups(model)
    assert [g["kind"] for g in groups] == ["hidden", "embedding", "vector"]
    with pytest.raises(ValueError, match="SCALE cannot update a tied"):
        meqmuon.Scale(groups)
    meqmuon.MeqMuon(groups)  # fine for everyone else


def test_optimizer_state_bytes_matches_rule_counts():
    """Measured bytes after one step equal each rule table's count (section 4 formulas)."""
    model = make_model(dtype=torch.float32)
    groups = meqmuon.param_groups(model)
    sizes = {g["kind"]: sum(p.numel() for p in g["params"]) for g in groups}
    n_h = sizes["hidden"]
    n_a = sum(v for k, v in sizes.items() if k != "hidden")
    r_h = sum(p.shape[0] for g in groups if g["kind"] == "hidden" for p in g["params"])
    n = n_h + n_a
    expected = {
        "meqmuon": n * 4,
        "muon": (n_h + 2 * n_a) * 4,
        "normuon": (n_h + 2 * n_a + r_h) * 4,
        "adamw": 2 * n * 4,
        "meqmuon-only-hidden": (n_h + 2 * n_a) * 4,
        "meqmuon-only-embedding": (n_h + sizes["embedding"] + sizes["head"] + 2 * sizes["vector"]) * 4,
        "meqmuon-only-vector": (n_h + 2 * (sizes["embedding"] + sizes["head"]) + sizes["vector"]) * 4,
        "scale": (sizes["head"] + 2 * sizes["vector"]) * 4,
        **{name: (n_h + 2 * n_a) * 4 for name in MUONEQ_MODE},  # Muon's state
    }
    for name in ALL:
        opt = meqmuon.build_optimizer(name, model, lr=1e-3)
        model.zero_grad()
        loss_fn(model, batches(1)[0]).backward()
        opt.step()
        measured = meqmuon.optimizer_state_bytes(opt)
        assert measured == expected[name], name
        assert meqmuon.predicted_state_elements(meqmuon.rules_of(name), groups) * 4 == measured, name


def test_param_groups_covers_everything_once_and_skips_frozen():
    model = make_model(dtype=torch.float32)
    model.norm.bias.requires_grad_(False)
    groups = meqmuon.param_groups(model, lr={"vector": 0.5}, weight_decay=0.0)
    names = [n for g in groups for n in g["names"]]
    expected = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))
    kinds = {n: g["kind"] for g in groups for n in g["names"]}
    assert kinds["embed_tokens.weight"] == "embedding" and kinds["lm_head.weight"] == "head"
    assert kinds["conv.weight"] == "hidden" and kinds["up.bias"] == "vector"
    vec = next(g for g in groups if g["kind"] == "vector")
    assert vec["lr"] == 0.5 and "lr" not in groups[0]
    table = meqmuon.describe_groups(groups)
    assert "| embedding | 1 |" in table and "lm_head.weight" in table


def test_capture_hook_sees_pre_ns_inputs_and_is_off_by_default():
    model = make_model()
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=1e-2, ns_dtype=torch.float64)
    seen = {}
    opt.set_capture_hook(lambda name, kind, what, x: seen.__setitem__(name, (kind, what, x.clone())))
    loss_fn(model, batches(1)[0]).backward()
    grad_q = model.q.weight.grad.clone()
    opt.step()
    assert set(seen) == {n for n, _ in model.named_parameters()}
    kind, what, x = seen["q.weight"]
    # first step: B = G, Nesterov input G + mu*B = (1 + mu) G
    assert (kind, what) == ("hidden", "momentum_input") and torch.allclose(x, 1.95 * grad_q)
    assert seen["lm_head.weight"][0] == "head"
    opt.set_capture_hook(None)
    seen.clear()
    opt.step()
    assert seen == {}
    muon = meqmuon.Muon(meqmuon.param_groups(model), lr=1e-2)
    muon.set_capture_hook(lambda name, kind, what, x: seen.__setitem__(name, what))
    muon.step()
    assert seen["embed_tokens.weight"] == "gradient" and seen["q.weight"] == "momentum_input"
