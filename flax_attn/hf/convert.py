"""Hugging Face checkpoints <-> flax_attn attention layers (NumPy only; no torch, no transformers).

:func:`load_attention` reads a ``config.json`` dict and the weights (a safetensors file or a
mapping of names to arrays) and returns every attention layer as an :class:`HFAttention`:
its :class:`~flax_attn.AttentionConfig` and its Flax params. :func:`to_hf_weights` writes
params back under the Hugging Face names. Both are exact: a fused projection is split and
re-fused by index (:func:`fused_indices`), ``nn.Linear`` weights ``(out, in)`` become kernels
``(in, out)`` (``Conv1D`` weights are already ``(in, out)``), norm weights are kept as stored,
the config saying how they apply (Gemma's ``w``, applied as ``1 + w``, loads into a layer with
``qk_norm_zero_centered=True``), each projection has a bias exactly when the checkpoint has one
(Whisper's ``k_proj`` has none: ``qkv_bias=(True, False, True)``), gpt-oss's ``sinks`` become
the layer's ``sinks``, and T5's relative bias table (layer 0 of each stack) is given to each layer.
DeepSeek's multi-head latent attention loads into :class:`~flax_attn.layers.mla.MLAConfig` and
:class:`~flax_attn.layers.mla.MultiHeadLatentAttention`'s params, which carry the Hugging Face
names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``). :meth:`HFAttention.module` builds the right layer.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Optional, Union

import numpy as np

from flax_attn.hf import families as fam
from flax_attn.interop import check_floating_dtype, is_floating
from flax_attn.layers.attention import Attention, AttentionConfig
from flax_attn.layers.mla import MLAConfig, MultiHeadLatentAttention, mla_params


@dataclasses.dataclass(frozen=True)
class HFAttention:
    """One attention layer of a Hugging Face checkpoint.

    Attributes:
      name: the HF module path, e.g. ``'model.layers.3.self_attn'``.
      stack: ``'decoder'`` or ``'encoder'``; kind: ``'self'`` or ``'cross'``; index: the layer.
      config: the layer's :class:`AttentionConfig` (layers of one model may differ: Gemma's
        sliding and global layers, GPT-2's ``scale_attn_by_inverse_layer_idx``, Llama 4's RoPE
        and NoPE layers), or an :class:`~flax_attn.layers.mla.MLAConfig` (DeepSeek).
      params: ``{'q_proj': {'kernel': (D, N*H), 'bias': (N*H,)}, ...}`` NumPy arrays, for
        ``layer.module().apply({'params': params}, ...)``.
    """

    name: str
    stack: str
    kind: str
    index: int
    config: Union[AttentionConfig, MLAConfig]
    params: dict

    def module(self, **kwargs):
        """The Linen layer for :attr:`config`: :class:`~flax_attn.Attention`, or
        :class:`~flax_attn.layers.mla.MultiHeadLatentAttention` for an ``MLAConfig``; ``kwargs``
        (``param_dtype``, ``precision``, ``implementation``) go to its constructor. Both take
        ``(x, positions, segment_ids, ..., cache=)`` and ``config.init_cache(batch, max_len, dtype=)``."""
        cls = MultiHeadLatentAttention if isinstance(self.config, MLAConfig) else Attention
        return cls(self.config, **kwargs)


WeightsLike = Union[str, os.PathLike, Mapping[str, Any]]


INDEX_SUFFIX = ".safetensors.index.json"


def read_weights(weights: WeightsLike) -> dict:
    """Names -> NumPy arrays from a mapping of names to array-likes, a ``.safetensors`` file, a
    sharded checkpoint's index (``model.safetensors.index.json``: each weight read from the shard
    its ``weight_map`` names, and nothing else), or a directory: its index if it has one, else
    its ``*.safetensors`` files, of which no two may hold the same name."""
    if isinstance(weights, Mapping):
        return {name: _as_array(name, value) for name, value in weights.items()}
    path = os.fspath(weights)
    try:
        from safetensors.numpy import load_file  # optional: pip install safetensors
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading a safetensors file needs the safetensors package (pip install safetensors), "
                          "or pass a mapping of names to NumPy arrays") from e
    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise ValueError(f"{path} holds several shard indexes {indexes}: pass the one to read")
        if indexes:
            return _read_index(os.path.join(path, indexes[0]), load_file)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        out, source = {}, {}
        for f in files:
            for name, value in load_file(os.path.join(path, f)).items():
                if name in out:
                    raise ValueError(f"weight {name!r} is in both {source[name]} and {f} in {path} (and no "
                                     f"*{INDEX_SUFFIX} says which to read): remove the stray file")
                out[name], source[name] = value, f
        return out
    if path.endswith(INDEX_SUFFIX):
        return _read_index(path, load_file)
    return dict(load_file(path))


def _read_index(index_path: str, load_file) -> dict:
    """The weights a sharded checkpoint's index lists, each from the shard it names."""
    import json

    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path} has no 'weight_map' (a mapping of weight names to shard files)")
    folder, out = os.path.dirname(index_path), {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(folder, shard)
        if not os.path.exists(shard_path):
            raise FileNotFoundError(f"{index_path} lists shard {shard}, which is not in {folder or '.'}")
        tensors = load_file(shard_path)
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in tensors:
                raise ValueError(f"{index_path} puts {name!r} in {shard}, which does not hold it")
            out[name] = tensors[name]
    return out


def _as_array(name: str, value) -> np.ndarray:
    """A NumPy array of a weight given as an array-like; a torch tensor NumPy cannot take
    (bfloat16, one that requires grad) is a TypeError naming the weight and the fix."""
    try:
        return np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as e:
        raise TypeError(f"weight {name!r} is not an array NumPy can read ({type(e).__name__}: {e}); for a torch "
                        f"state_dict pass {{k: v.detach().float().numpy() ...}}, or the .safetensors files "
                        f"(bfloat16 kept)") from None


def fused_indices(layout: str, N: int, K: int, H: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices into a fused projection's output features of its query, key and value features.

    ``layout`` is one of :data:`flax_attn.hf.families.FUSED_LAYOUTS`; the fused projection has
    ``(N + 2K) * H`` outputs. Splitting takes these indices; fusing scatters to them.
    """
    total = (N + 2 * K) * H
    idx = np.arange(total)
    if layout == "concat":
        return idx[:N * H], idx[N * H:(N + K) * H], idx[(N + K) * H:]
    if layout == "per_head":
        if N != K:
            raise ValueError(f"the per_head layout has one key/value head per query head, got N={N}, K={K}")
        g = idx.reshape(N, 3, H)
        return g[:, 0].ravel(), g[:, 1].ravel(), g[:, 2].ravel()
    if layout == "per_group":
        G = N // K
        g = idx.reshape(K, G + 2, H)
        return g[:, :G].ravel(), g[:, G].ravel(), g[:, G + 1].ravel()
    raise ValueError(f"unknown fused layout {layout!r}; known: {fam.FUSED_LAYOUTS}")


def _root(family: fam.Family, names) -> str:
    """The checkpoint's prefix before the family's module paths ('' , 'model.', ...)."""
    stack = family.stacks[0]
    first = family.probe or family.fused or family.q
    suffix = stack.template.format(i=0) + f".{first}.weight"
    roots = sorted({n[: -len(suffix)] for n in names if n.endswith(suffix)
                    and (len(n) == len(suffix) or n[-len(suffix) - 1] == ".")
                    and not any(skip in n[: -len(suffix)] for skip in family.skip_roots)}, key=len)
    if not roots:
        sample = sorted(names)[:5]
        raise KeyError(f"no '{suffix}' (with any prefix) in the weights: is this a {family.name} checkpoint? "
                       f"first names: {sample}")
    return roots[0]


def _layer_count(root, template, names) -> int:
    pattern = re.compile(re.escape(root + template).replace(r"\{i\}", r"(\d+)") + r"\.")
    found = {int(m.group(1)) for n in names for m in [pattern.match(n)] if m}
    if not found:
        return 0
    if found != set(range(max(found) + 1)):
        raise ValueError(f"layers of {root + template} are not numbered 0..{max(found)}: {sorted(found)} "
                         f"(a missing shard?)")
    return max(found) + 1


# The config keys that declare a stack's layer count, most specific first.
_LAYER_COUNT_KEYS = {"encoder": ("encoder_layers", "num_layers", "num_hidden_layers", "n_layer"),
                     "decoder": ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers")}


def _declared_layers(config: dict, stack) -> tuple[Optional[str], Optional[int]]:
    """The config key declaring ``stack``'s layer count and its value, or ``(None, None)``."""
    text = fam.text_config(config)
    for key in _LAYER_COUNT_KEYS[stack.stack]:
        if isinstance(text.get(key), int):
            return key, text[key]
    return None, None


def _stack_layers(config: dict, stack, root: str, weights) -> int:
    """The layers of ``stack`` to load: those in the weights, which must be the count the config
    declares (DeepSeek's multi-token-prediction layers past it, ``num_nextn_predict_layers``,
    are left out, as transformers leaves them)."""
    count = _layer_count(root, stack.template, weights)
    key, declared = _declared_layers(config, stack)
    if declared is None or count == declared:
        return count
    extra = fam.text_config(config).get("num_nextn_predict_layers") or 0
    if declared < count <= declared + extra:
        return declared
    raise ValueError(f"the config declares {key}={declared} but the weights hold {count} layers of "
                     f"{root + stack.template} (a missing shard, or another model's config?)")


class _Taker:
    """Takes weights by name, remembering which were used (so leftovers can be reported)."""

    def __init__(self, weights):
        self.weights, self.used = weights, set()

    def get(self, name, required=True):
        if name not in self.weights:
            if required:
                raise KeyError(f"missing weight {name!r}")
            return None
        value = self.weights[name]
        dtype = np.asarray(value).dtype
        if not is_floating(dtype):
            raise TypeError(f"weight {name!r} has dtype {dtype}, not a floating dtype")
        self.used.add(name)
        return value


def _linear(w, b, conv1d):
    kernel = np.asarray(w) if conv1d else np.asarray(w).T
    out = {"kernel": np.ascontiguousarray(kernel)}
    if b is not None:
        out["bias"] = np.asarray(b)
    return out


def load_attention(config: dict, weights: WeightsLike, *, dtype=None) -> list[HFAttention]:
    """Every attention layer of a Hugging Face checkpoint, as flax_attn configs and params.

    Args:
      config: the checkpoint's ``config.json`` as a dict (``model_type`` picks the family).
      weights: a ``.safetensors`` path (or a directory of shards), or a mapping of names to
        arrays (e.g. ``{k: v.numpy() for k, v in model.state_dict().items()}``); any root
        prefix (``model.``, ``transformer.``) is found.
      dtype: cast every parameter to this NumPy dtype (default: keep the checkpoint's).

    Returns:
      a list of :class:`HFAttention` in the order of the family's stacks (encoder self,
      decoder self, decoder cross), each stack by layer index.

    Raises:
      NotImplementedError: the family (or an option of its config) needs a layer feature
        flax_attn lacks; the message names it (see ``flax_attn.hf.MISSING_FEATURES``).
      KeyError: a weight the family needs is absent.
      ValueError: a weight's shape does not fit the config, or the weights hold another number of
        layers than the config declares (``num_hidden_layers``, ``n_layer``, ``encoder_layers``, ...).
      TypeError: a weight is not floating-point.
    """
    family = fam.family_of(config)
    fam.check_supported(family, config)
    if dtype is not None:
        dtype = check_floating_dtype(dtype)
    w = read_weights(weights)
    root = _root(family, w)
    take = _Taker(w)
    layers = []
    for stack in family.stacks:
        count = _stack_layers(config, stack, root, w)
        table = None
        if family.t5_table and stack.kind == "self":
            table = take.get(f"{root}{stack.template.format(i=0)}.{family.t5_table}.weight")
        for i in range(count):
            prefix = f"{root}{stack.template.format(i=i)}"
            fields = fam.stack_fields(family, config, stack, i)
            if family.layer == "mla":
                cfg, params = _mla_params(MLAConfig(**fields), prefix, take)
            else:
                extra = {} if table is None else {"rel_bias": {"embedding": np.asarray(table)}}
                cfg, params = _layer_params(family, config, AttentionConfig(**fields), prefix, take, extra)
            if dtype is not None:
                params = _cast(params, dtype)
            layers.append(HFAttention(prefix, stack.stack, stack.kind, i, cfg, params))
    _check_leftovers([layer.name for layer in layers], take)
    return layers


# Tensors a checkpoint may keep inside an attention module that are not parameters: older
# transformers saved GPT-2's, GPT-J's and GPT-NeoX's causal-mask buffers and rotary inv_freq.
_BUFFERS = re.compile(r"\.(bias|masked_bias)$|\.rotary_emb(\.|$)")


def _check_leftovers(prefixes, take: "_Taker") -> None:
    """ValueError listing the weights inside the loaded attention modules that no layer took: a
    QK-norm the config does not enable, a projection it does not know. Weights outside them (the
    MLP, embeddings) are not attention's."""
    def inside(name):  # the part of ``name`` after the attention module holding it, or None
        return next((name[len(p):] for p in prefixes if name.startswith(p + ".")), None)

    left = sorted(n for n in take.weights if n not in take.used and inside(n) is not None
                  and not _BUFFERS.search(inside(n)))
    if left:
        raise ValueError("weights inside the attention modules that the config does not use (a feature the "
                         "config leaves off, e.g. qk-norm, or another model's config?):\n  "
                         + "\n  ".join(f"{n} {tuple(np.shape(take.weights[n]))}" for n in left))


def _cast(tree, dtype):
    return {k: _cast(v, dtype) if isinstance(v, dict) else np.asarray(v, dtype) for k, v in tree.items()}


def _layer_params(family, config, cfg: AttentionConfig, prefix: str, take: _Taker, extra: dict):
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.kv_head_dim
    g = lambda name, required=True: take.get(f"{prefix}.{name}", required)
    sources = {}  # our parameter -> the checkpoint's name, for the shape check's message
    if family.fused:
        fw, fb = g(f"{family.fused}.weight"), g(f"{family.fused}.bias", False)
        fw = np.asarray(fw).T if family.conv1d else np.asarray(fw)  # (out, in)
        expected = ((N + 2 * K) * H, cfg.d_model)
        if fw.shape != expected:
            raise ValueError(f"{prefix}.{family.fused}.weight has shape {fw.shape} (as (out, in)); "
                             f"N={N}, K={K}, H={H}, D={cfg.d_model} need {expected}")
        if fb is not None and np.shape(fb) != expected[:1]:
            raise ValueError(f"{prefix}.{family.fused}.bias has shape {np.shape(fb)}; N={N}, K={K}, H={H} need "
                             f"{expected[:1]}")
        qi, ki, vi = fused_indices(family.fused_layout(config), N, K, H)
        raw = {n: (fw[ix], None if fb is None else np.asarray(fb)[ix]) for n, ix in (("q", qi), ("k", ki), ("v", vi))}
        conv = False
    else:
        raw = {n: (g(f"{getattr(family, n)}.weight"), g(f"{getattr(family, n)}.bias", False)) for n in "qkv"}
        conv = family.conv1d
        sources = {f"{n}_proj/{leaf}": f"{prefix}.{getattr(family, n)}.{theirs}"
                   for n in "qkv" for leaf, theirs in (("kernel", "weight"), ("bias", "bias"))}
    ow, ob = g(f"{family.o}.weight"), g(f"{family.o}.bias", False)
    # Each projection has a bias exactly when the checkpoint has one (Whisper: q and v, not k).
    qkv_bias = tuple(raw[n][1] is not None for n in "qkv")
    params = {f"{n}_proj": _linear(raw[n][0], raw[n][1], conv) for n in "qkv"}
    params["o_proj"] = _linear(ow, ob, family.conv1d)
    cfg = dataclasses.replace(cfg, qkv_bias=qkv_bias, out_bias=ob is not None)  # as the checkpoint has them
    if family.norms and cfg.qk_norm:
        if cfg.qk_norm_zero_centered != family.norm_plus_one:
            raise ValueError(f"{family.name} stores its QK-norm weights "
                             f"{'zero-centred (applied as 1 + w)' if family.norm_plus_one else 'plain'}, but its "
                             f"fields give qk_norm_zero_centered={cfg.qk_norm_zero_centered}")
        for ours, theirs in zip(("q_norm", "k_norm"), family.norms):
            params[ours] = {"scale": np.asarray(g(f"{theirs}.weight"))}  # as stored: the config says how applied
            if cfg.qk_norm_bias:
                params[ours]["bias"] = np.asarray(g(f"{theirs}.bias"))
    if family.sinks:
        params["sinks"] = np.asarray(g(family.sinks))
    params.update(extra)
    sources.update({f"o_proj/{leaf}": f"{prefix}.{family.o}.{theirs}" for leaf, theirs in (("kernel", "weight"),
                                                                                          ("bias", "bias"))})
    _check_shapes(prefix, cfg, params, {ours: (name, take.weights[name]) for ours, name in sources.items()
                                        if name in take.weights})
    return cfg, params


def _mla_params(cfg: MLAConfig, prefix: str, take: _Taker):
    """MultiHeadLatentAttention's params from HF names: ``nn.Linear`` weights transposed into
    kernels, RMSNorm weights as ``scale``; ``attention_bias`` as the checkpoint has it."""
    has_bias = f"{prefix}.kv_a_proj_with_mqa.bias" in take.weights
    cfg = dataclasses.replace(cfg, attention_bias=has_bias)
    params = {}
    for name, spec in mla_params(cfg).items():
        if "scale" in spec:  # an RMSNorm
            params[name] = {"scale": np.asarray(take.get(f"{prefix}.{name}.weight"))}
        else:
            params[name] = _linear(take.get(f"{prefix}.{name}.weight"),
                                   take.get(f"{prefix}.{name}.bias") if "bias" in spec else None, False)
    _check_shapes(prefix, cfg, params)
    return cfg, params


def _has_qk_norm(params) -> bool:
    """Whether a layer's params have a QK-norm."""
    return "q_norm" in params


def _check_shapes(prefix, cfg, params, sources=None):
    """ValueError listing every parameter of ``params`` missing or misshapen for ``cfg`` (an
    AttentionConfig or an MLAConfig); ``sources``: our parameter path -> (the checkpoint's
    name, its array), named beside a misshapen one."""
    sources = sources or {}
    from flax_attn.layers.attention import attention_params
    from flax_attn.layers.common import ParamSpec

    def walk(spec, got, path):
        bad = []
        for k, v in spec.items():
            if k not in got:
                bad.append(f"{path}{k}: missing")
            elif isinstance(v, ParamSpec):
                if tuple(np.shape(got[k])) != tuple(v.shape):
                    name, stored = sources.get(f"{path}{k}", (None, None))
                    source = "" if name is None else f" (the checkpoint's {name}, stored {np.shape(stored)})"
                    bad.append(f"{path}{k}: shape {np.shape(got[k])}{source}, the layer needs {v.shape}")
            else:
                bad += walk(v, got[k], f"{path}{k}/")
        return bad

    mla = isinstance(cfg, MLAConfig)
    bad = walk(mla_params(cfg) if mla else attention_params(cfg), params, "")
    if bad:
        raise ValueError(f"{prefix} does not fit {type(cfg).__name__} {cfg}:\n  " + "\n  ".join(bad))


def to_hf_weights(config: dict, layers, *, root: Optional[str] = None) -> dict:
    """flax_attn params back under Hugging Face names (NumPy arrays, ``(out, in)`` weights).

    Args:
      config: the ``config.json`` dict the layers came from.
      layers: the list from :func:`load_attention` (params may have been changed since), or
        ``[(name, config, params), ...]`` with ``name`` the HF module path.
      root: the checkpoint prefix to write (default: the family's usual one, e.g. ``'model.'``
        for Llama, ``'transformer.'`` for GPT-2); module paths in ``layers`` are re-rooted.

    Returns:
      ``{hf_name: array}`` for the attention weights only. Biases that the family does not
      have (Whisper's ``k_proj``) must be zero and are dropped; T5's shared relative bias table
      is written once per stack and must be equal in every layer of it.
    """
    family = fam.family_of(config)
    root = family.default_root if root is None else root
    out = {}
    templates = {}
    for stack in family.stacks:
        templates[stack.template] = stack
    for item in layers:
        name, cfg, params = (item.name, item.config, item.params) if isinstance(item, HFAttention) else item
        # re-root: find which template (with its layer index) the path ends with
        prefix = None
        for template, stack in templates.items():
            m = re.search(re.escape(template).replace(r"\{i\}", r"(\d+)") + "$", name)
            if m:
                prefix, this_stack, index = root + template.format(i=m.group(1)), stack, int(m.group(1))
                break
        if prefix is None:
            raise ValueError(f"{name!r} is not an attention module path of family {family.name}")
        p = {k: v for k, v in params.items()}
        arr = lambda x: np.asarray(x)
        _check_shapes(name, cfg, p)
        if family.layer == "mla":
            for n, leaves in p.items():
                for leaf, value in leaves.items():
                    hf = f"{prefix}.{n}.{'bias' if leaf == 'bias' else 'weight'}"
                    out[hf] = arr(value).T.copy() if leaf == "kernel" else arr(value)
            continue
        if family.fused:
            N, K, H = cfg.num_heads, cfg.kv_heads, cfg.kv_head_dim
            qi, ki, vi = fused_indices(family.fused_layout(config), N, K, H)
            kernel0 = arr(p["q_proj"]["kernel"])
            fw = np.zeros(((N + 2 * K) * H, cfg.d_model), kernel0.dtype)
            fb = np.zeros(((N + 2 * K) * H,), kernel0.dtype) if "bias" in p["q_proj"] else None
            for n, ix in (("q", qi), ("k", ki), ("v", vi)):
                fw[ix] = arr(p[f"{n}_proj"]["kernel"]).T
                if fb is not None:
                    fb[ix] = arr(p[f"{n}_proj"]["bias"])
            out[f"{prefix}.{family.fused}.weight"] = fw.T.copy() if family.conv1d else fw
            if fb is not None:
                out[f"{prefix}.{family.fused}.bias"] = fb
        else:
            for n in "qkv":
                lin = p[f"{n}_proj"]
                hf = f"{prefix}.{getattr(family, n)}"
                out[f"{hf}.weight"] = arr(lin["kernel"]) if family.conv1d else arr(lin["kernel"]).T.copy()
                if "bias" in lin:
                    if family.name == "whisper" and n == "k":  # params of a qkv_bias=True layer
                        if np.any(arr(lin["bias"]) != 0):
                            raise ValueError(f"{hf}.bias: Whisper's k_proj has no bias, but these params have a "
                                             f"non-zero one (max |b| = {np.abs(arr(lin['bias'])).max():.3g})")
                        continue
                    out[f"{hf}.bias"] = arr(lin["bias"])
        o = p["o_proj"]
        out[f"{prefix}.{family.o}.weight"] = arr(o["kernel"]) if family.conv1d else arr(o["kernel"]).T.copy()
        if "bias" in o:
            out[f"{prefix}.{family.o}.bias"] = arr(o["bias"])
        if family.norms and _has_qk_norm(p):
            for ours, theirs in zip(("q_norm", "k_norm"), family.norms):
                scale = arr(p[ours]["scale"])
                # Written in the family's convention whatever the layer's (1 + w applied either way).
                if cfg.qk_norm_zero_centered and not family.norm_plus_one:
                    scale = scale + 1.0
                elif family.norm_plus_one and not cfg.qk_norm_zero_centered:
                    scale = scale - 1.0
                out[f"{prefix}.{theirs}.weight"] = scale
                if "bias" in p[ours]:
                    out[f"{prefix}.{theirs}.bias"] = arr(p[ours]["bias"])
        if family.sinks and "sinks" in p:
            out[f"{prefix}.{family.sinks}"] = arr(p["sinks"])
        if family.t5_table and "rel_bias" in p:
            key = f"{root}{this_stack.template.format(i=0)}.{family.t5_table}.weight"
            table = arr(p["rel_bias"]["embedding"])
            if key in out and not np.array_equal(out[key], table):
                raise ValueError(f"T5 shares one relative bias table per stack ({key}), but layer {index} of "
                                 f"{this_stack.stack} has a different one")
            out[key] = table
    return out
