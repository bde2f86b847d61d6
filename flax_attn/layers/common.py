"""Shared building blocks for the modules: PyTorch-equivalent initialisation, dropout plumbing."""
from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_attn import _checks


def uniform_init(low: float, high: float):
    """Initializer drawing from U[low, high)."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, low, high)

    return init


def linear(features: int, fan_in: int, *, use_bias: bool = True, param_dtype: Any = jnp.float32,
           dtype: Any = None, precision: Any = None, name: Optional[str] = None) -> nn.Dense:
    """``nn.Dense`` initialised like PyTorch's ``nn.Linear``: kernel and bias U(-1/sqrt(in), 1/sqrt(in)).

    Its ``kernel`` is ``(in, out)``: PyTorch's ``weight`` transposed.
    """
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Dense(
        features,
        use_bias=use_bias,
        kernel_init=uniform_init(-bound, bound),
        bias_init=uniform_init(-bound, bound),
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        name=name,
    )


def dropout_rng(module: nn.Module, rate: float, deterministic: Optional[bool], owner: str):
    """The PRNG key for attention dropout, or None when dropout is off.

    ``deterministic`` must be given when ``rate > 0``: randomness is never implicit.
    """
    _checks.check_rate(f"{owner} dropout", rate)
    if rate == 0.0:
        return None
    if deterministic is None:
        raise ValueError(
            f"{owner} has dropout={rate}: pass deterministic=True (no dropout) or "
            f"deterministic=False with rngs={{'dropout': key}} to apply"
        )
    if deterministic:
        return None
    return module.make_rng("dropout")


def check_tokens(owner: str, x, d_in: int, context_length: Optional[int] = None) -> None:
    """``x`` must be ``(B, T, d_in)`` with ``T <= context_length``."""
    _checks.check_rank(f"{owner} input x", x, 3, "(batch, num_tokens, d_in)")
    if x.shape[-1] != d_in:
        raise ValueError(f"{owner} input x has shape {x.shape}: its last dim must be d_in={d_in}")
    if context_length is not None and x.shape[1] > context_length:
        raise ValueError(
            f"{owner} input x has {x.shape[1]} tokens (shape {x.shape}), more than "
            f"context_length={context_length}"
        )
