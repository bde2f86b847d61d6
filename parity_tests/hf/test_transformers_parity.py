"""flax_attn.hf against Hugging Face transformers' own modules.

Each family's model is built by transformers itself (tiny config, random weights, float64),
its state_dict goes through ``flax_attn.hf.load_attention``, and every attention module's
inputs and outputs are captured with forward hooks while transformers runs: a full pass, a
padded batch (HF ``attention_mask`` -> ``flax_attn.hf.segments_and_positions``) and prefill +
decode steps with transformers' ``DynamicCache`` against flax_attn's ``KVCache``. Outputs on
real tokens are compared at float64 1e-12.

Float32 steps inside the references (stated, measured; see FLOAT32_STEPS):

* Every RoPE family computes its rotary angles in float32 (``position_ids.float() *
  inv_freq.float()``; ``inv_freq`` itself from ``torch.arange(..., dtype=torch.float)``): a
  relative error of about 1e-7 in cos/sin. No option removes it, so the test replaces the
  rotary module's forward by a float64 one (``cos``/``sin`` of torch_ref.modern's float64
  frequencies in the family's layout); ``test_rotary_frequencies_match_transformers`` checks
  transformers' own frequencies and cos/sin against flax_attn's at float32 rounding.
* Some families keep a float32 step no option removes; they are compared at the float32
  tolerance 1e-5 instead, listed with the step in FLOAT32_STEPS (the measured errors are in
  the README).
* A few reference steps are replaced while transformers runs, listed with the reason in
  PATCHED_STEPS: Falcon's bfloat16 ALiBi slopes (measured by test_falcon_alibi_bfloat16_step)
  and DeepSeek's float32 RMSNorms, so those families are held to float64 1e-12.
* Where transformers computes a position from something other than ``position_ids`` (Llama 4's
  temperature tuning: the index in the padded row), POSITION_QUIRKS gives those layers the
  positions transformers uses; the README states the difference.

Multi-head latent attention (DeepSeek) goes through the same code: ``HFAttention.module()``
builds ``MultiHeadLatentAttention`` and its latent cache stands in for the KVCache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install transformers")

import flax_attn as fa  # noqa: E402
import flax_attn.hf as fhf  # noqa: E402
import torch_ref as tr  # noqa: E402
from conftest import TOL, max_rel_error  # noqa: E402
from flax_attn.layers.mla import MLAConfig  # noqa: E402

# Float32 steps inside transformers that no option removes (family -> the step).
FLOAT32_STEPS = {
    "qwen3": "Qwen3RMSNorm (the QK-norm) computes in float32: hidden_states.to(torch.float32)",
    "gemma2": "eager attention (sdpa cannot soft-cap) takes the softmax in float32: softmax(..., dtype=torch.float32)",
    "gemma3": "Gemma3RMSNorm (the QK-norm) computes in float32: self._norm(x.float()) * (1.0 + self.weight.float())",
    "bloom": "BloomAttention takes the softmax in float32: F.softmax(attn_weights, dim=-1, dtype=torch.float32)",
    "cohere": "apply_rotary_pos_emb rotates in float32: q = q.float(); k = k.float()",
    "cohere-qk-norm": "apply_rotary_pos_emb rotates in float32 (as cohere), and CohereLayerNorm (the QK-norm) "
                      "computes in float32: hidden_states.to(torch.float32)",
    "olmo2": "Olmo2RMSNorm (the QK-norm) computes in float32: hidden_states.to(torch.float32)",
    "gptj": "GPTJAttention._attn casts query and key to float32 (query.to(torch.float32)), and its sin/cos table "
            "is float32 (create_sinusoidal_positions: .float())",
    "llama4": "apply_rotary_emb rotates in float32 (xq.float() as complex64), Llama4TextL2Norm (the QK-norm) "
              "computes in float32 (self._norm(x.float())), and the temperature tuning's scales are float32 "
              "(torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0)",
}

# Steps of a reference replaced in the test (family -> [(module, attribute path, replacement name)]):
# * Falcon's build_alibi_tensor rounds the slopes to bfloat16 and multiplies in bfloat16
#   (slopes[..., None].bfloat16() * arange_tensor): the slope, the position (converted to bfloat16
#   for the product) and the product are each rounded to 8 significant bits (relative error up to
#   u = 2^-8 = 3.9e-3 each) at every dtype; exact only for power-of-two slopes (N <= 8 heads, or N a
#   power of two up to 8 plus its extra heads: e.g. 4, 6) and positions up to 256. The test removes that step
#   (float64 slopes, _float64_alibi); test_falcon_alibi_bfloat16_step measures what it costs.
# * DeepseekV3RMSNorm and DeepseekV2RMSNorm (q_a_layernorm, kv_a_layernorm) compute in float32
#   (hidden_states.to(torch.float32)); the test runs the same formula in float64 (_float64_rms_norm).
# * DeepSeek-V2's apply_rotary_emb rotates in complex64 (xq.float()); the test multiplies in
#   complex128 (_float64_complex_rotary).
PATCHED_STEPS = {
    "falcon-alibi": [("transformers.models.falcon.modeling_falcon", "build_alibi_tensor", "_float64_alibi")],
    "deepseek_v3": [("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3RMSNorm.forward",
                     "_float64_rms_norm")],
    "deepseek_v2": [("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2RMSNorm.forward",
                     "_float64_rms_norm"),
                    ("transformers.models.deepseek_v2.modeling_deepseek_v2", "apply_rotary_emb",
                     "_float64_complex_rotary")],
}

# Positions transformers uses that are not position_ids (family -> (which layers, convention)).
# Llama 4's temperature tuning (NoPE layers) scales queries by their index in the padded row plus the
# cached tokens (torch.arange(T) + past_seen_tokens), not by position_ids: a left-padded row's
# scale counts its padding. flax_attn takes the positions it is given; those layers get 'index'
# positions here to reproduce transformers (the rest of the model uses position_ids: 'cumsum').
POSITION_QUIRKS = {
    "llama4": (lambda config: getattr(config, "temperature_tuning", None) is not None, "index"),
}

B, T, PROMPT = 2, 6, 4   # batch, tokens, prompt length of the decode test (then T - PROMPT steps)
VOCAB = 40


def _llama_like(**extra):
    base = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
    base.update(extra)
    return base


# family -> (model class, config class, config kwargs, attention implementation)
SPECS = {
    "llama": ("LlamaModel", "LlamaConfig", _llama_like(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}), "sdpa"),
    "mistral": ("MistralModel", "MistralConfig", _llama_like(sliding_window=3, rope_parameters={
        "rope_type": "default", "rope_theta": 1000.0}), "sdpa"),
    "qwen2": ("Qwen2Model", "Qwen2Config", _llama_like(rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8}), "sdpa"),
    "qwen3": ("Qwen3Model", "Qwen3Config", _llama_like(head_dim=6, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}, max_position_embeddings=4), "sdpa"),
    "gemma2": ("Gemma2Model", "Gemma2Config", _llama_like(num_hidden_layers=2, head_dim=4, sliding_window=3,
                                                           query_pre_attn_scalar=6, attn_logit_softcapping=2.0,
                                                           final_logit_softcapping=None), "eager"),
    "gemma3": ("Gemma3TextModel", "Gemma3TextConfig", _llama_like(
        num_hidden_layers=2, head_dim=4, sliding_window=3, query_pre_attn_scalar=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}}), "sdpa"),
    "phi3": ("Phi3Model", "Phi3Config", _llama_like(
        hidden_size=32, max_position_embeddings=32, pad_token_id=0, original_max_position_embeddings=4, rope_parameters={
            "rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0, 1.5], "long_factor": [2.0, 5.0],
            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 4}), "sdpa"),
    "phi": ("PhiModel", "PhiConfig", _llama_like(partial_rotary_factor=0.5, rope_parameters={
        "rope_type": "default", "rope_theta": 100.0}), "sdpa"),
    "cohere": ("CohereModel", "CohereConfig", _llama_like(pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 100.0}), "sdpa"),
    "cohere-qk-norm": ("CohereModel", "CohereConfig", _llama_like(pad_token_id=0, use_qk_norm=True, rope_parameters={
        "rope_type": "default", "rope_theta": 100.0}), "sdpa"),
    "phi-qk-layernorm": ("PhiModel", "PhiConfig", _llama_like(partial_rotary_factor=0.5, qk_layernorm=True,
                                                              rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 100.0}), "sdpa"),
    "olmo2": ("Olmo2Model", "Olmo2Config", _llama_like(rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 100.0}), "sdpa"),
    "gpt_oss": ("GptOssModel", "GptOssConfig", _llama_like(
        num_hidden_layers=2, head_dim=4, num_local_experts=2, num_experts_per_tok=1, sliding_window=3,
        attention_bias=True, layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}), "eager"),
    "gptj": ("GPTJModel", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=4, rotary_dim=2,
                                              n_positions=32), "eager"),
    "gpt_neox": ("GPTNeoXModel", "GPTNeoXConfig", dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                      "partial_rotary_factor": 0.5}), "sdpa"),
    "falcon": ("FalconModel", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bias=True, alibi=False, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 100.0}), "sdpa"),
    "falcon-multi-query": ("FalconModel", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, new_decoder_architecture=False,
        multi_query=True, bias=False, alibi=False, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "sdpa"),
    "falcon-alibi": ("FalconModel", "FalconConfig", dict(   # Falcon-RW: 16 heads, slopes not powers of two
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=16, new_decoder_architecture=False,
        multi_query=False, parallel_attn=False, bias=True, alibi=True), "sdpa"),
    "llama4": ("Llama4TextModel", "Llama4TextConfig", _llama_like(
        num_hidden_layers=2, head_dim=4, intermediate_size=8, intermediate_size_mlp=8, num_local_experts=2,
        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=3,
        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}), "sdpa"),
    "deepseek_v3": ("DeepseekV3Model", "DeepseekV3Config", _llama_like(
        num_key_value_heads=4, q_lora_rank=6, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
        attention_bias=True, first_k_dense_replace=1, n_routed_experts=2, n_group=1, topk_group=1,
        num_experts_per_tok=1, moe_intermediate_size=8, rope_parameters={
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0}), "sdpa"),
    "deepseek_v2": ("DeepseekV2Model", "DeepseekV2Config", _llama_like(   # V2-Lite style: no q_lora_rank
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=6, first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}), "sdpa"),
    "gpt2": ("GPT2Model", "GPT2Config", dict(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                                              scale_attn_by_inverse_layer_idx=True), "sdpa"),
    "bloom": ("BloomModel", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=4), "eager"),
    "t5": ("T5Model", "T5Config", dict(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=8, num_layers=1, num_heads=4,
                                       relative_attention_num_buckets=8, relative_attention_max_distance=6,
                                       decoder_start_token_id=0), "eager"),
    "bart": ("BartModel", "BartConfig", dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                             encoder_attention_heads=4, decoder_attention_heads=2,
                                             encoder_ffn_dim=8, decoder_ffn_dim=8, max_position_embeddings=32), "sdpa"),
    "whisper": ("WhisperModel", "WhisperConfig", dict(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8, num_mel_bins=4, max_source_positions=6,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0), "sdpa"),
}
SEQ2SEQ = ("t5", "bart", "whisper")


@dataclasses.dataclass
class Built:
    model: object
    config: dict
    layers: list


@functools.lru_cache(maxsize=None)
def build(family) -> Built:
    """One transformers model per family: float64, random weights (biases and norms too)."""
    model_cls, config_cls, kw, impl = SPECS[family]
    cfg = getattr(transformers, config_cls)(**kw)
    cfg._attn_implementation = impl
    if hasattr(cfg, "_experts_implementation"):  # gpt-oss's MoE: the grouped matmul kernels take no float64
        cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(-0.6, 0.6))
    config = cfg.to_dict()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    layers = fhf.load_attention(config, state)
    _float64_rotary(model, family, layers)
    return Built(model, config, layers)


# Rotary modules returning complex factor e^{i angle} per pair (multiplied as complex numbers).
COMPLEX_ROTARY = ("Llama4TextRotaryEmbedding", "DeepseekV2RotaryEmbedding")


def _rope_of(config):
    """(rotary dims, theta, scaling, layout) of a RoPE layer's config (AttentionConfig or MLAConfig), or None."""
    if isinstance(config, MLAConfig):
        return config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, config.rope_layout
    if config.position != "rope":
        return None
    return config.rotary_dim or config.kv_head_dim, config.rope_theta, config.rope_scaling, config.rope_layout


def _emb(module, angles, layout):
    """The per-dim angles a rotary module returns for per-pair ``angles``, in its own layout."""
    name = type(module).__name__
    if name in ("GptOssRotaryEmbedding",) + COMPLEX_ROTARY:  # one angle per pair
        return angles
    if layout == "interleaved" and name != "DeepseekV3RotaryEmbedding":  # Cohere repeats each angle for its pair
        return torch.repeat_interleave(angles, 2, dim=-1)
    return torch.cat((angles, angles), dim=-1)  # DeepSeek too: its interleaved rotation reads the first half


def _float64_rotary(model, family, layers):
    """Replace each rotary module's float32 angles by float64 ones (torch_ref's frequencies)."""
    by_type = {}
    types = getattr(model.config, "layer_types", None)
    for layer in layers:
        if _rope_of(layer.config) is not None:
            by_type[types[layer.index] if types else None] = _rope_of(layer.config)
    if not by_type:
        return
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            def forward(x, position_ids, layer_type=None, _by_type=by_type, _module=module):
                rd, theta, scaling, layout = _by_type[layer_type] if layer_type in _by_type else \
                    next(iter(_by_type.values()))
                scaling = dataclasses.asdict(scaling) if scaling else None
                inv_freq, factor = tr.modern.rope_inv_freq(rd, theta, scaling, int(position_ids.max()) + 1)
                emb = _emb(_module, position_ids[..., None].double() * inv_freq, layout)
                if type(_module).__name__ in COMPLEX_ROTARY:  # complex: factor e^{i angle}
                    return torch.polar(torch.full_like(emb, factor), emb)
                return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
            module.forward = forward


def _float64_alibi(attention_mask, num_heads, dtype):
    """Falcon's build_alibi_tensor without its bfloat16 step: float64 slopes times cumsum positions."""
    slopes = torch.from_numpy(np.asarray(_alibi_slopes(num_heads)))
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * positions.double()
    return alibi.reshape(attention_mask.shape[0] * num_heads, 1, attention_mask.shape[1]).to(dtype)


def _float64_rms_norm(self, hidden_states):
    """DeepseekV3RMSNorm.forward in float64: weight * x / sqrt(mean(x^2) + eps)."""
    x = hidden_states.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def _float64_complex_rotary(xq, xk, freqs_cis):
    """DeepSeek-V2's apply_rotary_emb in complex128: adjacent pairs times e^{i angle}."""
    def rotate(x):
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)
    return rotate(xq), rotate(xk)


def _alibi_slopes(n):
    """ALiBi's head slopes written out (Press et al.): 2^(-8k/p) for the largest power of two
    p <= n, then 2^(-4(2j - 1)/p) for the remaining heads."""
    p = 2 ** int(np.floor(np.log2(n)))
    return [2.0 ** (-8.0 * k / p) for k in range(1, p + 1)] + [2.0 ** (-4.0 * (2 * j - 1) / p)
                                                                 for j in range(1, n - p + 1)]


class Capture:
    """Forward hooks on every attention module: (input, context, output) of each call."""

    def __init__(self, model, layers):
        self.calls = {layer.name: [] for layer in layers}
        self.handles = [model.get_submodule(layer.name).register_forward_hook(self._hook(layer.name), with_kwargs=True)
                        for layer in layers]

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            context = kwargs.get("key_value_states")
            out = output[0] if isinstance(output, tuple) else output
            if type(module).__name__ == "BloomAttention":  # BLOOM adds the residual inside its attention
                out = out - (args[1] if len(args) > 1 else kwargs["residual"])
            self.calls[name].append(tuple(None if a is None else a.detach().numpy().copy() for a in (x, context, out)))
        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _inputs(family, mask):
    """Token ids (and Whisper's features) for a (B, T) mask."""
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(2, VOCAB, mask.shape))
    return ids


def _hf_position_ids(mask):
    """generate()'s position_ids for a padded batch: cumsum - 1, padding 1."""
    m = torch.tensor(mask)
    return (m.cumsum(-1) - 1).masked_fill(m == 0, 1)


def run_hf(family, mask, *, steps=0):
    """Run transformers on a (B, T) 0/1 mask: one pass, or a prefill of T - steps tokens and
    ``steps`` one-token decode steps with a DynamicCache. Returns the captured calls."""
    b = build(family)
    model = b.model
    ids = _inputs(family, mask)
    m = torch.tensor(mask)
    pre = mask.shape[1] - steps
    with Capture(model, b.layers) as cap, torch.no_grad(), _patched(family):
        if family in SEQ2SEQ:
            enc_mask = torch.tensor(np.ones_like(mask) if family == "whisper" else mask)
            if family == "whisper":
                feats = torch.tensor(np.random.default_rng(2).standard_normal((B, 4, 12)))
                enc = model.encoder(feats)
            else:
                enc = model.encoder(input_ids=ids, attention_mask=enc_mask)
            cache = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
            dec = dict(encoder_hidden_states=enc.last_hidden_state, use_cache=True, past_key_values=cache)
            if family != "whisper":
                dec["encoder_attention_mask"] = enc_mask
            model.decoder(input_ids=ids[:, :pre], attention_mask=m[:, :pre], **dec)
            for t in range(pre, mask.shape[1]):
                model.decoder(input_ids=ids[:, t:t + 1], attention_mask=m[:, :t + 1], **dec)
        else:
            pos = _hf_position_ids(mask)
            cache = transformers.DynamicCache()
            model(input_ids=ids[:, :pre], attention_mask=m[:, :pre], position_ids=pos[:, :pre],
                  past_key_values=cache, use_cache=True)
            for t in range(pre, mask.shape[1]):
                model(input_ids=ids[:, t:t + 1], attention_mask=m[:, :t + 1], position_ids=pos[:, t:t + 1],
                      past_key_values=cache, use_cache=True)
    return b, cap.calls


@contextlib.contextmanager
def _patched(family):
    """The reference with the steps of PATCHED_STEPS[family] replaced (nothing for other families)."""
    if family not in PATCHED_STEPS:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module, path, replacement in PATCHED_STEPS[family]:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            stack.enter_context(mock.patch.object(owner, name, globals()[replacement]))
        yield


_JITTED = {}


def _jitted_apply(layer):
    """The layer's jitted ``apply``, one per layer config for the whole module: the full pass,
    padded batch and decode tests of a family share its compilations (eagerly, every op of every
    call shape compiles)."""
    if layer.config not in _JITTED:
        _JITTED[layer.config] = jax.jit(layer.module().apply)
    return _JITTED[layer.config]


def compare(family, mask, *, steps=0):
    """flax_attn on the captured inputs, with the cache when decoding; worst error on real tokens."""
    b, calls = run_hf(family, mask, steps=steps)
    convention = fhf.convention_of(b.config)
    seg, base_pos = (np.asarray(a) for a in fhf.segments_and_positions(mask, convention=convention))
    pos = base_pos
    enc_mask = np.ones_like(mask) if family == "whisper" else mask  # Whisper's encoder has no padding mask
    enc_seg = np.where(enc_mask == 1, 0, -1)
    worst = 0.0
    pre = mask.shape[1] - steps
    quirk_pos = None
    if family in POSITION_QUIRKS:
        quirk_pos = np.asarray(fhf.segments_and_positions(mask, convention=POSITION_QUIRKS[family][1])[1])
    for layer in b.layers:
        apply = _jitted_apply(layer)
        params = {"params": jax.tree_util.tree_map(jnp.asarray, layer.params)}
        got = calls[layer.name]
        pos = quirk_pos if quirk_pos is not None and POSITION_QUIRKS[family][0](layer.config) else base_pos
        if layer.stack == "encoder":
            (x, _, out), = got
            y = apply(params, x, pos, enc_seg)
            worst = max(worst, _err(y, out, enc_mask))
            continue
        cache = None if layer.kind == "cross" else layer.config.init_cache(batch=B, max_len=mask.shape[1],
                                                                           dtype=jnp.float64)
        spans = [(0, pre)] + [(t, t + 1) for t in range(pre, mask.shape[1])]
        assert len(got) == len(spans), f"{layer.name}: {len(got)} calls captured, expected {len(spans)}"
        for (x, context, out), (s, e) in zip(got, spans):
            if layer.kind == "cross":
                y = apply(params, x, pos[:, s:e], seg[:, s:e], context=context,
                                 context_segment_ids=enc_seg, context_positions=None)
            else:
                y, cache = apply(params, x, pos[:, s:e], seg[:, s:e], cache=cache)
            worst = max(worst, _err(y, out, mask[:, s:e]))
    return worst


def _err(ours, theirs, mask):
    real = np.asarray(mask, bool)
    return max_rel_error(np.asarray(ours)[real], np.asarray(theirs)[real])


def _tolerance(family):
    return TOL[np.dtype(np.float32)] if family in FLOAT32_STEPS else TOL[np.dtype(np.float64)]


FULL = np.ones((B, T), np.int64)
PADDED = np.array([[0, 0, 1, 1, 1, 1],    # left padding
                   [1, 1, 1, 1, 1, 0]])   # right padding
LEFT_PADDED = np.array([[0, 0, 1, 1, 1, 1],
                        [1, 1, 1, 1, 1, 1]])


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SPECS))
def test_full_pass(family):
    err = compare(family, FULL)
    assert err <= _tolerance(family), f"{family}: {err:.3e} (float32 step: {FLOAT32_STEPS.get(family)})"


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SPECS))
def test_padded_batch(family):
    err = compare(family, PADDED)
    assert err <= _tolerance(family), f"{family}: {err:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SPECS))
def test_prefill_and_decode(family):
    err = compare(family, LEFT_PADDED, steps=T - PROMPT)
    assert err <= _tolerance(family), f"{family}: {err:.3e}"


@pytest.mark.parametrize("family", sorted(SPECS))
def test_weights_round_trip(family):
    b = build(family)
    state = {k: v.detach().numpy() for k, v in b.model.state_dict().items()}
    back = fhf.to_hf_weights(b.config, b.layers, root="")
    assert back, "nothing written"
    for name, value in back.items():
        assert name in state, f"{name} is not a transformers name"
        np.testing.assert_array_equal(value, state[name], err_msg=name)  # Gemma's w too: held as stored
    attention = {n for n in state if any(n.startswith(layer.name + ".") for layer in b.layers)}
    attention -= {n for n in attention if n.endswith((".attn.bias", ".masked_bias"))}  # GPT-2's old buffers
    assert attention <= set(back), f"not written back: {sorted(attention - set(back))}"


# ----------------------------------------------------------------------------- transformers' RoPE

ROPE_FAMILIES = sorted(f for f in SPECS if f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                                  "phi", "gpt_neox", "falcon", "falcon-multi-query",
                                                  "cohere", "cohere-qk-norm", "phi-qk-layernorm", "olmo2",
                                                  "gpt_oss", "llama4", "deepseek_v3", "deepseek_v2"))


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rotary_module_matches_flax_attn(family):
    """transformers' own rotary module (its class forward: float32 angles, its dynamic/longrope
    switching) against flax_attn's float64 cos/sin, within and beyond the original context:
    agreement to float32 rounding, which is the reason the parity tests replace it."""
    b = build(family)
    types = getattr(b.model.config, "layer_types", None)
    rotary = [m for m in b.model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert len(rotary) == 1
    module = rotary[0]
    worst = 0.0
    for last in (3, 5, 30):  # max position + 1 = 4, 6, 31: around the original contexts of the specs
        pos = torch.arange(last + 1)[None]
        for layer in b.layers:
            if _rope_of(layer.config) is None:  # Llama 4's NoPE layers
                continue
            rd, theta, scaling, layout = _rope_of(layer.config)
            takes_type = "layer_type" in inspect.signature(inspect.unwrap(type(module).forward)).parameters
            kwargs = {"layer_type": types[layer.index]} if types and takes_type else {}
            out = type(module).forward(module, torch.zeros(1, dtype=torch.float64), pos, **kwargs)
            cos, sin = (out.real, out.imag) if torch.is_tensor(out) else out  # COMPLEX_ROTARY: factor e^{i angle}
            inv, factor = fa.rope_frequencies(rd, theta=theta, scaling=scaling, seq_len=last + 1)
            angles = _emb(module, torch.from_numpy(np.arange(last + 1)[:, None] * np.asarray(inv)), layout).numpy()
            worst = max(worst, max_rel_error(cos[0].numpy(), np.cos(angles) * factor),
                        max_rel_error(sin[0].numpy(), np.sin(angles) * factor))
    assert worst <= TOL[np.dtype(np.float32)], f"{family}: {worst:.3e}"


def test_falcon_alibi_bfloat16_step():
    """Falcon's ALiBi tensor, as transformers builds it (bfloat16 slopes times positions, rounded
    to bfloat16), against the exact slope * position: within three bfloat16 roundings (slope,
    position, product: (1 + u)^3 - 1, u = 2^-8) and not exact for 16 heads (slopes 2^(-k/2)) or
    positions beyond 256. With the step
    in place a full pass of the tiny Falcon-RW differs from flax_attn by about 1e-4 (measured
    9.7e-5), far above float64 rounding: the other parity tests remove it (PATCHED_STEPS)."""
    from transformers.models.falcon import modeling_falcon
    mask = torch.ones(1, 300, dtype=torch.long)
    theirs = modeling_falcon.build_alibi_tensor(mask, 16, torch.float64).reshape(16, 300).numpy()
    exact = np.asarray(_alibi_slopes(16))[:, None] * np.arange(300)
    np.testing.assert_allclose(_alibi_slopes(16), fa.alibi_slopes(16), rtol=1e-15)  # flax_attn's slopes
    rel = np.abs(theirs - exact)[:, 1:] / exact[:, 1:]
    u = 2.0 ** -8
    assert rel.max() <= (1 + u) ** 3 - 1, rel.max()
    assert rel.max() > u, rel.max()  # more than one rounding: the step is what the patched tests remove
    np.testing.assert_array_equal(_float64_alibi(mask, 16, torch.float64).reshape(16, 300).numpy(), exact)
    with mock.patch.dict(PATCHED_STEPS, clear=True):  # transformers as it is: the bfloat16 step in place
        err = compare("falcon-alibi", FULL)
    assert 1e-6 < err < 1e-3, f"{err:.3e}"


ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 500.0},
    "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 3.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-deepseek": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                      "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1},
    "yarn-untruncated": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "truncate": False},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.1, 1.5, 2.0, 2.5, 3.0, 4.0, 4.5],
                 "long_factor": [1.2, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 20.0]},
}


@pytest.mark.parametrize("seq_len", [None, 50, 300])
@pytest.mark.parametrize("kind", sorted(ROPE_PARAMETERS))
def test_rope_init_functions_match(kind, seq_len):
    """transformers' ROPE_INIT_FUNCTIONS (float32 frequencies) against flax_attn.positional.rope
    through flax_attn.hf's reading of the same config, at float32 rounding."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                   rope_parameters=dict(ROPE_PARAMETERS[kind]))
    rp = cfg.rope_parameters
    if rp["rope_type"] == "default":
        theirs, factor = 1.0 / (rp["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)), 1.0
    else:
        theirs, factor = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu", seq_len=seq_len)
    fields = fhf.rope_fields(cfg.to_dict(), 16)
    ours, our_factor = fa.rope_frequencies(16, theta=fields["rope_theta"], scaling=fields["rope_scaling"],
                                           seq_len=seq_len)
    assert max_rel_error(ours, theirs.double().numpy()) <= TOL[np.dtype(np.float32)]
    assert abs(our_factor - factor) <= 1e-15 * abs(factor)
