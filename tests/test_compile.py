"""``compile=True`` (``optim/compiled.py``; the hidden rules' compiled form is the driver's bucket body,
``optim/driver.py``): same maths as eager; no recompiles when lr / weight decay change; one graph per
bucket, however many buckets.

Equality: the compiled kernels fuse the same expressions; in float64 (model and Newton-Schulz, so
that bf16 NS rounding does not amplify last-bit differences of the fused arithmetic through the
gradients) parameters agree with the eager optimizer to 1e-10 after 5 steps, and the row/column
choices are identical. Recompilation is detected with dynamo's own counters
(``torch._dynamo.utils.counters``), never with timing.
"""

import pytest
import torch
from tinynet import batches, loss_fn, make_model

import meqmuon


def _fresh_compile():
    """Forget every compiled graph: dynamo's caches and compiled.py's."""
    from meqmuon.optim import compiled as C

    torch._dynamo.reset()
    C._bucket_graphs.clear()


def _run(model, opt, sched, n):
    for ids in batches(n, seed=5):
        opt.zero_grad()
        loss_fn(model, ids).backward()
        opt.step()
        sched.step()


def _sched(opt):
    # lr and weight decay change every step
    def hook(optimizer, *_):
        for g in optimizer.param_groups:
            g["weight_decay"] += 0.01

    opt.register_step_post_hook(hook)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_compiled_per_tensor_matches_eager_and_does_not_recompile():
    """``compile=True`` with the per-tensor step (inductor): each hidden matrix's step, direction input to
    update, is the driver's bucket body compiled for that matrix's shape; TinyNet's hidden matrices have
    4 shapes (12 x 12 twice, 36 x 12, 12 x 36, the conv kernel's 12 x 36 matrix is the fourth's shape but
    another parameter rank), so at most 4 hidden graphs, and an LR schedule (weight decay changing too)
    adds none. Float64 (model and Newton-Schulz): parameters equal the eager step's to 1e-10."""
    from torch._dynamo.utils import counters

    from meqmuon.optim import compiled as C

    _fresh_compile()
    counters.clear()
    eager_model = make_model()
    comp_model = make_model()
    eager = meqmuon.MeqMuon(meqmuon.param_groups(eager_model), lr=0.02, ns_dtype=torch.float64)
    comp = meqmuon.MeqMuon(meqmuon.param_groups(comp_model), lr=0.02, ns_dtype=torch.float64, compile=True)
    e_sched, c_sched = _sched(eager), _sched(comp)
    _run(eager_model, eager, e_sched, 2)
    _run(comp_model, comp, c_sched, 2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(C._bucket_graphs) and 0 < len(C._bucket_graphs) <= 4
    assert {k[0] for k in C._bucket_graphs} == {"meq_hidden"}
    lrs = {g["lr"] for g in comp.param_groups}
    _run(eager_model, eager, e_sched, 3)
    _run(comp_model, comp, c_sched, 3)
    assert {g["lr"] for g in comp.param_groups} != lrs and comp.param_groups[0]["weight_decay"] > 0.14  # 0.1 + 5 * 0.01
    assert counters["stats"]["unique_graphs"] == graphs  # lr / wd changes did not recompile
    for (n, p), q in zip(eager_model.named_parameters(), comp_model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (n, (p - q).abs().max().item())
    assert eager.selection_counts() == comp.selection_counts()
    moved = (eager_model.q.weight - make_model().q.weight).abs().max().item()
    assert moved > 1e-3


@pytest.mark.parametrize("name", ["muon", "normuon", "muoneq-rc", "meqmuon-only-hidden"])
@pytest.mark.parametrize("foreach", [False, True])
def test_every_hidden_rule_compiles_and_equals_eager(name, foreach, monkeypatch):
    """Every optimizer takes ``compile=True``: the hidden rules' compiled form is the driver's body, so
    Muon, NorMuon, MuonEq (its per-matrix phase switch included) and the ablations compile with no code
    of their own. Dynamo with the eager backend (what is tested is that the body traces with
    ``fullgraph=True`` and never recompiles; inductor's fusion is covered above); float64 to 1e-10."""
    from torch._dynamo.utils import counters

    from meqmuon.optim import compiled as C

    _fresh_compile()
    counters.clear()
    monkeypatch.setattr(C, "BACKEND", "eager")
    extra = {"phase": 3} if name == "muoneq-rc" else {}
    models = [make_model() for _ in range(2)]
    opts = [meqmuon.build_optimizer(name, meqmuon.param_groups(m), lr=0.02, ns_dtype=torch.float64, foreach=foreach,
                                    compile=c, **extra) for m, c in zip(models, (False, True), strict=True)]
    scheds = [_sched(o) for o in opts]
    for model, opt, sched in zip(models, opts, scheds, strict=True):
        _run(model, opt, sched, 4)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(C._bucket_graphs) > 0
    _run(models[1], opts[1], scheds[1], 2)
    assert counters["stats"]["unique_graphs"] == graphs
    _run(models[0], opts[0], scheds[0], 2)
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (n, (p - q).abs().max().item())


def test_compile_flag_is_validated():
    model = make_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="compile"):
        meqmuon.MeqMuon(meqmuon.param_groups(model), compile="yes")


def test_batched_compile_is_one_graph_per_bucket_and_never_recompiles():
    """``compile=True`` with ``foreach=True``: each bucket's directions (``pre -> NS -> post`` of its stack; momentum
    and update run eagerly around it) are one fullgraph graph; TinyNet has 5 buckets (two hidden, the embedding
    with the head, two vector shapes), so 5 graphs, and 100 steps of an LR schedule (weight decay changing too)
    add none. The result equals the eager batched step to 1e-5 (float32; inductor fuses the same expressions)."""
    from torch._dynamo.utils import counters

    from meqmuon.optim import compiled as C

    _fresh_compile()
    C._bucket_graphs.clear()
    counters.clear()
    models = [make_model(dtype=torch.float32) for _ in range(2)]
    opts = [meqmuon.MeqMuon(meqmuon.param_groups(m), lr=0.02, ns_dtype=torch.float32, foreach=True, compile=c)
            for m, c in zip(models, (False, True), strict=True)]
    scheds = [_sched(o) for o in opts]
    for model, opt, sched in zip(models, opts, scheds, strict=True):
        _run(model, opt, sched, 3)
    assert counters["stats"]["unique_graphs"] == len(C._bucket_graphs) == 5
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5 * p.abs().max().item()), (n, (p - q).abs().max().item())
    assert opts[0].selection_counts() == opts[1].selection_counts()
    _run(models[1], opts[1], scheds[1], 100)
    assert counters["stats"]["unique_graphs"] == 5
    assert opts[1].param_groups[0]["weight_decay"] > 1.0  # 0.1 + 103 * 0.01: the values really changed
    assert all(torch.isfinite(p).all() for p in models[1].parameters())


def test_batched_compile_refuses_what_it_cannot_do():
    model = make_model(dtype=torch.float32)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=0.02, foreach=True, compile=True)
    opt.set_capture_hook(lambda *a: None)
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(NotImplementedError, match="capture hook needs the eager step"):
        opt.step()


# ---- many buckets: compile=True with foreach=True past dynamo's recompile limit (8 per code object) ----


class ManyShapes(torch.nn.Module):
    """21 hidden matrices of 21 distinct shapes (distinct up to transposition too: 21 buckets), every
    other one with a bias of its own length (11 vector buckets), between an embedding and a head."""

    def __init__(self, vocab=23, n=21):
        super().__init__()
        widths = [4 + i for i in range(n + 1)]
        self.embed_tokens = torch.nn.Embedding(vocab, widths[0])
        pairs = zip(widths[:-1], widths[1:], strict=True)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=i % 2 == 0) for i, (a, b) in enumerate(pairs))
        self.lm_head = torch.nn.Linear(widths[-1], vocab, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.lm_head(h)


class TinyMoE(torch.nn.Module):
    """MoE-like: per layer a router ``(E, d)`` and 3-D expert weights ``(E, 2f, d)``, ``(E, d, f)``
    (E and f differ between layers), dense attention-like and shared-expert matrices of several
    shapes, norms."""

    def __init__(self, vocab=23, d=8, layers=((2, 4), (3, 6), (4, 8))):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList()
        for i, (experts, f) in enumerate(layers):
            b = torch.nn.Module()
            b.qkv = torch.nn.Linear(d, (3 + i) * d, bias=False)
            b.o = torch.nn.Linear((3 + i) * d, d, bias=False)
            b.router = torch.nn.Linear(d, experts, bias=False)
            b.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * f, d) / d**0.5)
            b.down = torch.nn.Parameter(torch.randn(experts, d, f) / f**0.5)
            b.shared = torch.nn.Linear(d, f + i, bias=False)
            b.shared_down = torch.nn.Linear(f + i, d, bias=False)
            b.norm = torch.nn.LayerNorm(d)
            self.blocks.append(b)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for b in self.blocks:
            x = b.norm(h)
            a = b.qkv(x)
            h = h + b.o(torch.tanh(a))
            weights = torch.softmax(b.router(x), dim=-1)  # dense routing: every expert, weighted
            gate, up = torch.einsum("btd,efd->btef", x, b.gate_up).chunk(2, dim=-1)
            experts = torch.einsum("btef,edf->bted", torch.nn.functional.silu(gate) * up, b.down)
            h = h + torch.einsum("bte,bted->btd", weights, experts) + b.shared_down(torch.relu(b.shared(x)))
        return self.lm_head(h)


def _compare_many_buckets(monkeypatch, build, min_hidden_buckets):
    """Eager batched step against compile=True (dynamo with the eager backend: what is tested is
    dynamo's caching, which does not depend on the backend; inductor's fusion is covered above), 3
    steps of an LR schedule, then 5 more: each bucket compiles exactly once and never again. In
    float64 (model and Newton-Schulz) to 1e-10, as the unbatched compiled step above: the compiled
    buckets compute their statistics per bucket, the eager step across buckets, and in float32
    the deep models below amplify that rounding past 1e-5 within 3 steps."""
    from torch._dynamo.utils import counters

    from meqmuon.optim import compiled as C

    compiled = []

    def backend(gm, example_inputs):  # counts every compilation, recompiles included
        compiled.append(gm)
        return gm.forward

    _fresh_compile()
    C._bucket_graphs.clear()
    counters.clear()
    monkeypatch.setattr(C, "BACKEND", backend)
    models = [build() for _ in range(2)]
    opts = [meqmuon.MeqMuon(meqmuon.param_groups(m), lr=0.02, ns_dtype=torch.float64, foreach=True, compile=c)
            for m, c in zip(models, (False, True), strict=True)]
    scheds = [_sched(o) for o in opts]
    for model, opt, sched in zip(models, opts, scheds, strict=True):
        _run(model, opt, sched, 3)
    hidden = [k for k in C._bucket_graphs if k[0] == "meq_hidden"]
    assert len(hidden) >= min_hidden_buckets > 8  # past the recompile limit of one code object
    assert len(compiled) == counters["stats"]["unique_graphs"] == len(C._bucket_graphs)
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-10), (n, (p - q).abs().max().item())
    assert opts[0].selection_counts() == opts[1].selection_counts()
    graphs = len(compiled)
    _run(models[1], opts[1], scheds[1], 5)
    assert len(compiled) == counters["stats"]["unique_graphs"] == len(C._bucket_graphs) == graphs
    assert opts[1].param_groups[0]["weight_decay"] > 0.17  # 0.1 + 8 * 0.01: the values really changed
    assert all(torch.isfinite(p).all() for p in models[1].parameters())
    return graphs


def test_batched_compile_many_shapes_each_bucket_compiles_once(monkeypatch):
    """21 hidden shapes and 11 bias lengths (34 buckets): used to raise FailOnRecompileLimitHit at the
    ninth bucket, when every bucket's graph lived in the cache of one code object."""
    def build():
        torch.manual_seed(0)
        return ManyShapes().to(torch.float64)

    graphs = _compare_many_buckets(monkeypatch, build, 21)
    assert graphs == 21 + 11 + 2  # hidden, vector, and the embedding and head (two shapes)


def test_batched_compile_moe_like_model(monkeypatch):
    """Several 3-D expert weights and dense matrices of many shapes (Qwen2-MoE failed at step 1).
    The experts are stacked views, one matrix per expert, and buckets hold matrices of one shape up
    to transposition: 21 hidden tensors (6 of them 3-D) give 12 buckets, past the limit of 8."""

    def build():
        torch.manual_seed(0)
        return TinyMoE().to(torch.float64)

    _compare_many_buckets(monkeypatch, build, 12)


def test_compile_names_the_rules_that_run_eagerly():
    """AdamW and SCALE have no compiled form yet: ``compile=True`` says which rules run eagerly, for which
    kinds, instead of compiling them silently not; an optimizer made only of momentum rules says nothing."""
    import warnings

    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"rules without a compiled form run eagerly: 'adamw' \(embedding, head, "
                                         r"vector\)"):
        meqmuon.Muon(meqmuon.param_groups(model), compile=True)
    with pytest.warns(UserWarning, match="'scale_row' \\(hidden\\)"):
        meqmuon.build_optimizer("scale", model, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meqmuon.MeqMuon(meqmuon.param_groups(model), compile=True)
        meqmuon.Muon(meqmuon.param_groups(model))


@pytest.mark.parametrize("foreach", [False, True])
def test_compiled_step_warns_nothing_from_our_code(foreach):
    """A ``compile=True`` step emits no warning (``warnings`` or dynamo's log) that points at this
    package. Dynamo's ``warn_once`` remembers each message for the process, and ``_fresh_compile``
    does not forget it, so its memory is cleared first: otherwise a warning printed by an earlier test
    would be silenced here and the test could not fail. Before the fix, tracing ``_schedule``'s
    ``lru_cache`` printed "Dynamo detected a call to a `functools.lru_cache`-wrapped function at
    'functional.py:132'"."""
    import logging
    import pathlib
    import warnings

    from torch._dynamo import utils as dynamo_utils

    package = str(pathlib.Path(meqmuon.__file__).parent)
    _fresh_compile()
    dynamo_utils.warn_once_cache.clear()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    log = logging.getLogger("torch")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = make_model(dtype=torch.float32)
            opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=0.02, ns_dtype=torch.float32,
                                  foreach=foreach, compile=True)
            _run(model, opt, _sched(opt), 2)
    finally:
        log.removeHandler(handler)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if w.filename.startswith(package) or package in str(w.message) or "meqmuon" in str(w.message)]
    ours += [r.getMessage() for r in records if package in r.getMessage() or "meqmuon" in r.getMessage()]
    assert not ours, ours
    assert all(torch.isfinite(p).all() for p in model.parameters())
