"""Tiny random-init transformers models of the kinds users train, for ``tests/test_zoo.py``.

Twenty-three architectures: Llama, Mistral, Qwen2, Gemma2, Phi3, GPT-2, GPT-NeoX, Falcon, OPT, Mixtral,
Qwen2-MoE, Qwen3-MoE, BERT, T5, ViT, Mamba, DBRX, GPT-OSS, Llama 4, ModernBERT, CLIP, Mamba2, Qwen3-Next. No
downloads: every model is built from a config with ``torch.manual_seed(0)``, in float32, eager
attention. Each entry of :data:`ZOO` is a factory returning ``(model, batch)``, or raising
:class:`Missing` when the installed transformers lacks the architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 128
TOKENS = (2, 16)  # batch x sequence length for the language models


class Missing(Exception):
    """The installed transformers has no such architecture."""


def _classes(*names: str) -> list[Any]:
    import transformers

    missing = [n for n in names if not hasattr(transformers, n)]
    if missing:
        raise Missing(f"transformers {transformers.__version__} has no {', '.join(missing)}")
    return [getattr(transformers, n) for n in names]


def _tokens(vocab: int = VOCAB, shape: tuple[int, int] = TOKENS, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g)


def _lm_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    ids = _tokens(vocab)
    return {"input_ids": ids, "labels": ids}


def _build(model_cls: Any, config: Any) -> nn.Module:
    torch.manual_seed(0)
    model = model_cls(config).float()
    model.train()
    return model


# Shared tiny transformer sizes: d=32, 4 query heads of 8, 2 KV heads (GQA), 2 layers.
DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def llama() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("LlamaConfig", "LlamaForCausalLM")
    return _build(model_cls, config_cls(**DENSE, tie_word_embeddings=False)), _lm_batch()


def mistral() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("MistralConfig", "MistralForCausalLM")
    return _build(model_cls, config_cls(**DENSE, tie_word_embeddings=False)), _lm_batch()


def qwen2() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Qwen2Config", "Qwen2ForCausalLM")
    return _build(model_cls, config_cls(**DENSE, tie_word_embeddings=False)), _lm_batch()


def gemma2() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Gemma2Config", "Gemma2ForCausalLM")
    config = config_cls(**DENSE, head_dim=8, tie_word_embeddings=True, sliding_window=8)
    return _build(model_cls, config), _lm_batch()


def phi3() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Phi3Config", "Phi3ForCausalLM")
    # 4 query heads, 2 KV heads: the fused qkv projection splits unevenly as (32, 16, 16).
    config = config_cls(**DENSE, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _build(model_cls, config), _lm_batch()


def gpt2() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("GPT2Config", "GPT2LMHeadModel")
    config = config_cls(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return _build(model_cls, config), _lm_batch()


def gpt_neox() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("GPTNeoXConfig", "GPTNeoXForCausalLM")
    # Fused query_key_value (3d, d), interleaved per head; untied embed_in / head (the config default).
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return _build(model_cls, config), _lm_batch()


def falcon() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("FalconConfig", "FalconForCausalLM")
    # Config defaults (Falcon-7B style): multi-query, parallel attention + MLP, no biases, tied head;
    # the fused query_key_value is (4 heads + 1 k + 1 v) x 8 = 48 rows.
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0, attn_implementation="eager",
    )
    return _build(model_cls, config), _lm_batch()


def opt() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("OPTConfig", "OPTForCausalLM")
    # word_embed_proj_dim = hidden_size: no project_in/out. Learned positions, tied head (defaults).
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        attn_implementation="eager",
    )
    return _build(model_cls, config), _lm_batch()


MOE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    attn_implementation="eager",
    tie_word_embeddings=False,
)


def mixtral() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("MixtralConfig", "MixtralForCausalLM")
    config = config_cls(**MOE, intermediate_size=48, num_local_experts=4)
    return _build(model_cls, config), _lm_batch()


def qwen2_moe() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Qwen2MoeConfig", "Qwen2MoeForCausalLM")
    config = config_cls(
        **MOE, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=4
    )
    return _build(model_cls, config), _lm_batch()


def qwen3_moe() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    config = config_cls(**MOE, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=4)
    return _build(model_cls, config), _lm_batch()


def bert() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("BertConfig", "BertForMaskedLM")
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    ids = _tokens()
    return _build(model_cls, config), {"input_ids": ids, "labels": ids}


def t5() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("T5Config", "T5ForConditionalGeneration")
    config = config_cls(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )
    return _build(model_cls, config), {"input_ids": _tokens(seed=1), "labels": _tokens(shape=(2, 8), seed=2)}


def vit() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("ViTConfig", "ViTForImageClassification")
    config = config_cls(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
        attn_implementation="eager",
    )
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}
    return _build(model_cls, config), batch


def mamba() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("MambaConfig", "MambaForCausalLM")
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, use_mambapy=False, pad_token_id=0, bos_token_id=0,
        eos_token_id=0,
    )
    return _build(model_cls, config), _lm_batch()


def dbrx() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("DbrxConfig", "DbrxForCausalLM")
    # Experts folded into 2-D tensors: w1, v1, w2 are (E * ffn, d) = (4 * 24, 32); fused Wqkv (q, k, v).
    config = config_cls(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0,
        attn_config={"kv_n_heads": 2, "attn_pdrop": 0.0, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
        tie_word_embeddings=False, attn_implementation="eager",
    )
    return _build(model_cls, config), _lm_batch()


def gpt_oss() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("GptOssConfig", "GptOssForCausalLM")
    # Experts stored (E, in, out) with per-expert biases (E, 2I) and (E, d); gate/up interleaved.
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager",
    )
    return _build(model_cls, config), _lm_batch()


def llama4() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Llama4TextConfig", "Llama4ForCausalLM")
    # Every layer MoE: experts (E, d, 2I) stored (in, out) with contiguous gate|up halves, a shared expert.
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=64, tie_word_embeddings=False,
        attention_chunk_size=16, attn_implementation="eager", pad_token_id=0,
    )
    return _build(model_cls, config), _lm_batch()


def modernbert() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("ModernBertConfig", "ModernBertForMaskedLM")
    # Fused Wqkv (q | k | v) and GLU Wi (input | gate halves); tied decoder (the config default).
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, local_attention=8, attention_dropout=0.0, mlp_dropout=0.0,
        embedding_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        attn_implementation="eager",
    )
    ids = _tokens()
    return _build(model_cls, config), {"input_ids": ids, "labels": ids}


def clip() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("CLIPConfig", "CLIPModel")
    # Two towers with projections and a 0-D logit_scale; no LM head. Contrastive loss (return_loss).
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 attention_dropout=0.0)
    config = config_cls(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": 32, "pad_token_id": 0,
                     "bos_token_id": 1, "eos_token_id": 2},
        vision_config={**tower, "image_size": 16, "patch_size": 4, "num_channels": 3},
        projection_dim=16, attn_implementation="eager",
    )
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": _tokens(shape=(4, 8)), "pixel_values": torch.randn(4, 3, 16, 16, generator=g),
             "return_loss": True}
    return _build(model_cls, config), batch


def mamba2() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Mamba2Config", "Mamba2ForCausalLM")
    # in_proj fused (z, x, B, C, dt); A_log, D, dt_bias per head (1-D).
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=1, expand=2,
        num_hidden_layers=2, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True,
    )
    return _build(model_cls, config), _lm_batch()


def qwen3_next() -> tuple[nn.Module, dict]:
    config_cls, model_cls = _classes("Qwen3NextConfig", "Qwen3NextForCausalLM")
    # One Gated-DeltaNet layer (fused in_proj_qkvz / in_proj_ba, depthwise conv1d over q | k | v) and one
    # gated attention layer (q_proj holds query and gate per head); 2 key heads of 4 value heads.
    config = config_cls(
        **MOE, head_dim=8, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
    )
    return _build(model_cls, config), _lm_batch()


ZOO: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma2": gemma2,
    "phi3": phi3,
    "gpt2": gpt2,
    "gpt_neox": gpt_neox,
    "falcon": falcon,
    "opt": opt,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "mamba": mamba,
    "dbrx": dbrx,
    "gpt_oss": gpt_oss,
    "llama4": llama4,
    "modernbert": modernbert,
    "clip": clip,
    "mamba2": mamba2,
    "qwen3_next": qwen3_next,
}
