"""Registry of the paper's six architectures plus small CPU presets, built with transformers.

Models are built from config with random initialisation (``from_config``), never from released
weights: the paper pretrains from scratch.

Sources:

* Llama-60M/130M/350M: the GaLore configs (Zhao et al. 2024, ``configs/llama_{60m,130m,350m}.json``),
  which keep ``max_position_embeddings`` at the ``LlamaConfig`` default 2048, untied embeddings,
  vocab 32000 (T5-base tokenizer), ``rms_norm_eps`` 1e-6.
* SmolLM2-135M/360M: ``HuggingFaceTB/SmolLM2-{135M,360M}`` configs (Llama architecture with GQA and
  tied embeddings). We use the *from-scratch pretraining* YAML values ``rope_theta=10000`` and
  ``max_position_embeddings=2048``; the released checkpoints carry 1e5/8192 only because of their
  final long-context training stage, which does not apply to seq-1024 pretraining from scratch.
* Qwen2-0.5B: ``Qwen/Qwen2-0.5B`` config (``Qwen2ForCausalLM``; q/k/v biases are hard-coded in
  transformers' ``Qwen2Attention``, there is no config switch).
* Unique parameter counts: the paper's Table 11 (``paper_params_m``); ``tests/test_models.py`` checks
  that the built models reproduce them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = [
    "ModelSpec",
    "MODELS",
    "PAPER_MODELS",
    "TOKENS_PER_PARAM",
    "get_spec",
    "build_config",
    "build_model",
    "count_unique_params",
    "ATTENTIONS",
]

#: ``attention`` of :func:`build_config`: PyTorch SDPA in the autocast dtype, or SDPA in float32 (see
#: :func:`_sdpa_float32`), by the name each is registered under in transformers' attention interfaces.
ATTENTIONS: dict[str, str] = {"sdpa": "sdpa", "sdpa-float32": "meqmuon_sdpa_float32"}


def _sdpa_float32(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention computed in float32, autocast off, its output in the dtype that
    ``"sdpa"`` returns (the autocast dtype under autocast, else the query's); without autocast and
    with float32 inputs it is ``"sdpa"`` itself.

    Why: on a CPU the backward of SDPA's flash kernel in bf16 is ~5x slower than in float32 (a
    llama-tiny layer, 32 x 4 heads x 128 x 32: 35 ms against 7 ms, forward 2.6 ms against 3.1 ms,
    torch 2.13, ``AVX512+AVX512_BF16+AMX_BF16``), a third of a bf16 ``llama-tiny`` update. Under bf16
    autocast SDPA casts its inputs to bf16 (the rotary embedding has made q and k float32 by then);
    here the softmax and both products stay in float32, at least as accurate as in bf16, and the
    projections around them stay in bf16. docs/benchmarks.md, "Wall time of a 20-update `llama-tiny` run"."""
    dev = query.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else query.dtype
    if out_dtype == torch.float32 and query.dtype == key.dtype == value.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(dev, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(out_dtype), weights


AttentionInterface.register(ATTENTIONS["sdpa-float32"], _sdpa_float32)
AttentionMaskInterface.register(ATTENTIONS["sdpa-float32"], sdpa_mask)

#: Chinchilla-style default budget used by the paper: 20 training tokens per unique parameter.
TOKENS_PER_PARAM = 20


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters of one registry entry.

    ``vocab_size`` is the paper's vocabulary; :func:`build_config` may override it with the
    tokenizer's vocabulary. Special-token ids refer to the paper tokenizer and are dropped by
    :func:`build_config` when they do not fit an overridden vocabulary.
    """

    name: str
    family: str  # "llama" | "smollm2" | "qwen2"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    max_position_embeddings: int
    initializer_range: float
    rms_norm_eps: float
    tokenizer: str | None  # HF hub id of the paper's tokenizer; None -> the built-in BPE
    paper_params_m: float | None  # unique parameters in millions, paper Table 11
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def num_params(self, vocab_size: int | None = None) -> int:
        """Unique parameter count computed analytically (tied embeddings counted once)."""
        v = self.vocab_size if vocab_size is None else vocab_size
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.qkv_bias:
            attn += q_out + 2 * kv_out
        per_layer = attn + 3 * h * f + 2 * h  # gate/up/down projections + two RMSNorm weights
        emb = v * h * (1 if self.tied else 2)
        return emb + self.num_layers * per_layer + h  # + final norm

    def token_budget(self, vocab_size: int | None = None) -> int:
        """Default training-token budget: ``TOKENS_PER_PARAM`` x unique parameters."""
        return TOKENS_PER_PARAM * self.num_params(vocab_size)


def _llama(name: str, layers: int, hidden: int, ffn: int, heads: int, params_m: float | None,
           vocab: int = 32000, tied: bool = False, tokenizer: str | None = "t5-base") -> ModelSpec:
    # T5 tokenizer ids: pad=0, eos=1 (</s>), no BOS token (GaLore feeds no BOS). The built-in BPE
    # (tokenizer=None) has <|endoftext|> = 0 and no pad.
    eos, pad = (1, 0) if tokenizer == "t5-base" else (0, None)
    return ModelSpec(
        name=name, family="llama", hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, vocab_size=vocab, tied=tied,
        qkv_bias=False, rope_theta=10000.0, max_position_embeddings=2048, initializer_range=0.02,
        rms_norm_eps=1e-6, tokenizer=tokenizer, paper_params_m=params_m,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
    )


def _smollm2(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
             params_m: float | None, init: float, vocab: int = 49152,
             tokenizer: str | None = None) -> ModelSpec:
    # SmolLM2 tokenizer: <|endoftext|> = 0 is BOS and EOS; no pad token in the released config.
    return ModelSpec(
        name=name, family="smollm2", hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab, tied=True,
        qkv_bias=False, rope_theta=10000.0, max_position_embeddings=2048, initializer_range=init,
        rms_norm_eps=1e-5, tokenizer=tokenizer, paper_params_m=params_m,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )


def _qwen2(name: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
           params_m: float | None, vocab: int = 151936, tokenizer: str | None = "Qwen/Qwen2-0.5B",
           eos: int | None = 151643) -> ModelSpec:
    return ModelSpec(
        name=name, family="qwen2", hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab, tied=True,
        qkv_bias=True, rope_theta=1e6, max_position_embeddings=131072, initializer_range=0.02,
        rms_norm_eps=1e-6, tokenizer=tokenizer, paper_params_m=params_m,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=None,
    )


# The CPU presets use the built-in byte-level BPE (tokenizer=None, <|endoftext|> = id 0, vocab 4096
# by default); their vocab is normally overridden by the tokenizer's anyway.
_TINY_VOCAB = 4096
_MICRO_VOCAB = 1280
#: ``llama-micro``'s widths: 48 is ``llama-micro`` itself, the others ``llama-micro-w<width>``.
MICRO_WIDTHS: tuple[int, ...] = (24, 48, 96)

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _llama("llama-60m", 8, 512, 1376, 8, 58.074),
        _llama("llama-130m", 12, 768, 2048, 12, 134.106),
        _llama("llama-350m", 24, 1024, 2736, 16, 367.969),
        _smollm2("smollm2-135m", 30, 576, 1536, 9, 3, 134.515, init=1 / math.sqrt(576),
                 tokenizer="HuggingFaceTB/SmolLM2-135M"),
        _smollm2("smollm2-360m", 32, 960, 2560, 15, 5, 361.821, init=0.02,
                 tokenizer="HuggingFaceTB/SmolLM2-360M"),
        _qwen2("qwen2-0.5b", 24, 896, 4864, 14, 2, 494.033),
        # CPU presets (not in the paper): same code paths, ~1M parameters.
        _llama("llama-tiny", 4, 128, 344, 4, None, vocab=_TINY_VOCAB, tokenizer=None),
        _llama("llama-tiny-tied", 4, 128, 344, 4, None, vocab=_TINY_VOCAB, tied=True, tokenizer=None),
        # The horizon comparison's model (issue 39): 20 tokens per parameter on one CPU thread.
        _llama("llama-micro", 4, 48, 128, 4, None, vocab=_MICRO_VOCAB, tokenizer=None),
        # Its width ladder (issue 58: learning-rate transfer across width): same depth, vocabulary and head
        # width (12), MLP 8/3 of the width as llama-micro's 128/48, heads = width / 12.
        *(_llama(f"llama-micro-w{w}", 4, w, w * 8 // 3, w // 12, None, vocab=_MICRO_VOCAB, tokenizer=None)
          for w in MICRO_WIDTHS if w != 48),
        _smollm2("smollm2-tiny", 4, 128, 344, 4, 2, None, init=1 / math.sqrt(128), vocab=_TINY_VOCAB),
        _qwen2("qwen2-tiny", 4, 128, 344, 4, 2, None, vocab=_TINY_VOCAB, tokenizer=None, eos=0),
    ]
}

#: The six architectures of the paper, in Table 11 order.
PAPER_MODELS: tuple[str, ...] = tuple(n for n, s in MODELS.items() if s.paper_params_m is not None)


def get_spec(name: str) -> ModelSpec:
    """Registry lookup; unknown names raise ``ValueError`` listing the valid ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}") from None


def build_config(name: str, vocab_size: int | None = None, attention: str = "sdpa") -> PretrainedConfig:
    """``LlamaConfig`` (llama, smollm2) or ``Qwen2Config`` (qwen2) for a registry entry.

    ``vocab_size`` overrides the registry vocabulary (the harness passes its tokenizer's). Dropout is
    off, the KV cache is off (training only) and attention uses PyTorch SDPA: ``attention="sdpa"`` in
    the autocast dtype, ``"sdpa-float32"`` in float32 (:data:`ATTENTIONS`; the harness's choice for a
    bf16 run on a CPU at <= 256 tokens per sequence, :func:`meqmuon.train.config.attention_of`).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTIONS)}")
    spec = get_spec(name)
    vocab = spec.vocab_size if vocab_size is None else int(vocab_size)

    def fit(token_id: int | None) -> int | None:  # paper ids may not exist in an overridden vocab
        return token_id if token_id is not None and token_id < vocab else None

    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=spec.rms_norm_eps,
        use_cache=False,
        tie_word_embeddings=spec.tied,  # explicit: Qwen2Config defaults to untied
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        attention_dropout=0.0,
        bos_token_id=fit(spec.bos_token_id),
        eos_token_id=fit(spec.eos_token_id),
        pad_token_id=fit(spec.pad_token_id),
    )
    if spec.family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    else:
        cfg = LlamaConfig(**common, head_dim=spec.head_dim, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = ATTENTIONS[attention]
    return cfg


def build_model(
    name: str,
    vocab_size: int | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    attention: str = "sdpa",
) -> PreTrainedModel:
    """Randomly initialised causal LM for a registry entry.

    ``device="meta"`` builds the module structure without allocating weights (used to count
    parameters of the large models cheaply). ``seed`` seeds the global torch RNG before init, so the
    same seed gives the same weights. ``attention``: see :func:`build_config`.
    """
    cfg = build_config(name, vocab_size, attention)
    cls = Qwen2ForCausalLM if get_spec(name).family == "qwen2" else LlamaForCausalLM
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    if model.config.tie_word_embeddings:  # post_init ties; make sure the tie survived
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model.to(dtype=dtype)


def count_unique_params(model: torch.nn.Module) -> int:
    """Number of parameters, counting each tensor once (tied embeddings are one tensor)."""
    # ``named_parameters`` de-duplicates by identity by default, so shared tensors appear once.
    return sum(p.numel() for _, p in model.named_parameters())
