"""flax_attn's benchmark suite: one command, every contender measured side by side in one run.

    python -m benchmarks.run              # full suite (CPU: float32; NVIDIA GPU: bfloat16, detected)
    python -m benchmarks.run --smoke      # tiny sizes, one repeat, one process: checks that everything runs
    python -m benchmarks.run --huge-pages # the same, glibc's malloc asking for 2 MiB pages (Linux)

1. The GPT-2-small layer (batch 8, context 1024, model dim 768, 12 heads, causal): flax_attn's
   MultiHeadAttention with each implementation, the chapter's layer in torch_ref, a PyTorch
   layer on F.scaled_dot_product_attention (the peer), a Flax layer on
   jax.nn.dot_product_attention, and Flax's nn.MultiHeadDotProductAttention; where
   flax_attn.core.tuning.cpu_compiler_options() has XLA compile options for this CPU,
   flax_attn's layer compiled by fa.jit (with them) as well; on CPU, flax_attn's layer with its
   large projections in the form this CPU does not take by default (flax_attn.projections_as:
   'dot' where tuning.projections_as_convolutions() holds, else 'convolution'). Forward and
   forward+backward (gradients of the input and every parameter), compiled, warm-up excluded,
   median over repeats taken in turns (contender by contender, repeat by repeat).
2. A length sweep of the attention core (1 sequence, 8 heads of 64, causal, 1k to 64k tokens):
   time and peak memory, each point in a fresh process: the peak resident memory of the timed
   runs above the memory held before them (inputs made, JAX program compiled; on Linux the
   peak is reset through /proc/self/clear_refs), and for JAX also XLA's own estimate of the
   program's temporaries and outputs. Points whose program would need more memory than the
   machine has are not run; the estimate is reported instead. On CPU, beyond 8k tokens each
   point is timed once, without a warm-up run.
3. KV-cache decoding with flax_attn.Attention (768 wide, 12 heads, RoPE): time per generated
   token with the cache (``fa.decode_step``) against recomputing the whole prefix, after a
   1024-token prefix; and one
   decoding step (``fa.decode_step``) against PyTorch eager with a preallocated cache, batch 1
   and 8, prefixes 1k and 8k, 1k in a cache of 8k slots, and chunks of 32 tokens a step
   there (:mod:`benchmarks.decode`); and an
   absorbed multi-head latent attention step against PyTorch eager (:mod:`benchmarks.decode_mla`);
   each of those steps timed cold, after a read that evicts the CPU's caches (as in a model of
   many layers; :mod:`benchmarks.decode` says why).

Writes benchmarks/results/<machine>.json and .png, and prints the tables. No assertions: the
ratios are printed; targets are judged by reading them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks import cpu

RESULTS = Path(__file__).resolve().parent / "results"
SWEEP_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


# --------------------------------------------------------------------------- the machine

# Dense bfloat16 tensor-core rates from NVIDIA's datasheets (TFLOP/s), by device-name prefix;
# first match wins. The run also measures a matmul rate, the ceiling it reports fractions of.
DATASHEET_BF16_TFLOPS = (("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200 NVL", 835.0),
                         ("NVIDIA H100", 989.0), ("NVIDIA H200", 989.0))


def machine() -> dict:
    import jax
    import torch

    if jax.default_backend() not in ("cpu", "gpu"):
        sys.exit(f"JAX runs on '{jax.default_backend()}': this suite compares with PyTorch on the same device, "
                 f"CPU or CUDA GPU only; time flax_attn's implementations there with "
                 f"benchmarks.run.layer_implementations and time_in_turns")
    gpu = jax.default_backend() == "gpu"
    if gpu and not torch.cuda.is_available():
        sys.exit("JAX runs on a GPU but this torch has no CUDA: install a CUDA build of torch so that both "
                 "frameworks are measured on the same device")
    info = {
        "backend": "gpu" if gpu else "cpu",
        "device": torch.cuda.get_device_name() if gpu else cpu.kind(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "dtype": "bfloat16" if gpu else "float32",
        "date": time.strftime("%Y-%m-%d"),
        "load_average_at_start": _load(),
        "free_page_reporting_bytes": free_page_reporting(),
        "environment": cpu.environment(),
    }
    info["name"] = (f"gpu-{info['device'].replace(' ', '-').lower()}" if gpu else f"cpu-{cpu.slug()}") + \
        f"-{info['cpu_count']}cores"
    if gpu:
        info["datasheet_bf16_tflops"] = next((t for prefix, t in DATASHEET_BF16_TFLOPS
                                              if info["device"].startswith(prefix)), None)
    return info


def _load() -> Optional[list]:
    """1, 5 and 15-minute load averages (Unix), or None: a busy machine makes every figure noisier."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# --------------------------------------------------------------------------- timing

def _sync(out):
    import jax
    import torch

    jax.block_until_ready(out)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def time_in_turns(fns: dict, repeats: int, warmup: int = 2, before=None) -> dict:
    """Median seconds of each zero-argument function, timed in turns: every round runs each
    function once, in a new random order (so that no contender always follows the same one).
    ``before()``, if given, runs before each timed call, outside its time."""
    for fn in fns.values():
        for _ in range(warmup):
            _sync(fn())
    samples = {name: [] for name in fns}
    order = np.random.default_rng(0)
    names = list(fns)
    for _ in range(repeats):
        for name in order.permutation(names):
            fn = fns[name]
            if before is not None:
                before()
            start = time.perf_counter()
            _sync(fn())
            samples[name].append(time.perf_counter() - start)
    return {name: float(np.median(s)) for name, s in samples.items()}


# --------------------------------------------------------------------------- 1. GPT-2-small layer

def gpt2_layer(cfg: dict, repeats: int, gpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa
    import torch_ref
    from flax_attn.core import tuning
    from benchmarks.peers import FlaxMultiHeadDotProductAttention, JaxNNMultiHeadAttention, TorchSDPAMultiHeadAttention

    B, T, D, N = cfg["batch"], cfg["context"], cfg["d_model"], cfg["heads"]
    jdtype = jnp.bfloat16 if gpu else jnp.float32
    tdtype = torch.bfloat16 if gpu else torch.float32
    device = "cuda" if gpu else "cpu"
    x_np = np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32)
    contenders = {}

    def jax_contender(module, label, jit=jax.jit):
        x = jnp.asarray(x_np, jdtype)
        params = module.init(jax.random.key(0), x[:, :8])
        fwd = jit(lambda p, x: module.apply(p, x))
        loss = lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32))
        bwd = jit(jax.grad(loss, argnums=(0, 1)))
        contenders[label] = (lambda: fwd(params, x), lambda: bwd(params, x))

    impls, declined = layer_implementations(B, T, N, D // N, jdtype, jax.default_backend())
    for name, reason in declined.items():
        print(f"  flax_attn MultiHeadAttention ({name}): not timed, it does not support {reason}")
    for impl in impls + [None]:
        label = f"flax_attn MultiHeadAttention ({impl or 'auto: ' + _auto_choice(B, T, N, D // N, jdtype)})"
        mha = fa.MultiHeadAttention(D, D, T, 0.0, N, param_dtype=jdtype, implementation=impl)
        jax_contender(_Deterministic(mha), label)
    mha = fa.MultiHeadAttention(D, D, T, 0.0, N, param_dtype=jdtype)
    if tuning.cpu_compiler_options():  # where this CPU has compile options of its own: fa.jit's program
        jax_contender(_Deterministic(mha), "flax_attn MultiHeadAttention (auto), compiled by fa.jit", fa.jit)
    if not gpu:  # the projections in the form this CPU does not take by default (layers.common.dense)
        other = "dot" if tuning.projections_as_convolutions() else "convolution"
        jax_contender(_Deterministic(mha), f"flax_attn MultiHeadAttention (auto), projections as {other}s",
                      _jit_with_projections_as(other))
    jax_contender(_FusedProjections(mha), "flax_attn MultiHeadAttention (auto), one fused QKV matmul")
    jax_contender(JaxNNMultiHeadAttention(D, N, dtype=jdtype), "Flax layer on jax.nn.dot_product_attention")
    jax_contender(FlaxMultiHeadDotProductAttention(D, N, dtype=jdtype), "flax.linen.MultiHeadDotProductAttention")

    def torch_contender(module, label):
        module = module.to(device=device, dtype=tdtype)
        x = torch.from_numpy(x_np).to(device=device, dtype=tdtype)
        xg = x.clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                return module(x)

        def bwd():
            module.zero_grad(set_to_none=True)
            xg.grad = None
            module(xg).float().sum().backward()
            return xg.grad

        contenders[label] = (fwd, bwd)

    torch.manual_seed(0)
    torch_contender(TorchSDPAMultiHeadAttention(D, N), PEER)
    torch_contender(torch_ref.MultiHeadAttention(D, D, T, 0.0, N), TORCH_REF)

    rows = []
    flops = layer_flops(cfg)
    for mode, index in (("forward", 0), ("forward+backward", 1)):
        load = _load()
        times = time_in_turns({name: fns[index] for name, fns in contenders.items()}, repeats)
        for name, t in times.items():
            framework = "torch" if name in (PEER, TORCH_REF) else "jax"
            rows.append({"layer": name, "mode": mode, "seconds": t, "ratio_to_peer": t / times[PEER],
                         "framework": framework, "gflops": flops[mode] / t / 1e9,
                         "load_average_before": load, "load_average_after": _load()})
    return rows


def _jit_with_projections_as(form: str):
    """``jax.jit`` whose trace writes the layers' large projections as ``form``
    (``flax_attn.projections_as``)."""
    import jax

    import flax_attn as fa

    def jit(f):
        def traced(*args):
            with fa.projections_as(form):
                return f(*args)
        return jax.jit(traced)
    return jit


PEER = "PyTorch layer on F.scaled_dot_product_attention (peer)"
TORCH_REF = "torch_ref MultiHeadAttention (the chapter's)"


def layer_flops(cfg: dict) -> dict:
    """Model FLOPs of the causal layer: four D x D projections and the causal half of QK^T and
    PV; the backward pass counted as twice the forward."""
    B, T, D = cfg["batch"], cfg["context"], cfg["d_model"]
    forward = 4 * 2 * B * T * D * D + 2 * B * T * T * D
    return {"forward": forward, "forward+backward": 3 * forward}


class _Deterministic:
    """Adapter: call a dropout-capable flax_attn module with deterministic=True."""

    def __init__(self, module):
        self.module = module

    def init(self, key, x):
        return self.module.init(key, x, deterministic=True)

    def apply(self, params, x):
        return self.module.apply(params, x, deterministic=True)


class _FusedProjections(_Deterministic):
    """The chapter's layer with its Q/K/V projections as one matmul on the kernels concatenated
    at call time (the module itself runs three): the alternative measured."""

    def apply(self, params, x):
        import jax.numpy as jnp

        import flax_attn as fa
        from flax_attn.layers.common import dense

        m, p = self.module, params["params"]
        b, t, _ = x.shape
        names = ("W_query", "W_key", "W_value")
        fused = {"kernel": jnp.concatenate([p[n]["kernel"] for n in names], axis=-1)}
        qkv = dense(fused, x, m.precision).reshape(b, t, 3, m.num_heads, m.head_dim)
        ctx = fa.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                       precision=m.precision, implementation=m.implementation)
        return dense(p["out_proj"], ctx.reshape(b, t, m.d_out), m.precision)


def _layer_call(B, T, N, H, dtype, platform=None):
    """The description of the layer's causal self-attention call (shapes only)."""
    import jax

    from flax_attn.core.call import describe

    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    return describe(q, q, q, is_causal=True, platform=platform)


def _auto_choice(B, T, N, H, dtype) -> str:
    """The implementation the automatic choice takes for this causal self-attention call."""
    from flax_attn.core import registry

    return registry.choose(_layer_call(B, T, N, H, dtype)).name


def layer_implementations(B, T, N, H, dtype, platform: str) -> tuple[list, dict]:
    """Every registered implementation that runs on ``platform`` ('cpu', 'gpu', 'tpu'), split
    into those that serve the layer's causal self-attention call (timed, by name) and those
    that decline it (name -> the reason they give), e.g. the decode kernel, which takes one
    query per call."""
    from flax_attn.core import registry

    call = _layer_call(B, T, N, H, dtype, platform)
    served, declined = [], {}
    for impl in registry.available(platform):
        reason = impl.supports(call)
        if reason is None:
            served.append(impl.name)
        else:
            declined[impl.name] = reason
    return served, declined


# --------------------------------------------------------------------------- 2. length sweep

def sweep_point(impl: str, T: int, mode: str, repeats: int, heads: int = 8, head_dim: int = 64) -> dict:
    """One point, run in this process: seconds and peak memory above the baseline (GiB)."""
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa

    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, T, heads, head_dim)).astype(np.float32) for _ in range(3)]
    result = {"impl": impl, "T": T, "mode": mode}
    if impl == "torch SDPA":
        dev, dt = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
        q, k, v = (torch.from_numpy(a).to(dev, dt).transpose(1, 2).contiguous().requires_grad_(mode != "forward")
                   for a in arrays)

        def run():
            if mode == "forward":
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            for t in (q, k, v):
                t.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
            return q.grad
    else:
        dt = jnp.bfloat16 if gpu else jnp.float32
        q, k, v = (jnp.asarray(a, dt) for a in arrays)
        if impl == "jax.nn":
            core = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            core = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        f = core if mode == "forward" else jax.grad(lambda q, k, v: jnp.sum(core(q, k, v).astype(jnp.float32)),
                                                    argnums=(0, 1, 2))
        compiled = jax.jit(f).lower(q, k, v).compile()
        analysis = compiled.memory_analysis()
        need = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**30 if analysis else 0.0
        result["xla_estimate_gib"] = need
        budget = 0.7 * float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
        if gpu:
            budget = jax.devices()[0].memory_stats().get("bytes_limit", 0) / 2**30 * 0.9
        if need > budget:
            result["skipped"] = f"needs {need:.1f} GiB (XLA's estimate), more than {budget:.0f} GiB"
            return result
        run = lambda: compiled(q, k, v)
    side = "torch" if impl == "torch SDPA" else "jax"
    baseline = _reset_peak(gpu, side)
    # Beyond 8k tokens a CPU point is timed once without a warm-up (seconds each); a GPU's always warm up.
    t = time_in_turns({"x": run}, repeats, warmup=1 if T <= 8192 or gpu else 0)["x"]
    result["seconds"] = t
    result["peak_gib"] = max(_peak_gib(gpu, side) - baseline, 0.0)
    flops = 4 * heads * T * T * head_dim / 2  # causal: half of QK^T and PV
    result["tflops"] = (flops * (1 if mode == "forward" else 3.5)) / t / 1e12
    return result


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise KeyError(field)


def _reset_peak(gpu: bool, side: str) -> float:
    """Start measuring the peak afresh; returns the memory held now (GiB).

    CPU: the process's resident memory. GPU: the allocator of the framework that runs (``side``
    is 'torch' or 'jax'); JAX's peak cannot be reset, but each point runs in a fresh process
    whose only program is the one timed.
    """
    if gpu and side == "torch":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**30
    if gpu:
        import jax

        return jax.devices()[0].memory_stats()["bytes_in_use"] / 2**30
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    return _status_gib("VmRSS")


def _peak_gib(gpu: bool, side: str) -> float:
    if gpu and side == "torch":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    if gpu:
        import jax

        return jax.devices()[0].memory_stats()["peak_bytes_in_use"] / 2**30
    return _status_gib("VmHWM")


def length_sweep(lengths, impls, repeats, in_process=False, gpu=False) -> list[dict]:
    """Each point in a fresh process (its peak memory is its own), or here when ``in_process``.
    On CPU the points beyond 8k tokens are timed once; on a GPU every point ``repeats`` times."""
    rows = []
    for T in lengths:
        for mode in ("forward", "forward+backward"):
            for impl in impls:
                reps = repeats if T <= 8192 or gpu else 1
                if in_process:
                    rows.append(sweep_point(impl, T, mode, reps))
                    print("  ", _sweep_line(rows[-1]), flush=True)
                    continue
                cmd = [sys.executable, "-m", "benchmarks.run", "--point", impl, str(T), mode, str(reps)]
                # On a GPU, JAX would reserve most of its memory at start-up, leaving PyTorch little.
                env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if impl == "torch SDPA" else None
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                      cwd=Path(__file__).resolve().parents[1])
                if proc.returncode != 0:
                    rows.append({"impl": impl, "T": T, "mode": mode, "failed": proc.stderr.strip().splitlines()[-1:]})
                else:
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print("  ", _sweep_line(rows[-1]), flush=True)
    return rows


def _sweep_line(r: dict, peak_tflops: Optional[float] = None) -> str:
    head = f"{r['impl']:<10} T={r['T']:<6} {r['mode']:<17}"
    if "seconds" in r:
        rate = f"{r['tflops']:7.2f} TFLOP/s" + (f" ({r['tflops'] / peak_tflops:4.0%} of peak)" if peak_tflops else "")
        estimate = f"  (XLA estimate {r['xla_estimate_gib']:.2f} GiB)" if "xla_estimate_gib" in r else ""
        return head + f" {r['seconds']:9.4g} s  {rate}  peak {r['peak_gib']:6.2f} GiB{estimate}"
    return head + f" {r.get('skipped') or r.get('failed')}"


# --------------------------------------------------------------------------- 3. KV-cache decoding

def decoding(prefix: int, steps: int, repeats: int, gpu: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import flax_attn as fa

    dtype = jnp.bfloat16 if gpu else jnp.float32
    config = fa.AttentionConfig(d_model=768, num_heads=12, position="rope")
    layer = fa.Attention(config, param_dtype=dtype)
    total = prefix + steps
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, total, 768)), dtype)
    positions = jnp.arange(total)[None]
    params = layer.init(jax.random.key(0), x[:, :8], positions[:, :8])

    step = fa.decode_step(layer)  # the documented loop: one jit, the cache donated
    # Recomputation: the whole prefix of a fixed padded length (one compilation); causal
    # attention makes the padding after the current token irrelevant.
    full = jax.jit(lambda p, xs: layer.apply(p, xs, positions)[:, -1])

    # Each token and its position cut out before the clock starts: on a GPU a cut is a dispatch
    # of its own, and would be timed as part of the step.
    tokens = [(x[:, t:t + 1], positions[:, t:t + 1]) for t in range(prefix, total)]

    def cached():
        cache = config.init_cache(batch=1, max_len=total, dtype=dtype)
        _, cache = step(params, cache, x[:, :prefix], positions[:, :prefix])
        jax.block_until_ready(cache)
        start = time.perf_counter()
        for token, position in tokens:
            out, cache = step(params, cache, token, position)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / steps
        step.check()
        return seconds

    def recompute():
        start = time.perf_counter()
        for _ in range(steps):
            out = full(params, x)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / steps

    cached(), recompute()  # compile
    per_token_cached = float(np.median([cached() for _ in range(repeats)]))
    per_token_full = float(np.median([recompute() for _ in range(repeats)]))
    return {"prefix": prefix, "steps": steps, "cached_s_per_token": per_token_cached,
            "recompute_s_per_token": per_token_full, "speedup": per_token_full / per_token_cached}


# --------------------------------------------------------------------------- peak, report

def matmul_peak_tflops(gpu: bool, smoke: bool = False) -> dict:
    """The machine's dense matmul rate in each framework, measured now in turns (bf16 8192^3 on
    GPU, f32 4096^3 on CPU; 1024^3 once with ``smoke``): ``{'jax': TFLOP/s, 'torch': TFLOP/s}``."""
    import jax
    import jax.numpy as jnp
    import torch

    n, dtype, tdtype = (8192, jnp.bfloat16, torch.bfloat16) if gpu else (4096, jnp.float32, torch.float32)
    n = 1024 if smoke else n
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((n, n)).astype(np.float32) for _ in range(2)]
    a, b = (jnp.asarray(h, dtype) for h in host)
    ta, tb = (torch.from_numpy(h).to(device="cuda" if gpu else "cpu", dtype=tdtype) for h in host)
    f = jax.jit(lambda a, b: a @ b)
    t = time_in_turns({"jax": lambda: f(a, b), "torch": lambda: ta @ tb}, repeats=1 if smoke else 5,
                      warmup=1 if smoke else 2)
    return {name: 2 * n ** 3 / seconds / 1e12 for name, seconds in t.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    layer = [r for r in results.get("gpt2_layer", []) if r["mode"] == "forward+backward"]
    names = [r["layer"].replace(" (", "\n(") for r in layer]
    axes[0].barh(names, [r["seconds"] for r in layer], color=["C1" if "peer" in r["layer"] else "C0" for r in layer])
    axes[0].set_xlabel("seconds (forward+backward)")
    axes[0].set_title("GPT-2-small causal MHA layer")
    axes[0].tick_params(axis="y", labelsize=7)
    for ax, key, label in ((axes[1], "seconds", "seconds"), (axes[2], "peak_gib", "peak memory (GiB)")):
        sweep = results.get("length_sweep", [])
        for impl in sorted({r["impl"] for r in sweep}):
            pts = [r for r in sweep
                   if r["impl"] == impl and r["mode"] == "forward+backward" and r.get(key, 0) > 0]
            if pts:
                ax.plot([r["T"] for r in pts], [r[key] for r in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (1 x 8 heads x 64, causal)")
        ax.set_ylabel(label)
        ax.set_title(f"attention core, forward+backward: {label}")
        if sweep:
            ax.legend(fontsize=8)
    fig.suptitle(f"flax_attn benchmarks on {results['machine']['device']} ({results['machine']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_report(results: dict) -> None:
    m = results["machine"]
    print(f"\nMachine: {m['device']}, {m['cpu_count']} cores, {m['memory_gib']} GiB; JAX {m['jax']}, torch {m['torch']}; "
          f"{m['dtype']}; host memory: {results.get('host_memory', 'default allocator')}; "
          f"matmul peak measured {_peaks_text(results)}"
          + (f" (datasheet {m['datasheet_bf16_tflops']:.0f} TFLOP/s)" if m.get("datasheet_bf16_tflops") else ""))
    if m.get("free_page_reporting_bytes") and HUGE_PAGES in results.get("host_memory", ""):
        print(f"This virtual machine hands free blocks of {m['free_page_reporting_bytes'] / 2**20:g} MiB and up back to "
              f"its host: with huge pages, the memory a contender frees while the others take their turns is faulted "
              f"in again from the host at its next call (free_page_reporting)")
    c = results["gpt2_layer_config"]
    if "gpt2_layer" in results:
        print(f"\nGPT-2-small causal multi-head attention layer (batch {c['batch']}, {c['context']} tokens, "
              f"{c['d_model']} wide, {c['heads']} heads)")
        flops = layer_flops(c)
        peaks = results.get("matmul_peak_tflops_by_framework", {"jax": results["matmul_peak_tflops"]})
        print(f"model FLOPs: forward {flops['forward'] / 1e9:.1f} G, forward+backward {flops['forward+backward'] / 1e9:.1f} G; "
              f"'of peak': achieved GFLOP/s over the same framework's matmul peak")
        print(f"{'layer':<62} {'forward':>9} {'ratio':>6} {'GFLOP/s':>8} {'of peak':>7} "
              f"{'fwd+bwd':>9} {'ratio':>6} {'GFLOP/s':>8} {'of peak':>7}")
        by = {}
        for r in results["gpt2_layer"]:
            by.setdefault(r["layer"], {})[r["mode"]] = r
        for name, modes in by.items():
            cells = []
            for mode in ("forward", "forward+backward"):
                r = modes[mode]
                rate = flops[mode] / r["seconds"] / 1e9
                peak = peaks.get(r.get("framework", "jax"))
                cells.append(f"{r['seconds']:8.4g}s {r['ratio_to_peer']:5.2f}x {rate:8.1f} "
                             + (f"{rate / (peak * 1e3):7.0%}" if peak else f"{'':>7}"))
            print(f"{name:<62} " + " ".join(cells))
        loads = [r.get("load_average_before") for r in results["gpt2_layer"] if r.get("load_average_before")]
        if loads:
            print("load average (1 min) before the forward / forward+backward rounds: "
                  + " / ".join(f"{l[0]:.2f}" for l in loads[::len(by)]))
    if "length_sweep" in results:
        print("\nAttention core, length sweep (1 sequence, 8 heads of 64, causal; FLOPs: causal half of QK^T and PV, "
              "backward 2.5x forward)")
        for r in results["length_sweep"]:
            print("  " + _sweep_line(r, results["matmul_peak_tflops"]))
    if "decoding" in results:
        d = results["decoding"]
        print(f"\nKV-cache decoding after a {d['prefix']}-token prefix: {d['cached_s_per_token'] * 1e3:.2f} ms/token "
              f"cached, {d['recompute_s_per_token'] * 1e3:.2f} ms/token recomputing the prefix: {d['speedup']:.1f}x")
    if "decode_vs_torch" in results:
        from benchmarks import decode
        print("\n" + decode.report(results["decode_vs_torch"]))
    if "decode_mla_vs_torch" in results:
        from benchmarks import decode, decode_mla
        print("\n" + decode.report(results["decode_mla_vs_torch"], decode_mla.TITLE))


def _peaks_text(results: dict) -> str:
    peaks = results.get("matmul_peak_tflops_by_framework", {"jax": results["matmul_peak_tflops"]})
    return ", ".join(f"{name} {t * 1000:.0f} GFLOP/s" for name, t in peaks.items())


HUGE_PAGES = "glibc.malloc.hugetlb=1"  # a GLIBC_TUNABLES entry


def _huge_pages() -> bool:
    """Whether this process started with glibc's malloc asking for transparent huge pages."""
    return HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":")


VIRTIO_BALLOON = 0x0005  # virtio device id of a memory balloon
BALLOON_F_REPORTING = 5  # its feature bit: free page reporting


def free_page_reporting(sysfs: Path = Path("/sys")) -> Optional[int]:
    """The smallest free block, in bytes, that this virtual machine hands back to its host
    (a virtio balloon with free page reporting: Linux reports free blocks of
    ``page_reporting_order`` and up, and the host takes their memory until they are touched
    again); None where no balloon reports (bare metal, other hypervisors, not Linux).

    It matters for ``--huge-pages``: memory that glibc unmaps in 2 MiB pages comes back to the
    kernel as blocks that size, is reported within seconds, and costs the next call a fault
    from the host per page (measured: the README's Host memory section)."""
    for device in sorted((sysfs / "bus/virtio/devices").glob("*")):
        try:
            if int((device / "device").read_text(), 16) != VIRTIO_BALLOON:
                continue
            features = (device / "features").read_text().strip()  # one '0'/'1' per bit, bit 0 first
        except (OSError, ValueError):
            continue
        if features[BALLOON_F_REPORTING:BALLOON_F_REPORTING + 1] != "1":
            continue
        try:
            order = int((sysfs / "module/page_reporting/parameters/page_reporting_order").read_text())
        except (OSError, ValueError):
            order = 9  # Linux's default, the x86 pageblock (2 MiB)
        return os.sysconf("SC_PAGE_SIZE") << order
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: a check that it all runs")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-length", type=int, default=SWEEP_LENGTHS[-1])
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sweep lengths instead of those of the default list up to --max-length")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--parts", default="layer,sweep,decode",
                        help="comma-separated subset of layer, sweep, decode (a partial run is written beside "
                             "the full one, its parts in the file name)")
    parser.add_argument("--sweep-impls", default=None,
                        help="comma-separated subset of the sweep's contenders (default: all of xla, blockwise, "
                             "jax.nn, torch SDPA, and cudnn on a GPU)")
    parser.add_argument("--keep-host-memory", action="store_true",
                        help="call flax_attn.keep_host_memory() first: XLA's temporaries reuse freed memory instead "
                             "of being faulted in at every call (PyTorch in the same process gets the same allocator)")
    parser.add_argument("--huge-pages", action="store_true",
                        help=f"run again with GLIBC_TUNABLES={HUGE_PAGES} set (glibc >= 2.35, Linux with transparent huge pages "
                             "in 'madvise' or 'always' mode): glibc asks for 2 MiB pages for the memory it maps, so "
                             "a call faults its fresh buffers in 2 MiB pieces (the layer's forward+backward: 1/60 "
                             "of the page faults); for every contender and for the sweep's processes. On a VM that "
                             "hands free memory back to its host (the report says so) it can cost more than it saves")
    parser.add_argument("--point", nargs=4, metavar=("IMPL", "T", "MODE", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [256] if args.smoke else [t for t in SWEEP_LENGTHS if t <= args.max_length]
    if args.lengths is not None:
        try:
            lengths = [int(t) for t in args.lengths.split(",") if t.strip()]
        except ValueError:
            parser.error(f"--lengths: whole numbers separated by commas, got {args.lengths!r}")
        if not lengths or min(lengths) < 1:
            parser.error(f"--lengths: positive lengths needed, got {args.lengths!r}")
    if args.huge_pages and not _huge_pages():
        tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES]))
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.run"] + list(sys.argv[1:] if argv is None else argv),
                  {**os.environ, "GLIBC_TUNABLES": tunables})
    kept = False
    if args.keep_host_memory:
        import flax_attn

        kept = flax_attn.keep_host_memory()  # False where it does not apply (no glibc)
    if args.point:
        impl, T, mode, reps = args.point
        print(json.dumps(sweep_point(impl, int(T), mode, int(reps))))
        return

    info = machine()
    gpu = info["backend"] == "gpu"
    repeats = 1 if args.smoke else args.repeats
    layer_cfg = ({"batch": 1, "context": 64, "d_model": 64, "heads": 4} if args.smoke
                 else {"batch": 8, "context": 1024, "d_model": 768, "heads": 12})
    impls = ["xla", "blockwise", "jax.nn", "torch SDPA"] + (["cudnn", "pallas_triton"] if gpu else [])
    if args.sweep_impls is not None:
        chosen = [name.strip() for name in args.sweep_impls.split(",") if name.strip()]
        if not chosen or set(chosen) - set(impls):
            parser.error(f"--sweep-impls: {sorted(set(chosen) - set(impls)) or 'none given'} not among {impls}")
        impls = [name for name in impls if name in chosen]
    host_memory = "; ".join(filter(None, [
        "kept (flax_attn.keep_host_memory)" if kept else
        "keep_host_memory does not apply here" if args.keep_host_memory else None,
        *(f"{name}={value}" for name, value in sorted(os.environ.items())
          if name == "GLIBC_TUNABLES" or name.startswith("MALLOC_"))])) or "default allocator"
    print(f"Machine: {info['device']} ({info['backend']}, {info['dtype']}); host memory: {host_memory}", flush=True)
    results = {"machine": info, "host_memory": host_memory, "gpt2_layer_config": layer_cfg}
    peaks = matmul_peak_tflops(gpu, smoke=args.smoke)
    results["matmul_peak_tflops"] = peaks["jax"]           # JAX's, the ceiling of the JAX figures
    results["matmul_peak_tflops_by_framework"] = peaks
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"layer", "sweep", "decode"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from layer, sweep, decode")
    if "layer" in parts:
        print("1. GPT-2-small layer ...", flush=True)
        results["gpt2_layer"] = gpt2_layer(layer_cfg, repeats, gpu)
    if "sweep" in parts:
        print("2. length sweep ...", flush=True)
        results["length_sweep"] = length_sweep(lengths, impls, repeats, in_process=args.smoke, gpu=gpu)
    if "decode" in parts:
        print("3. KV-cache decoding ...", flush=True)
        results["decoding"] = decoding(64 if args.smoke else 1024, 8 if args.smoke else 64, max(1, repeats // 3), gpu)
        if not gpu:  # the PyTorch eager peer of benchmarks.decode runs on the CPU
            from benchmarks import decode
            results["decode_vs_torch"] = (decode.run(1, batches=(1,), prefixes=(64,), sparse=((64, 512),), grouped=((64, 2),), chunks=((64, 1024, 8),)) if args.smoke
                                          else decode.run(repeats))
            from benchmarks import decode_mla
            results["decode_mla_vs_torch"] = decode_mla.run(1 if args.smoke else repeats, smoke=args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = (("" if len(parts) == 3 else "-" + "-".join(parts))
               + ("" if args.sweep_impls is None else "-" + "-".join(i.replace(" ", "").replace(".", "") for i in impls))
               + ("-kept" if args.keep_host_memory else "") + ("-hugetlb" if _huge_pages() else ""))
    stem = args.out / (info["name"] + ("-smoke" if args.smoke else "") + partial)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, stem.with_suffix(".png"))
    print_report(results)
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
