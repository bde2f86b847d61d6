"""The attention core: one description of a call, a registry of implementations.

* :mod:`~flax_attn.core.mask`: the mask description (every masking rule, composable with ``&``);
* :mod:`~flax_attn.core.call`: validation of the arguments into one :class:`Call`;
* :mod:`~flax_attn.core.numerics`: the logit pipeline, grouped-query fold, masked softmax, dropout;
* :mod:`~flax_attn.core.registry`: implementations and the automatic choice;
* one file per implementation: :mod:`~flax_attn.core.xla` (plain, serves everything),
  :mod:`~flax_attn.core.blockwise` (flash-style, linear memory), :mod:`~flax_attn.core.query_blocks`
  (blocks of queries against their whole key range; the CPU choice at moderate lengths),
  :mod:`~flax_attn.core.key_blocks` (key blocks up to the filled length; the CPU choice for
  decoding over a KV cache), :mod:`~flax_attn.core.native` (a compiled CPU kernel: the CPU choice for
  the float32 calls it serves),
  :mod:`~flax_attn.core.cudnn`,
  and JAX's Pallas kernels in :mod:`~flax_attn.core.pallas` (splash, pallas_triton, pallas_decode);
* :mod:`~flax_attn.core.attention`: :func:`dot_product_attention`.
"""
from flax_attn.core import mask, registry
from flax_attn.core.attention import dot_product_attention
from flax_attn.core.blockwise import Blockwise
from flax_attn.core.call import Call
from flax_attn.core.cudnn import CuDNN
from flax_attn.core.key_blocks import KeyBlocks
from flax_attn.core.mask import Mask
from flax_attn.core.native import CpuNative
from flax_attn.core.numerics import dropout, masked_softmax
from flax_attn.core.pallas import PallasDecode, PallasTriton, Splash
from flax_attn.core.query_blocks import QueryBlocks
from flax_attn.core.registry import Implementation, Result
from flax_attn.core.tuning import keep_host_memory
from flax_attn.core.xla import XLA

# The automatic choice tries these in order; the plain path serves everything and stays last.
registry.register(XLA())
registry.register(CuDNN())
registry.register(Blockwise())
# JAX's Pallas kernels (TPU: splash; GPU: the decoding kernel for one query, cuDNN, then Triton)
registry.register(PallasDecode(), before="cudnn")
registry.register(Splash(), before="blockwise")
registry.register(PallasTriton(), before="blockwise")
# On CPU: query blocks where their key ranges are known at trace time and the unrolled program stays small
registry.register(QueryBlocks(), before="blockwise")
# On CPU: few queries against a key axis mostly unused at run time (a decoding step over a KV cache)
registry.register(KeyBlocks(), before="query_blocks")
# On x86-64 CPUs with AVX-512: the compiled kernel, first for the float32 calls it serves
registry.register(CpuNative(), before="key_blocks")

__all__ = ["Blockwise", "Call", "CpuNative", "CuDNN", "Implementation", "KeyBlocks", "Mask", "PallasDecode", "PallasTriton", "QueryBlocks", "Result", "Splash",
           "XLA", "dot_product_attention", "dropout", "keep_host_memory", "mask", "masked_softmax", "registry"]
