"""Routing and memory accounting on the paper's six architectures (Table 11), built on the meta device.

Checks, per model: unique parameter counts equal Table 11; tied embedding/head weights appear
once, as ``embedding`` with ``tied=True``; Qwen2's q/k/v biases are ``vector``; the analytic
state-memory formulas of section 4 ("Memory overhead") reproduce Table 5 and Table 7's memory
columns to 0.01 MiB. No weights are allocated (meta device), so this runs in seconds.
"""

import pytest
import torch

import meqmuon
from meqmuon.train.models import build_model

MIB = 2**20
# Table 11: unique parameters (M) and tied flag
TABLE11 = {
    "llama-60m": (58.074, False),
    "llama-130m": (134.106, False),
    "llama-350m": (367.969, False),
    "smollm2-135m": (134.515, True),
    "smollm2-360m": (361.821, True),
    "qwen2-0.5b": (494.033, True),
}
# Table 5 (MiB): Muon, NorMuon, MeqMuon
TABLE5 = {
    "llama-60m": (346.57, 346.73, 221.53),
    "llama-130m": (699.15, 699.51, 511.57),
    "llama-350m": (1653.88, 1654.85, 1403.69),
    "smollm2-135m": (621.27, 621.86, 513.13),
    "smollm2-360m": (1560.48, 1561.53, 1380.24),
    "qwen2-0.5b": (2404.17, 2405.33, 1884.59),
}
# Table 7 memory (MiB): only-hidden, only-embedding, only-vector
TABLE7 = {
    "llama-60m": (346.57, 221.57, 346.53),
    "llama-130m": (699.15, 511.65, 699.07),
}


@pytest.fixture(scope="module", params=list(TABLE11))
def paper_model(request):
    return request.param, build_model(request.param, device="meta")


def test_param_groups_on_paper_models(paper_model):
    name, model = paper_model
    params_m, tied = TABLE11[name]
    groups = meqmuon.param_groups(model)
    unique = sum(p.numel() for g in groups for p in g["params"])
    assert round(unique / 1e6, 3) == params_m
    kinds = {n: g["kind"] for g in groups for n in g["names"]}
    assert len(kinds) == sum(len(g["params"]) for g in groups)  # no tensor twice
    emb = next(g for g in groups if g["kind"] == "embedding")
    assert emb["tied"] is tied
    assert [g["kind"] for g in groups] == (
        ["hidden", "embedding", "vector"] if tied else ["hidden", "embedding", "head", "vector"]
    )
    assert all(kinds[n] == "hidden" for n in kinds if n.endswith(("_proj.weight",)))
    assert all(kinds[n] == "vector" for n in kinds if "norm" in n)
    if name == "qwen2-0.5b":
        biases = [n for n in kinds if n.endswith("bias")]
        assert len(biases) == 24 * 3 and all(kinds[n] == "vector" for n in biases)
        assert {b.split(".")[-2] for b in biases} == {"q_proj", "k_proj", "v_proj"}
    table = meqmuon.describe_groups(groups)
    assert f"{unique:,}" in table


def test_memory_formulas_reproduce_table5(paper_model):
    name, model = paper_model
    groups = meqmuon.param_groups(model)
    n_h = sum(p.numel() for g in groups if g["kind"] == "hidden" for p in g["params"])
    n_a = sum(p.numel() for g in groups if g["kind"] != "hidden" for p in g["params"])
    r_h = sum(p.shape[0] for g in groups if g["kind"] == "hidden" for p in g["params"])
    muon, normuon, meq = TABLE5[name]
    # section 4: Muon N_h + 2 N_a, NorMuon + R_h, MeqMuon N_h + N_a (fp32 values)
    assert round((n_h + 2 * n_a) * 4 / MIB, 2) == muon
    assert round((n_h + 2 * n_a + r_h) * 4 / MIB, 2) == normuon
    assert round((n_h + n_a) * 4 / MIB, 2) == meq
    # the rule tables predict the same numbers
    for opt_name, expected in (("muon", muon), ("normuon", normuon), ("meqmuon", meq)):
        predicted = meqmuon.predicted_state_elements(meqmuon.rules_of(opt_name), groups) * 4 / MIB
        assert round(predicted, 2) == expected, opt_name
    if name in TABLE7:
        for opt_name, expected in zip(
            ("meqmuon-only-hidden", "meqmuon-only-embedding", "meqmuon-only-vector"), TABLE7[name], strict=True
        ):
            predicted = meqmuon.predicted_state_elements(meqmuon.rules_of(opt_name), groups) * 4 / MIB
            assert round(predicted, 2) == expected, opt_name


def test_measured_state_bytes_equal_prediction_on_a_small_model():
    model = build_model("llama-tiny", vocab_size=256, seed=0)
    groups = meqmuon.param_groups(model)
    ids = torch.randint(0, 256, (2, 16))
    for opt_name in meqmuon.OPTIMIZERS:
        opt = meqmuon.build_optimizer(opt_name, model, lr=1e-3)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        predicted = meqmuon.predicted_state_elements(meqmuon.rules_of(opt_name), groups) * 4
        assert meqmuon.optimizer_state_bytes(opt) == predicted, opt_name
