"""JAX's own Pallas attention kernels as registered implementations.

One file per kernel, each translating the call description into the kernel's terms and
refusing, with a reason, what the kernel cannot serve:

* :mod:`~flax_attn.core.pallas.splash`: ``'splash'``, Splash attention on TPUs;
* :mod:`~flax_attn.core.pallas.triton`: ``'pallas_triton'``, flash attention on GPUs (Triton);
* :mod:`~flax_attn.core.pallas.decode`: ``'pallas_decode'``, one decoding step on GPUs.

Each has a field ``interpret``: ``Splash(interpret=True)`` runs the same kernel through Pallas'
interpreter on any backend, CPU included (slowly): that is how the conformance suite holds
them to the float64 reference on a machine without accelerators. Hopper's
``attention_mgpu`` kernel is not registered: it has no interpreter mode, so it could not be
held to the reference here.
"""
from flax_attn.core.pallas.decode import PallasDecode
from flax_attn.core.pallas.splash import Splash
from flax_attn.core.pallas.triton import PallasTriton

__all__ = ["PallasDecode", "PallasTriton", "Splash"]
