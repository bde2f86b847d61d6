"""torch_ref: PyTorch references for flax_attn.

The seeds' originals (``torch_ref.chapter``, ``torch_ref.basics``, ``torch_ref.transformer``)
behave exactly as the chapter's code, so ``torch.manual_seed`` reproduces its printed
numbers.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch

from torch_ref import basics
from torch_ref.chapter import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    count_parameters,
)
from torch_ref.transformer import MultiHeadAttention as TransformerMultiHeadAttention
from torch_ref.transformer import create_causal_mask, positional_encoding, scaled_dot_product_attention


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU NumPy copy of ``tensor``, bit for bit; bfloat16 becomes ``ml_dtypes.bfloat16``."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return tensor.numpy().copy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch tensor of ``array``, bit for bit (``ml_dtypes.bfloat16`` becomes bfloat16)."""
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array).copy())


def state_dict_to_numpy(state_dict) -> dict[str, np.ndarray]:
    """``module.state_dict()`` as NumPy arrays, the form ``flax_attn.from_torch_state_dict`` takes."""
    return {name: to_numpy(t) for name, t in state_dict.items()}


def twin(module) -> torch.nn.Module:
    """A fresh PyTorch twin of the flax_attn ``module`` (float32, initialised by torch's RNG).

    The class and its constructor arguments come from the module's record in
    ``flax_attn.interop``'s twin registry (``flax_attn.interop.twin_of``), e.g.
    ``twin(flax_attn.Attention(config))`` is ``torch_ref.modern.Attention(**fields of config)``.
    """
    from flax_attn import interop

    record = interop.twin_of(module)
    module_name, _, class_name = record.torch.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**record.kwargs(module))


def state_dict_from_numpy(arrays) -> dict[str, torch.Tensor]:
    """NumPy arrays (``flax_attn.to_torch_state_dict``'s output) for ``module.load_state_dict``."""
    return {name: from_numpy(a) for name, a in arrays.items()}


__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "TransformerMultiHeadAttention",
    "basics",
    "count_parameters",
    "create_causal_mask",
    "from_numpy",
    "positional_encoding",
    "scaled_dot_product_attention",
    "state_dict_from_numpy",
    "state_dict_to_numpy",
    "to_numpy",
    "twin",
]

from torch_ref import modern  # noqa: E402  (the modern variants' references)
from torch_ref import mla  # noqa: E402  (multi-head latent attention)
from torch_ref import flex  # noqa: E402  (user mask_mod / score_mod rules, sinks, chunked attention)
