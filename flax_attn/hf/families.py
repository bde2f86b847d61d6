"""Per-family tables: where each Hugging Face family keeps its attention weights and how its
``config.json`` maps onto :class:`~flax_attn.AttentionConfig`.

A :class:`Family` is declarative: the attention modules of each stack (a path template with
``{i}`` for the layer), the names of the projections, how a fused query/key/value projection is
laid out (:data:`FUSED_LAYOUTS`), whether weights are ``Conv1D`` (stored ``(in, out)``), the
QK-norm's weight convention, and a small function from the config to the layer's fields.
A family's ``layer`` says which flax_attn layer it loads into: ``'attention'``
(:class:`~flax_attn.AttentionConfig`, fields as keyword arguments) or ``'mla'``
(:class:`~flax_attn.layers.mla.MLAConfig`, DeepSeek's multi-head latent attention, its weights
under their own Hugging Face names). Per-layer differences are the fields function's business:
Llama 4's RoPE layers (interleaved RoPE, chunked attention, weightless QK-norm) and NoPE layers
(``position='none'``, temperature tuning) are two AttentionConfigs of one model. Families that
need a layer feature flax_attn does not have are listed in :data:`MISSING_FEATURES` (one place;
empty today); loading them raises ``NotImplementedError`` naming it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

# How a fused projection orders its output features, given N query heads, K key/value heads, H.
#   'concat':    [q (N*H) | k (K*H) | v (K*H)]           Phi-3 qkv_proj, GPT-2 c_attn, Falcon multi_query
#   'per_head':  (N, 3, H): each head's q, k, v in turn   GPT-NeoX, BLOOM, Falcon (classic)
#   'per_group': (K, N/K + 2, H): a group's queries, then its key and value   Falcon new_decoder_architecture
FUSED_LAYOUTS = ("concat", "per_head", "per_group")

# Families (model_type) or options needing a layer feature flax_attn lacks: what it is. Empty
# today: DeepSeek-V3 loads into MultiHeadLatentAttention, Llama 4 and Falcon-RW's ALiBi into
# AttentionConfig fields (chunk_size, temperature_tuning, qk_norm_weight, alibi_scaled).
MISSING_FEATURES: dict = {}


@dataclasses.dataclass(frozen=True)
class Stack:
    """One kind of attention module in a model: ``template`` with ``{i}`` for the layer index."""

    stack: str             # 'decoder' | 'encoder'
    kind: str              # 'self' | 'cross'
    template: str          # e.g. 'layers.{i}.self_attn', relative to the checkpoint's root prefix


@dataclasses.dataclass(frozen=True)
class Family:
    """Where a family keeps its attention weights and how its config maps to AttentionConfig."""

    name: str
    model_types: tuple
    stacks: tuple                       # of Stack
    q: str = "q_proj"                   # HF names of the projections (unused ones when fused)
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    fused: Optional[str] = None         # HF name of a fused q/k/v projection
    fused_layout: Optional[Callable] = None  # config -> one of FUSED_LAYOUTS
    conv1d: bool = False                # GPT-2's Conv1D: weights stored (in, out)
    norms: Optional[tuple] = None       # HF names of the QK-norm modules (q, k)
    norm_plus_one: bool = False         # Gemma: the norm weight w is stored zero-centred, applied as (1 + w)
    #                                     (its layers have qk_norm_zero_centered=True; checked on load)
    sinks: Optional[str] = None         # HF name of the attention sinks parameter (gpt-oss: 'sinks')
    t5_table: Optional[str] = None      # T5: the relative bias table, in layer 0 of each stack, shared
    default_root: str = ""              # the root prefix of the usual *ForCausalLM / *ForConditionalGeneration
    positions: str = "cumsum"           # flax_attn.hf.padding convention
    fields: Callable = None             # (config, stack, layer index) -> the layer config's keyword arguments
    missing: Callable = None            # config -> list of MISSING_FEATURES keys this config needs
    layer: str = "attention"            # 'attention' (AttentionConfig) | 'mla' (MLAConfig, weights by HF name)
    probe: Optional[str] = None         # the projection whose weight finds the root prefix (default: fused or q)
    skip_roots: tuple = ()              # root prefixes containing one of these are another tower (vision)


# ----------------------------------------------------------------------------- config readers

def _heads(cfg, *names):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    raise KeyError(f"config has none of {names}")


def _rope_parameters(cfg: dict, layer_type: Optional[str] = None) -> dict:
    """The RoPE parameters of a layer, from the v5 ``rope_parameters`` or the older
    ``rope_theta``/``rope_scaling`` (``rope_local_base_freq`` for Gemma 3's sliding layers)."""
    rp = cfg.get("rope_parameters")
    if rp:
        if all(isinstance(v, dict) for v in rp.values()):  # one dict per layer type
            rp = rp[layer_type or "full_attention"]
        return dict(rp)
    theta = cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0))
    if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    out = dict(cfg.get("rope_scaling") or {})
    out["rope_type"] = out.pop("rope_type", out.pop("type", "default"))
    out["rope_theta"] = theta
    return out


def _partial_rotary_factor(cfg, rp):
    for source in (rp, cfg):
        for key in ("partial_rotary_factor", "rotary_pct"):
            if source.get(key) is not None:
                return float(source[key])
    return 1.0


def rope_fields(cfg: dict, head_dim: int, *, layer_type: Optional[str] = None, layout: str = "rotate_half",
                rotary_dim: Optional[int] = None) -> dict:
    """``rope_theta``, ``rope_layout``, ``rotary_dim`` and ``rope_scaling`` of a layer."""
    rp = _rope_parameters(cfg, layer_type)
    if rotary_dim is None:
        rotary_dim = int(head_dim * _partial_rotary_factor(cfg, rp))
    kind = rp.get("rope_type", "default")
    max_pos = cfg.get("max_position_embeddings")
    original = rp.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
    scaling = None
    if kind == "linear":
        scaling = {"kind": "linear", "factor": float(rp["factor"])}
    elif kind == "dynamic":  # HF grows the base beyond config.max_position_embeddings
        scaling = {"kind": "dynamic", "factor": float(rp["factor"]), "original_max_position_embeddings": max_pos}
    elif kind == "llama3":
        scaling = {"kind": "llama3", "factor": float(rp["factor"]), "original_max_position_embeddings": original,
                   "low_freq_factor": float(rp["low_freq_factor"]), "high_freq_factor": float(rp["high_freq_factor"])}
    elif kind == "yarn":
        factor = rp.get("factor") or max_pos / original
        scaling = {"kind": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
                   "beta_fast": float(rp.get("beta_fast") or 32), "beta_slow": float(rp.get("beta_slow") or 1),
                   "attention_factor": rp.get("attention_factor"), "mscale": rp.get("mscale"),
                   "mscale_all_dim": rp.get("mscale_all_dim"), "truncate": rp.get("truncate", True)}
    elif kind == "longrope":
        factor = rp.get("factor") or max_pos / original
        scaling = {"kind": "longrope", "factor": float(factor), "original_max_position_embeddings": original,
                   "short_factor": tuple(rp["short_factor"]), "long_factor": tuple(rp["long_factor"]),
                   "attention_factor": rp.get("attention_factor")}
    elif kind != "default":
        raise NotImplementedError(f"RoPE type {kind!r} has no flax_attn equivalent "
                                  f"(supported: default, linear, dynamic, llama3, yarn, longrope)")
    return {"position": "rope", "rope_theta": float(rp["rope_theta"]), "rope_layout": layout,
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim, "rope_scaling": scaling}


def _layer_type(cfg, i, default_pattern=None):
    types = cfg.get("layer_types")
    if types:
        return types[i]
    if default_pattern is not None:
        return default_pattern(cfg, i)
    return "full_attention"


def _decoder_fields(cfg, head_dim_key="head_dim", layout="rotate_half", sliding=None, layer_pattern=None):
    """Fields shared by the Llama-like decoders."""

    def fields(cfg, stack, i):
        N = _heads(cfg, "num_attention_heads", "n_head")
        D = _heads(cfg, "hidden_size", "n_embd", "d_model")
        H = cfg.get(head_dim_key) or D // N
        layer_type = _layer_type(cfg, i, layer_pattern)
        out = {"d_model": D, "num_heads": N, "num_kv_heads": cfg.get("num_key_value_heads") or N,
               "head_dim": H, "causal": True}
        out.update(rope_fields(cfg, H, layer_type=layer_type, layout=layout))
        window = sliding(cfg, i, layer_type) if sliding else None
        if window is not None:
            out["sliding_window"] = int(window)
        return out

    return fields


def _window_by_type(cfg, i, layer_type):
    return cfg.get("sliding_window") if layer_type == "sliding_attention" else None


def _mistral_window(cfg, i, layer_type):
    if cfg.get("layer_types"):
        return _window_by_type(cfg, i, layer_type)
    return cfg.get("sliding_window")


def _qwen2_window(cfg, i, layer_type):
    if cfg.get("layer_types"):
        return _window_by_type(cfg, i, layer_type)
    if cfg.get("use_sliding_window") and i >= cfg.get("max_window_layers", 0):
        return cfg.get("sliding_window")
    return None


def _gemma2_pattern(cfg, i):
    return "sliding_attention" if i % 2 == 0 else "full_attention"


def _gemma3_pattern(cfg, i):
    every = cfg.get("sliding_window_pattern", 6)
    return "full_attention" if (i + 1) % every == 0 else "sliding_attention"


def _with(base: Callable, **extra):
    def fields(cfg, stack, i):
        out = base(cfg, stack, i)
        for k, fn in extra.items():
            value = fn(cfg, stack, i) if callable(fn) else fn
            if value is not None:
                out[k] = value
        return out
    return fields


def _gemma_scale(cfg, stack, i):
    return float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")) ** -0.5


def _t5_fields(cfg, stack, i, kind="self"):
    N, D, H = cfg["num_heads"], cfg["d_model"], cfg["d_kv"]
    out = {"d_model": D, "num_heads": N, "head_dim": H, "scale": 1.0, "causal": stack == "decoder"}
    if kind == "cross":
        out.update(position="none", causal=False)
    else:
        out.update(position="t5", t5_num_buckets=cfg.get("relative_attention_num_buckets", 32),
                   t5_max_distance=cfg.get("relative_attention_max_distance", 128))
    return out


def _seq2seq_fields(kind):
    def fields(cfg, stack, i):
        D = cfg["d_model"]
        N = cfg["encoder_attention_heads"] if stack == "encoder" else cfg["decoder_attention_heads"]
        return {"d_model": D, "num_heads": N, "position": "none",
                "causal": stack == "decoder" and kind == "self"}
    return fields


def _gpt2_fields(cfg, stack, i):
    D, N = cfg.get("n_embd", cfg.get("hidden_size")), cfg.get("n_head", cfg.get("num_attention_heads"))
    scale = (D // N) ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
    if cfg.get("scale_attn_by_inverse_layer_idx", False):
        scale /= float(i + 1)
    return {"d_model": D, "num_heads": N, "position": "none", "causal": True, "scale": scale}


def _gptj_fields(cfg, stack, i):
    D, N = cfg.get("n_embd", cfg.get("hidden_size")), cfg.get("n_head", cfg.get("num_attention_heads"))
    H = D // N
    out = {"d_model": D, "num_heads": N, "causal": True}
    out.update(rope_fields(cfg, H, layout="interleaved", rotary_dim=cfg.get("rotary_dim") or H))
    return out


def _bloom_fields(cfg, stack, i):
    D = cfg.get("hidden_size", cfg.get("n_embed"))
    return {"d_model": D, "num_heads": cfg["n_head"], "position": "alibi", "causal": True}


def _falcon_kv(cfg):
    N = cfg.get("num_attention_heads", cfg.get("n_head"))
    if cfg.get("new_decoder_architecture"):
        return cfg.get("num_kv_heads") or N
    return 1 if cfg.get("multi_query", True) else N


def _falcon_fields(cfg, stack, i):
    """Falcon: RoPE (rotate-half), or with ``alibi=True`` (Falcon-RW) ALiBi with BLOOM's slopes
    added to ``q.k`` before the ``1/sqrt(H)`` scale (``alibi_scaled=True``) and no RoPE."""
    D = cfg["hidden_size"]
    N = cfg.get("num_attention_heads", cfg.get("n_head"))
    out = {"d_model": D, "num_heads": N, "num_kv_heads": _falcon_kv(cfg), "causal": True}
    if cfg.get("alibi"):
        out.update(position="alibi", alibi_scaled=True)
    else:
        out.update(rope_fields(cfg, D // N))
    return out


def _falcon_layout(cfg):
    if cfg.get("new_decoder_architecture"):
        return "per_group"
    return "concat" if cfg.get("multi_query", True) else "per_head"


def _optional_qk_norm(flag: str, **fields) -> dict:
    """``_with`` arguments for a QK-norm switched on by the config's boolean ``flag``, with
    ``fields`` and ``eps = layer_norm_eps``; nothing when the flag is off."""
    on = lambda c, s, i: True if c.get(flag) else None
    out = {"qk_norm": on, "qk_norm_eps": lambda c, s, i: c.get("layer_norm_eps", 1e-5) if c.get(flag) else None}
    for name, value in fields.items():
        out[name] = (lambda v: lambda c, s, i: v if c.get(flag) else None)(value)
    return out


# ----------------------------------------------------------------------------- Llama 4

def text_config(cfg):
    """The text model's config: Llama 4's composite ``llama4`` nests it as ``text_config``."""
    if cfg.get("model_type") == "llama4":
        return cfg.get("text_config") or cfg
    return cfg


def _llama4_uses_rope(cfg, i) -> bool:
    """Llama 4's ``no_rope_layers[i]``: 1 = a RoPE layer, 0 = a NoPE layer (default: NoPE every
    ``no_rope_layer_interval``-th layer, as transformers fills it)."""
    flags = cfg.get("no_rope_layers")
    if flags:
        return bool(flags[i])
    return (i + 1) % cfg.get("no_rope_layer_interval", 4) != 0


def _llama4_fields(cfg, stack, i):
    """Llama 4: RoPE layers rotate interleaved pairs (complex multiplication; llama3 scaling),
    attend within chunks of ``attention_chunk_size`` (layer type 'chunked_attention') and, with
    ``use_qk_norm``, L2-normalise q and k per head (no weight; eps = rms_norm_eps); NoPE layers
    attend to everything before them and, with ``attn_temperature_tuning``, scale the queries by
    ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1``."""
    cfg = text_config(cfg)
    N, D = cfg["num_attention_heads"], cfg["hidden_size"]
    H = cfg.get("head_dim") or D // N
    out = {"d_model": D, "num_heads": N, "num_kv_heads": cfg.get("num_key_value_heads") or N, "head_dim": H,
           "causal": True}
    types = cfg.get("layer_types")
    if _llama4_uses_rope(cfg, i):
        out.update(rope_fields(cfg, H, layout="interleaved"))
        layer_type = types[i] if types else "chunked_attention"
        if layer_type == "chunked_attention" and cfg.get("attention_chunk_size"):
            out["chunk_size"] = int(cfg["attention_chunk_size"])
        if cfg.get("use_qk_norm", True):
            out.update(qk_norm=True, qk_norm_weight=False, qk_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)))
    else:
        out["position"] = "none"
        if types and types[i] == "chunked_attention" and cfg.get("attention_chunk_size"):
            out["chunk_size"] = int(cfg["attention_chunk_size"])
        if cfg.get("attn_temperature_tuning", True):
            out["temperature_tuning"] = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
    return out


# ----------------------------------------------------------------------------- DeepSeek (MLA)

def _deepseek_fields(cfg, stack, i):
    """DeepSeek-V3 (and V2) multi-head latent attention: :class:`~flax_attn.layers.mla.MLAConfig`
    keyword arguments. RoPE on the ``qk_rope_head_dim`` part, in interleaved pairs
    (``rope_interleave``, default True; DeepSeek-V2 always) or rotate-half; YaRN's mscale and
    mscale_all_dim travel in ``rope_scaling`` (MLAConfig squares m(factor, mscale_all_dim) into the
    softmax scale, as transformers does). The two RMSNorms (q_a_layernorm, kv_a_layernorm) use
    eps 1e-6 whatever ``rms_norm_eps`` says: transformers and DeepSeek's code build them with
    their default."""
    dr = cfg["qk_rope_head_dim"]
    interleave = True if cfg.get("model_type") == "deepseek_v2" else cfg.get("rope_interleave", True)
    rope = rope_fields(cfg, dr, layout="interleaved" if interleave else "rotate_half", rotary_dim=dr)
    out = {"d_model": cfg["hidden_size"], "num_heads": cfg["num_attention_heads"],
           "kv_lora_rank": cfg["kv_lora_rank"], "qk_nope_head_dim": cfg["qk_nope_head_dim"],
           "qk_rope_head_dim": dr, "v_head_dim": cfg["v_head_dim"], "q_lora_rank": cfg.get("q_lora_rank"),
           "causal": True, "rope_theta": rope["rope_theta"], "rope_layout": rope["rope_layout"],
           "rope_scaling": rope["rope_scaling"], "rms_norm_eps": 1e-6,
           "attention_bias": bool(cfg.get("attention_bias", False))}
    # transformers squares m(factor, mscale_all_dim) into the scale for any non-default RoPE type;
    # MLAConfig does it for YaRN: other types get the scale explicitly.
    rp = _rope_parameters(cfg)
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "yarn") and rp.get("mscale_all_dim"):
        s, a = float(rp["factor"]), float(rp["mscale_all_dim"])
        m = 0.1 * a * math.log(s) + 1.0 if s > 1 else 1.0
        out["scale"] = (cfg["qk_nope_head_dim"] + dr) ** -0.5 * m * m
    return out


LLAMA_LIKE = dict(stacks=(Stack("decoder", "self", "layers.{i}.self_attn"),), default_root="model.")

FAMILIES = (
    Family("llama", ("llama",), **LLAMA_LIKE, fields=_decoder_fields(None)),
    Family("mistral", ("mistral",), **LLAMA_LIKE, fields=_decoder_fields(None, sliding=_mistral_window)),
    Family("qwen2", ("qwen2",), **LLAMA_LIKE, fields=_decoder_fields(None, sliding=_qwen2_window)),
    Family("qwen3", ("qwen3",), **LLAMA_LIKE, norms=("q_norm", "k_norm"),
           fields=_with(_decoder_fields(None, sliding=_qwen2_window), qk_norm=True,
                        qk_norm_eps=lambda c, s, i: c.get("rms_norm_eps", 1e-6))),
    Family("gemma2", ("gemma2",), **LLAMA_LIKE,
           fields=_with(_decoder_fields(None, sliding=_window_by_type, layer_pattern=_gemma2_pattern),
                        scale=_gemma_scale, logit_softcap=lambda c, s, i: c.get("attn_logit_softcapping"))),
    Family("gemma3", ("gemma3_text", "gemma3"), **LLAMA_LIKE, norms=("q_norm", "k_norm"), norm_plus_one=True,
           fields=_with(_decoder_fields(None, sliding=_window_by_type, layer_pattern=_gemma3_pattern),
                        scale=_gemma_scale, qk_norm=True, qk_norm_zero_centered=True,
                        qk_norm_eps=lambda c, s, i: c.get("rms_norm_eps", 1e-6),
                        logit_softcap=lambda c, s, i: c.get("attn_logit_softcapping"))),
    # Cohere's use_qk_norm: LayerNorm without bias over each head, one weight row per head.
    Family("cohere", ("cohere",), **LLAMA_LIKE, norms=("q_norm", "k_norm"),
           fields=_with(_decoder_fields(None, layout="interleaved"), **_optional_qk_norm(
               "use_qk_norm", qk_norm_type="layer", qk_norm_scope="per_head"))),
    # Phi's qk_layernorm: LayerNorm with weight and bias over each head, shared by the heads.
    Family("phi", ("phi",), **LLAMA_LIKE, o="dense", norms=("q_layernorm", "k_layernorm"),
           fields=_with(_decoder_fields(None), **_optional_qk_norm(
               "qk_layernorm", qk_norm_type="layer", qk_norm_bias=True))),
    Family("phi3", ("phi3",), **LLAMA_LIKE, fused="qkv_proj", fused_layout=lambda c: "concat",
           fields=_decoder_fields(None, sliding=_mistral_window)),
    Family("gpt_neox", ("gpt_neox",), stacks=(Stack("decoder", "self", "layers.{i}.attention"),),
           default_root="gpt_neox.", fused="query_key_value", fused_layout=lambda c: "per_head", o="dense",
           fields=_decoder_fields(None)),
    Family("falcon", ("falcon", "RefinedWeb", "RefinedWebModel"), stacks=(Stack("decoder", "self", "h.{i}.self_attention"),),
           default_root="transformer.", fused="query_key_value", fused_layout=_falcon_layout, o="dense",
           fields=_falcon_fields),
    Family("gpt2", ("gpt2",), stacks=(Stack("decoder", "self", "h.{i}.attn"),), default_root="transformer.",
           fused="c_attn", fused_layout=lambda c: "concat", o="c_proj", conv1d=True, fields=_gpt2_fields),
    Family("gptj", ("gptj",), stacks=(Stack("decoder", "self", "h.{i}.attn"),), default_root="transformer.",
           o="out_proj", fields=_gptj_fields),
    Family("bloom", ("bloom",), stacks=(Stack("decoder", "self", "h.{i}.self_attention"),),
           default_root="transformer.", fused="query_key_value", fused_layout=lambda c: "per_head", o="dense",
           fields=_bloom_fields),
    Family("t5", ("t5", "mt5"),
           stacks=(Stack("encoder", "self", "encoder.block.{i}.layer.0.SelfAttention"),
                   Stack("decoder", "self", "decoder.block.{i}.layer.0.SelfAttention"),
                   Stack("decoder", "cross", "decoder.block.{i}.layer.1.EncDecAttention")),
           q="q", k="k", v="v", o="o", t5_table="relative_attention_bias", positions="index",
           fields=lambda c, s, i: _t5_fields(c, s, i)),
    Family("whisper", ("whisper",),
           stacks=(Stack("encoder", "self", "encoder.layers.{i}.self_attn"),
                   Stack("decoder", "self", "decoder.layers.{i}.self_attn"),
                   Stack("decoder", "cross", "decoder.layers.{i}.encoder_attn")),
           o="out_proj", default_root="model.", positions="index", fields=None),
    Family("bart", ("bart", "mbart"),
           stacks=(Stack("encoder", "self", "encoder.layers.{i}.self_attn"),
                   Stack("decoder", "self", "decoder.layers.{i}.self_attn"),
                   Stack("decoder", "cross", "decoder.layers.{i}.encoder_attn")),
           o="out_proj", default_root="model.", positions="index", fields=None),
    # OLMo 2: RMSNorm over the whole query (N*H) and key (K*H) projections, before the head split.
    Family("olmo2", ("olmo2",), **LLAMA_LIKE, norms=("q_norm", "k_norm"),
           fields=_with(_decoder_fields(None), qk_norm=True, qk_norm_scope="projection",
                        qk_norm_eps=lambda c, s, i: c.get("rms_norm_eps", 1e-6))),
    # Llama 4: the text model alone (llama4_text, under 'model.'), or the composite (llama4: its
    # text_config, the language model under 'language_model.model.', the vision tower skipped).
    Family("llama4_text", ("llama4_text",), **LLAMA_LIKE, fields=_llama4_fields),
    Family("llama4", ("llama4",), stacks=LLAMA_LIKE["stacks"], default_root="language_model.model.",
           skip_roots=("vision",), fields=_llama4_fields),
    # DeepSeek-V3 / V2: multi-head latent attention (MultiHeadLatentAttention, HF's weight names).
    Family("deepseek_v3", ("deepseek_v3", "deepseek_v2"), **LLAMA_LIKE, layer="mla", probe="kv_a_proj_with_mqa",
           fields=_deepseek_fields),
    # gpt-oss: a learned sink logit per head; alternating sliding/full layers; YaRN without truncation.
    Family("gpt_oss", ("gpt_oss",), **LLAMA_LIKE, sinks="sinks",
           fields=_with(_decoder_fields(None, sliding=_window_by_type), sinks=True)),
)


def _by_model_type():
    table = {}
    for f in FAMILIES:
        for t in f.model_types:
            table[t] = f
    return table


def family_of(config: dict) -> Family:
    """The :class:`Family` of a Hugging Face config dict (by its ``model_type``)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    table = _by_model_type()
    if model_type not in table:
        raise NotImplementedError(f"no flax_attn.hf family for model_type={model_type!r}; known: {sorted(table)}")
    return table[model_type]


def stack_fields(family: Family, cfg: dict, stack: Stack, i: int) -> dict:
    """The AttentionConfig keyword arguments of layer ``i`` of ``stack``."""
    if family.name in ("whisper", "bart"):
        return _seq2seq_fields(stack.kind)(cfg, stack.stack, i)
    if family.name == "t5":
        return _t5_fields(cfg, stack.stack, i, stack.kind)
    return family.fields(cfg, stack.stack, i)


def check_supported(family: Family, cfg: dict) -> None:
    """Raise ``NotImplementedError`` naming every missing layer feature this config needs."""
    needed = family.missing(cfg) if family.missing else []
    if needed:
        lines = "\n".join(f"  - {key}: {MISSING_FEATURES[key]}" for key in needed)
        raise NotImplementedError(f"model_type={cfg.get('model_type')!r} needs attention features that "
                                  f"flax_attn.AttentionConfig does not have yet:\n{lines}")
