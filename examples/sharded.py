"""Past one device: a layer and a model of one's own sharded over a 2 x 4 mesh, and ring
attention over 8 devices.

    python examples/sharded.py

Runs on 8 virtual CPU devices (the XLA flag below, set before JAX starts); on a machine with 8
accelerators delete that line. On several hosts, the same code runs in one process per host
after ``jax.distributed.initialize()`` (coordinator address, process count and id come from the
cluster's environment: SLURM, Kubernetes/GKE, Cloud TPU, or arguments); ``jax.devices()`` then
lists every host's devices, the mesh spans them all, and inputs are built per host with
``jax.make_array_from_process_local_data`` instead of ``jax.device_put``. Put the ring's axis
across hosts and the model axis within a host: a ring sends one block to the next device per
step, tensor parallelism all-reduces every layer.
"""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flax_attn as fa  # noqa: E402
from flax_attn import parallel as fp  # noqa: E402

# jax.distributed.initialize()   # on a multi-host cluster, first of all (one process per host)

B, T, D = 4, 256, 64
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
positions = jnp.broadcast_to(jnp.arange(T), (B, T))

# 1. Data x tensor parallel: batch over 'data', heads over 'model'.
mesh = fp.make_mesh((2, 4), ("data", "model"))
layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=8, num_kv_heads=4, sliding_window=64))
variables = layer.init(jax.random.key(0), x, positions)
specs = fp.partition_specs(layer, variables, mesh=mesh)                 # q/k/v by heads, o_proj by its input
sharded = fp.shard_params(variables, specs, mesh)
y = jax.jit(layer.apply)(sharded, *fp.shard_batch((x, positions), mesh))
print("q_proj kernel", sharded["params"]["q_proj"]["kernel"].shape, "-> one device holds",
      sharded["params"]["q_proj"]["kernel"].addressable_shards[0].data.shape)
checks = {"sharded layer": bool(jnp.allclose(y, layer.apply(variables, x, positions), atol=1e-5))}

# 1b. A model of one's own: partition_specs finds the flax_attn layers inside it by tracing one
# call (nothing is computed) and splits them as above; the model's own parameters stay whole.
class Block(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
        x = x + fa.Attention(layer.config, name="attn")(nn.RMSNorm()(x), positions)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.RMSNorm()(x)))), None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x, positions):  # four blocks stacked by nn.scan: parameters (4, ...)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4,
                        in_axes=nn.broadcast)
        return stack(name="blocks")(x, positions)[0]


model = Decoder()
model_vars = model.init(jax.random.key(1), x, positions)
model_specs = fp.partition_specs(model, model_vars, mesh=mesh, inputs=(x, positions))
print("blocks/attn/q_proj/kernel", model_specs["params"]["blocks"]["attn"]["q_proj"]["kernel"],
      "blocks/Dense_0/kernel", model_specs["params"]["blocks"]["Dense_0"]["kernel"])
y_model = jax.jit(model.apply)(fp.shard_params(model_vars, model_specs, mesh), *fp.shard_batch((x, positions), mesh))
checks["sharded model"] = bool(jnp.allclose(y_model, model.apply(model_vars, x, positions), atol=1e-5))

# 2. Context parallel: the sequence over 8 devices, zig-zag balanced for the causal mask.
ring = fp.make_mesh((8,), ("seq",))
q, k, v = (jnp.asarray(rng.standard_normal((1, T, 8, 32)), jnp.float32) for _ in range(3))
pos = fp.load_balance(jnp.arange(T)[None], 8)                          # positions travel with tokens
out = fp.ring_attention(*fp.load_balance((q, k, v), 8), mesh=ring, axis_name="seq", is_causal=True,
                        query_positions=pos, key_positions=pos)
out = fp.restore_order(out, 8)
checks["ring attention"] = bool(jnp.allclose(out, fa.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))

# The same as a layer option: the layer's attention runs as a ring under jit.
cp_layer = fa.Attention(layer.config, implementation=fp.context_parallel(ring, "seq"))
y_cp = jax.jit(cp_layer.apply)(variables, x, positions)
checks["layer with a ring"] = bool(jnp.allclose(y_cp, layer.apply(variables, x, positions), atol=1e-5))
for what, ok in checks.items():
    print(f"{what} == one device: {ok}")
print("all equal to one device:", all(checks.values()))
sys.exit(0 if all(checks.values()) else 1)
