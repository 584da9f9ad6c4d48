"""Model registry: parameter counts vs the paper's Table 11, tying, biases, CPU presets."""

from __future__ import annotations

import pytest
import torch

from meqmuon.train.models import (
    MODELS,
    PAPER_MODELS,
    build_config,
    build_model,
    count_unique_params,
    get_spec,
)

TINY = ["llama-tiny", "llama-tiny-tied", "smollm2-tiny", "qwen2-tiny"]


def test_paper_models_listed():
    assert set(PAPER_MODELS) == {
        "llama-60m", "llama-130m", "llama-350m", "smollm2-135m", "smollm2-360m", "qwen2-0.5b"
    }


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_param_count_matches_table_11(name):
    model = build_model(name, device="meta")
    assert next(model.parameters()).is_meta  # nothing allocated
    n = count_unique_params(model)
    spec = get_spec(name)
    assert round(n / 1e6, 3) == spec.paper_params_m
    assert n == spec.num_params()  # analytic count agrees with the built module
    assert spec.token_budget() == 20 * n


@pytest.mark.parametrize("name", list(MODELS))
def test_tying_shares_the_tensor(name):
    model = build_model(name, device="meta")
    same = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert same == get_spec(name).tied
    # count_unique_params counts a tied matrix once: summing every module's own parameters
    # (which lists the shared matrix under both the embedding and the LM head) is one matrix more.
    emb = model.get_input_embeddings().weight.numel()
    listed = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))
    assert listed == count_unique_params(model) + (emb if same else 0)


def test_expected_families_and_tying():
    assert {n for n in PAPER_MODELS if get_spec(n).tied} == {"smollm2-135m", "smollm2-360m", "qwen2-0.5b"}
    assert get_spec("smollm2-135m").num_kv_heads == 3 and get_spec("qwen2-0.5b").num_kv_heads == 2


@pytest.mark.parametrize("name", ["qwen2-0.5b", "qwen2-tiny"])
def test_qwen2_qkv_bias_only(name):
    model = build_model(name, device="meta")
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None
    assert attn.o_proj.bias is None


@pytest.mark.parametrize("name", ["llama-60m", "smollm2-135m"])
def test_llama_family_has_no_bias(name):
    model = build_model(name, device="meta")
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters())


def test_config_details():
    cfg = build_config("smollm2-360m")
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.max_position_embeddings == 2048
    assert cfg.use_cache is False and cfg._attn_implementation == "sdpa"
    q = build_config("qwen2-0.5b")
    assert q.tie_word_embeddings is True and q.rope_parameters["rope_theta"] == 1e6
    assert q.num_key_value_heads == 2 and q.eos_token_id == 151643
    # vocab override; special ids that fall outside the new vocab are dropped
    small = build_config("qwen2-0.5b", vocab_size=1000)
    assert small.vocab_size == 1000 and small.eos_token_id is None
    assert build_config("llama-60m", vocab_size=777).vocab_size == 777


def test_vocab_override_changes_count():
    spec = get_spec("llama-tiny")
    model = build_model("llama-tiny", vocab_size=1000, device="meta")
    assert count_unique_params(model) == spec.num_params(1000)
    assert model.get_input_embeddings().weight.shape == (1000, spec.hidden_size)


def test_seed_gives_same_weights():
    a = build_model("llama-tiny", seed=3)
    b = build_model("llama-tiny", seed=3)
    c = build_model("llama-tiny", seed=4)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    torch.manual_seed(0)
    model = build_model(name, seed=0)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (8, 129))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1))
    loss.backward()
    # random init: loss near ln(vocab) (SmolLM2's larger init_range 1/sqrt(d) adds some spread)
    assert abs(loss.item() - torch.log(torch.tensor(float(vocab))).item()) < 1.5
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_bf16_build():
    model = build_model("smollm2-tiny", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError) as exc:
        build_config("llama-7b")
    msg = str(exc.value)
    assert "llama-7b" in msg and all(n in msg for n in MODELS)
    with pytest.raises(ValueError):
        build_model("nope", device="meta")


def test_llama_micro_keeps_the_paper_models_embedding_share_at_20_tokens_per_parameter():
    """``llama-micro`` (issue 39): the built-in BPE's 1,280 ids by default, 233,904 parameters of which the
    embedding and head are 53 % (Llama-60M's: 56 %), so 1x Chinchilla is 4.7M tokens."""
    from meqmuon.train.config import TrainConfig, fill_model_defaults

    assert fill_model_defaults(TrainConfig(model="llama-micro")).vocab_size == 1280
    assert fill_model_defaults(TrainConfig(model="llama-tiny")).vocab_size == 4096
    assert fill_model_defaults(TrainConfig(model="llama-micro", vocab_size=512)).vocab_size == 512
    micro = build_model("llama-micro", device="meta")
    n = count_unique_params(micro)
    emb = sum(p.numel() for k, p in micro.named_parameters() if "embed_tokens" in k or "lm_head" in k)
    paper = get_spec("llama-60m")
    paper_emb = 2 * paper.vocab_size * paper.hidden_size / paper.num_params()
    assert n == get_spec("llama-micro").num_params() == 233_904
    assert abs(emb / n - paper_emb) < 0.05, (emb / n, paper_emb)
    assert get_spec("llama-micro").token_budget() == 20 * n


def test_llama_micro_widths_change_the_width_alone():
    """The width ladder of issue 58 (``llama-micro-w24``, ``llama-micro``, ``llama-micro-w96``): same depth,
    vocabulary, head width and MLP ratio, so every hidden matrix keeps its aspect ratio; the CPU run defaults
    (1,280 ids, 32 x 128-token batches) follow ``llama-micro``'s."""
    from meqmuon.train.config import TrainConfig, fill_model_defaults
    from meqmuon.train.models import MICRO_WIDTHS

    base = get_spec("llama-micro")
    counts = {}
    for w in MICRO_WIDTHS:
        name = "llama-micro" if w == 48 else f"llama-micro-w{w}"
        spec, model = get_spec(name), build_model(name, device="meta")
        assert (spec.num_layers, spec.head_dim, spec.vocab_size, spec.tied) == (4, 12, 1280, False)
        assert spec.hidden_size == w and spec.num_heads * spec.head_dim == w
        assert spec.intermediate_size * base.hidden_size == w * base.intermediate_size  # 8/3 of the width
        shapes = {k.split(".", 3)[-1]: tuple(p.shape) for k, p in model.named_parameters() if ".layers.0." in k}
        f = spec.intermediate_size
        assert shapes["self_attn.q_proj.weight"] == shapes["self_attn.o_proj.weight"] == (w, w)
        assert shapes["mlp.gate_proj.weight"] == (f, w) and shapes["mlp.down_proj.weight"] == (w, f)
        counts[w] = count_unique_params(model)
        assert counts[w] == spec.num_params()
        cfg = fill_model_defaults(TrainConfig(model=name))
        assert (cfg.vocab_size, cfg.global_batch, cfg.seq_len) == (1280, 32, 128)
    assert counts == {24: 89_304, 48: 233_904, 96: 688_992}

def test_attention_in_float32_is_sdpa_in_float32():
    """``attention="sdpa-float32"`` (the harness's choice for bf16 autocast on a CPU): in fp32 it is SDPA
    itself, bit for bit; under bf16 autocast it returns bf16 like SDPA, within bf16's precision of the fp32
    result as SDPA's bf16 attention is, and its gradients flow."""
    from meqmuon.train.models import ATTENTIONS

    assert build_config("llama-tiny", attention="sdpa-float32")._attn_implementation == ATTENTIONS["sdpa-float32"]
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        build_config("llama-tiny", attention="flash")
    torch.manual_seed(0)
    x = torch.randint(0, 4096, (2, 64))
    ref = build_model("llama-tiny", seed=0)
    f32 = build_model("llama-tiny", seed=0, attention="sdpa-float32")
    assert torch.equal(ref(input_ids=x).logits, f32(input_ids=x).logits)
    for name in ("qwen2-tiny", "smollm2-tiny"):  # biases, GQA
        a, b = build_model(name, seed=0), build_model(name, seed=0, attention="sdpa-float32")
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    exact = ref(input_ids=x).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, mixed = ref(input_ids=x).logits, f32(input_ids=x).logits
        mixed.float().logsumexp(-1).sum().backward()
    assert low.dtype == mixed.dtype == torch.bfloat16
    # bf16 has 8 significant bits: both stay within a few bf16 ulps of the logits' scale of the fp32 result
    scale = exact.abs().max()
    assert (mixed.float() - exact).abs().max() <= 2**-6 * scale and (low.float() - exact).abs().max() <= 2**-6 * scale
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in f32.parameters())

