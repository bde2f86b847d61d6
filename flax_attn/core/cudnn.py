"""cuDNN's fused attention on NVIDIA GPUs, through ``jax.nn.dot_product_attention``."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from flax_attn.core.registry import Implementation, Result


@dataclasses.dataclass(frozen=True)
class CuDNN(Implementation):
    """bfloat16/float16; H == Hv, a multiple of 8 up to 128; causal (T == S) or no mask, a bias."""

    name: str = "cudnn"

    def runs_on(self, platform: str) -> bool:
        return platform == "gpu"

    def supports(self, call) -> Optional[str]:
        m = call.mask
        if not self.runs_on(call.platform):
            return f"the '{call.platform}' backend (cuDNN needs an NVIDIA GPU)"
        if call.dropout_rate > 0.0:
            return "dropout (use implementation='xla' or None)"
        if call.return_weights:
            return "return_weights (use implementation='xla' or None)"
        if np.dtype(call.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
            return f"dtype {np.dtype(call.dtype)} (cuDNN takes bfloat16 or float16)"
        if call.precision not in (None, "default", "DEFAULT", jax.lax.Precision.DEFAULT):
            return f"precision={call.precision!r} (cuDNN computes in its own fixed precision)"
        if call.H != call.Hv or call.H % 8 or call.H > 128:
            return f"head dims H={call.H}, Hv={call.Hv} (cuDNN needs H == Hv, a multiple of 8, at most 128)"
        for present, what in ((call.softcap is not None, "logit_softcap"), (m.dense is not None, "a boolean mask"),
                              (m.q_positions is not None, "explicit positions"),
                              (m.q_segments is not None, "segment ids"),
                              (m.q_lengths is not None or m.kv_lengths is not None, "sequence lengths"),
                              (m.window is not None, "local_window_size"), (m.chunk is not None, "chunked attention"),
                              (bool(m.mask_mods), "a mask_mod"), (m.score_mod is not None, "a score_mod")):
            if present:
                return what
        if m.causal and call.T != call.S:
            return f"causal attention with T={call.T} != S={call.S} (cuDNN aligns the mask differently)"
        return None

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        out = jax.nn.dot_product_attention(query, key, value, call.mask.bias, is_causal=call.mask.causal,
                                           scale=call.scale, implementation="cudnn",
                                           return_residual=call.return_residual)
        if call.return_residual:
            out, lse = out
            return Result(out=out, lse=lse)
        return Result(out=out)
