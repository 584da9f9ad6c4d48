"""FSDP2's row path at the floor (issue 47): no padding slots in the exchange, owners balanced across buckets.

- The owners of a step's shape buckets are planned at once, longest first with the load carried
  (``distributed.bucket_owners``): for Llama-3 70B's hidden matrices on 512 ranks the busiest rank's
  Newton-Schulz FLOPs are within 1.1x of ``max(total / ranks, largest matrix)``; planned bucket by bucket
  from no load (``assign_counts``, the code before) they were 2.4x.
- The row path's splitters on the same ranks share one load per step, which starts from the owner path's
  planned load (``distributed.share_loads``) and is reset every step.
- On 2 gloo ranks, a step whose shape buckets have fewer matrices than ranks sends every rank's rows once to
  their owner and the owners' directions once back, nothing else (counted by ``benchmarks/step_accounting.py``'s
  meter, which reads only torch's collectives), and equals one process.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import _spawn

import meqmuon
from meqmuon.optim.distributed import assign_counts, bucket_owners
from meqmuon.optim.newton_schulz import method_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_accounting import StepMeter, floor_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

#: Llama-3 70B's hidden matrices of one decoder layer (q, o; k, v; gate, up; down), as FSDP2's row path
#: buckets them (by shape, not transposed).
LLAMA3_70B_LAYER = [(8192, 8192)] * 2 + [(1024, 8192)] * 2 + [(28672, 8192)] * 2 + [(8192, 28672)]


def _default_group() -> dict:
    w = torch.nn.Parameter(torch.zeros(8, 8))
    return meqmuon.build_optimizer("meqmuon", [{"params": [w], "kind": "hidden"}]).param_groups[0]


def _busiest_over_bound(sizes: list[int], costs: list[float], owners: list[list[int]], world: int) -> float:
    load = [0.0] * world
    for k, c, own in zip(sizes, costs, owners, strict=True):
        assert len(own) == k and all(0 <= r < world for r in own)
        for r in own:
            load[r] += c
    total = sum(k * c for k, c in zip(sizes, costs, strict=True))
    return max(load) / max(total / world, max(costs))


def test_llama3_70b_owners_on_512_ranks_are_within_1_1x_of_the_bound():
    group, world, layers = _default_group(), 512, 80
    shapes = list(dict.fromkeys(LLAMA3_70B_LAYER))  # the buckets, in first-appearance order
    sizes = [layers * LLAMA3_70B_LAYER.count(s) for s in shapes]
    costs = [float(method_flops(group, m, n)) for m, n in shapes]
    new = bucket_owners(sizes, costs, [0.0] * world)
    assert new == bucket_owners(sizes, costs, [0.0] * world)  # deterministic: every rank plans the same
    assert _busiest_over_bound(sizes, costs, new, world) <= 1.1
    # before: each bucket's contiguous slices from no load, its remainder on ranks 0.. every time
    old = []
    for k, c in zip(sizes, costs, strict=True):
        counts = assign_counts([k], [c], world)[0]
        old.append([r for r in range(world) for _ in range(counts[r])])
    assert _busiest_over_bound(sizes, costs, old, world) > 2.0


def test_bucket_owners_carry_the_load_across_calls():
    load = [0.0, 0.0]
    assert bucket_owners([1, 2], [5.0, 2.0], load) == [[0], [1, 1]] and load == [5.0, 4.0]
    assert bucket_owners([1], [3.0], load) == [[1]] and load == [5.0, 7.0]


#: The gloo model: a bucket of one 48 x 32 matrix, one of two 32 x 32, one of a 3 x 32 (rows 2 and 1 on two
#: ranks: the uneven split), so every bucket but one has fewer matrices than ranks.
SHAPES = [(48, 32), (32, 32), (32, 32), (3, 32)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _fsdp2_step(rank: int, name: str, ns: str = "float32") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    params = [layer.weight for layer in model]
    groups = [{"params": params, "kind": "hidden", "names": [f"{i}.weight" for i in range(len(params))]}]
    opt = meqmuon.build_optimizer(name, groups, ns_dtype=getattr(torch, ns), foreach=True)
    out = {}
    for step in range(3):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = distribute_tensor(g, mesh, p.placements)
        if step < 2:
            opt.step()  # the first plans (its DTensor ops are not the exchange's); the third is metered
            continue
        meter = StepMeter()
        with meter:
            opt.step()
        out = meter.summary()
    out["floor"] = floor_bytes(opt, getattr(torch, ns).itemsize)
    out["local"] = [tuple(p.to_local().shape) for p in params]
    out["params"] = [p.full_tensor() for p in params]
    out["reference"] = _one_process(name, ns)  # in the worker: the same threads as the sharded step
    return out


def _one_process(name: str, ns: str = "float32") -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES)
    params = [layer.weight for layer in model]
    opt = meqmuon.build_optimizer(name, [{"params": params, "kind": "hidden"}], ns_dtype=getattr(torch, ns),
                                  foreach=True)
    for step in range(3):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def test_row_exchange_sends_each_piece_once_with_no_padding_and_equals_one_process(tmp_path):
    got = _spawn(_fsdp2_step, tmp_path, "muon")
    whole = [4 * m * n for m, n in SHAPES]  # bytes of each matrix in float32
    owned = []
    for rank, r in enumerate(got):
        local = sum(4 * a * b for a, b in r["local"])
        assert r["floor"] == 2 * local, (rank, r["floor"])
        # out: this rank's rows of every matrix to their owners; back: the owner's whole directions, each rank
        # its rows. So sent = local + the whole matrices it owns, and received the same, with nothing padded.
        extra = r["sent"] - local
        assert r["received"] == r["sent"], (rank, r)
        owned.append(extra)
        assert r["calls"] == {"alltoall_base_": 6}, r["calls"]  # one pair per shape bucket, as before
    assert sum(owned) == sum(whole), (owned, whole)  # each matrix owned once
    subsets = {sum(c) for k in range(len(whole) + 1) for c in itertools.combinations(whole, k)}
    assert all(x in subsets for x in owned), (owned, sorted(subsets))
    # owners balanced across the buckets: the busiest rank does the least busiest work any assignment gives
    group = _default_group() | {"ns_method": "quintic", "ns_steps": 5}
    costs = [method_flops(group, m, n) for m, n in SHAPES]
    best = min(max(sum(c for c, o in zip(costs, a, strict=True) if o == r) for r in (0, 1))
               for a in itertools.product((0, 1), repeat=len(costs)))
    assert max(r["flops"] for r in got) == best, ([r["flops"] for r in got], best)
    _equal_one_process(got)


def test_meqmuon_row_exchange_with_per_matrix_state_equals_one_process(tmp_path):
    got = _spawn(_fsdp2_step, tmp_path, "meqmuon")
    assert all(r["calls"]["alltoall_base_"] == 6 for r in got), [r["calls"] for r in got]
    _equal_one_process(got)


def _bf16_steps(rank: int) -> dict:
    return {name: _fsdp2_step(rank, name, "bfloat16") for name in ("muon", "meqmuon", "normuon")}


def test_bf16_newton_schulz_rows_go_out_and_directions_come_back_in_bf16(tmp_path):
    """With bf16 Newton-Schulz (the CUDA default) the rows travel in bf16 whatever state rides with them (their
    columns apart, float32), and the directions come back in bf16: Muon's ``U`` itself, MeqMuon's ``U`` with
    eq. 8's factors (a row factor per row, ``n`` column factors per matrix), which each rank applies to its rows,
    where they are fewer bytes than a float32 ``D`` (not for the 3 x 32 matrix, 2 rows a rank: its ``D``);
    NorMuon likewise, with its row divisors and restoring scale. Counted exactly per rank from the shapes; the
    same bits as one process with bf16 Newton-Schulz. Before, the rows of MeqMuon and NorMuon went out in float32
    (to carry their state columns) and every direction came back in float32."""
    got = _spawn(_bf16_steps, tmp_path)
    world = len(got)
    chunks = [[c.numel() for c in torch.arange(m).chunk(world)] for m, _ in SHAPES]  # FSDP2's rows per rank
    rows = [c + [0] * (world - len(c)) for c in chunks]
    # bytes per matrix: (what each rank q sends of its rows, what q gets back, what the owner gets, what it sends)
    forms = {
        "muon": lambda m, n, r: (2 * r * n, 2 * r * n),
        # counter column; factors where fewer bytes than D at FSDP2's even share of rows (not the 3 x 32's 2)
        "meqmuon": lambda m, n, r: (2 * r * n + 4 * r, 2 * r * n + 8 * r + 4 * n if _factored(m, n, world) else
                                    4 * r * n + 4 * r),
        "normuon": lambda m, n, r: (2 * r * n + 4 * r, 2 * r * n + 8 * r + 4 * n if _factored(m, n, world) else
                                    4 * r * n + 4 * r),  # second-moment column; row divisors, restoring scale
    }
    for name, per_matrix in forms.items():
        owner_in = [sum(per_matrix(m, n, rows[i][q])[0] for q in range(world)) for i, (m, n) in enumerate(SHAPES)]
        owner_out = [sum(per_matrix(m, n, rows[i][q])[1] for q in range(world)) for i, (m, n) in enumerate(SHAPES)]
        owned_in, owned_out = [], []
        for q, r in enumerate(got):
            r = r[name]
            out = sum(per_matrix(m, n, rows[i][q])[0] for i, (m, n) in enumerate(SHAPES))
            back = sum(per_matrix(m, n, rows[i][q])[1] for i, (m, n) in enumerate(SHAPES))
            owned_out.append(r["sent"] - out)  # what q sent as an owner: its matrices' directions
            owned_in.append(r["received"] - back)  # what q received as an owner: its matrices' rows
            assert r["calls"]["alltoall_base_"] == 6, (name, r["calls"])  # one pair per shape bucket
            if name == "muon":  # no state, post the identity: at the bound, 2 bytes per element each way
                assert r["floor"] == 2 * 2 * sum(a * b for a, b in r["local"]), (q, r["floor"])
        # the owners' shares are those of whole matrices, each owned once, the same matrices both ways
        assert sum(owned_out) == sum(owner_out) and sum(owned_in) == sum(owner_in), (name, owned_out, owner_out)
        for q in range(world):
            ways = [(sum(i for i, o in zip(owner_in, pick, strict=True) if o),
                     sum(x for x, o in zip(owner_out, pick, strict=True) if o))
                    for pick in itertools.product((0, 1), repeat=len(SHAPES))]
            assert (owned_in[q], owned_out[q]) in ways, (name, q, owned_in[q], owned_out[q])
        _equal_one_process([r[name] for r in got])


def _factored(m: int, n: int, world: int) -> bool:
    """Whether MeqMuon's ``m x n`` direction comes back as bf16 ``U`` and eq. 8's factors: fewer bytes than a
    float32 ``D`` at ``r`` rows a rank (the row factors and ``n`` column factors against ``r x n`` 2 B more)."""
    r = -(-m // world)
    return 2 * r * n + 4 * r + 4 * n < 4 * r * n


def _equal_one_process(got: list[dict]) -> None:
    """Within tests/test_layouts.py's bound (1e-6) of one process; the matrices with even shards bit for bit
    (the 3 x 32 one differs by an ulp of one process's, before this exchange as after)."""
    for r in got:
        for i, (p, q) in enumerate(zip(r["params"], r["reference"], strict=True)):
            torch.testing.assert_close(p, q, rtol=0, atol=0 if SHAPES[i][0] % 2 == 0 else 1e-6)


def _shared_loads(rank: int) -> dict:
    from meqmuon.optim.distributed import ShardedSplit, share_loads

    a, b = ShardedSplit(dist.group.WORLD), ShardedSplit(dist.group.WORLD)
    pair = dist.new_group([0, 1])  # the same ranks, another group object: one load still
    c = ShardedSplit(pair)
    loads = share_loads([a, b, c, None], base=[5.0, 0.0])  # the owner path planned 5 on rank 0
    first = a.bucket_owners([1], [3.0])  # to rank 1, the least loaded after the owner path
    second = c.bucket_owners([2], [1.0])  # the same load: rank 1 (3) then rank 1 again (4 < 5)
    before_reset = list(a.load.load)
    for load in loads:
        load.reset()
    return {"n": len(loads), "shared": a.load is b.load is c.load, "first": first, "second": second,
            "before_reset": before_reset, "after_reset": list(b.load.load)}


def test_row_path_groups_share_one_load_that_starts_at_the_owner_paths_and_resets(tmp_path):
    for r in _spawn(_shared_loads, tmp_path):
        assert r["n"] == 1 and r["shared"], r
        assert r["first"] == [[1]] and r["second"] == [[1, 1]], r
        assert r["before_reset"] == [5.0, 5.0] and r["after_reset"] == [5.0, 0.0], r


def test_what_an_owner_sends_back_follows_the_rules_post():
    """``HiddenRule._direction_form``, derived per class: ``U`` alone where ``post`` is the identity (a ``pre`` does
    not matter), ``U`` and factors where the class that defines ``post_factors`` also defines (or inherits below)
    ``post`` and ``post_all``, else ``D``: a user's subclass of MeqMuon's rule that changes ``post`` must not
    travel as eq. 8's factors."""
    from meqmuon.optim.rules.meqmuon import MeqHidden
    from meqmuon.optim.rules.muon import MoonlightHidden
    from meqmuon.optim.rules.normuon import NorMuonHidden

    class OnlyPre(meqmuon.HiddenRule):
        name = "only_pre"

        def pre(self, X, group, state=None):
            return X * 2

    class OwnPost(MeqHidden):
        name = "own_post"

        def post(self, U, group, state):
            return U * 2

    class OwnPostAll(MeqHidden):
        name = "own_post_all"

        def post_all(self, Us, group, states):
            return [U * 2 for U in Us]

    forms = {c: c._direction_form for c in (MoonlightHidden, OnlyPre, MeqHidden, NorMuonHidden, OwnPost, OwnPostAll)}
    assert forms == {MoonlightHidden: "identity", OnlyPre: "identity", MeqHidden: "factors",
                     NorMuonHidden: "factors", OwnPost: "direction", OwnPostAll: "direction"}, forms


def test_factors_travel_only_where_fewer_bytes_and_in_the_directions_dtype():
    """``HiddenRule._factors_pay``, the one rule of the row path and the owner path: bf16 ``U`` with float32
    factors for a piece of 16 x 4096 (fewer bytes than a float32 ``D``), not for 2 rows (as many), not with float32
    ``U``, not for a rule without factors, and not for a float64 ``D``: factors widened to float64 round eq. 8's
    products otherwise than one process, whose ``D`` is float32 (checked here)."""
    from meqmuon import functional as F
    from meqmuon.optim.rules.meqmuon import MeqHidden
    from meqmuon.optim.rules.muon import MoonlightHidden

    meq, bf16, f32, f64 = MeqHidden(), torch.bfloat16, torch.float32, torch.float64
    assert meq._factors_pay(16, 4096, bf16, f32) and meq._factors_pay(3, 4096, bf16, f32)
    assert not meq._factors_pay(2, 4096, bf16, f32) and not meq._factors_pay(16, 4096, f32, f32)
    assert not MoonlightHidden()._factors_pay(16, 4096, bf16, f32)
    assert not meq._factors_pay(16, 4096, bf16, f64)
    u = (torch.randn(1, 64, 48, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 48)).to(bf16)
    (d,), _ = F.adaptive_normalize_stacks([u])
    ((row, col),), _ = F.adaptive_normalize_factors([u])
    assert torch.equal(F.apply_factors(u, row, col), d)
    assert not torch.equal(F.apply_factors(u, row.double(), col.double()), d.double())
