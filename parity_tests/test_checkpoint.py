"""Checkpoints: bit-exact round trips, atomic saves that survive a kill, and restores that refuse
a module of another configuration."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn import checkpoint as ck


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _assert_bit_exact(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(_bits(x), _bits(y))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
@pytest.mark.parametrize("module", [
    fa.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True),
    fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, qk_norm=True, position="t5")),
    fa.MultiHeadAttentionWrapper(4, 2, 8, 0.0, 3),
], ids=["MultiHeadAttention", "Attention", "MultiHeadAttentionWrapper"])
def test_round_trip_is_bit_exact(module, dtype, tmp_path):
    module = module.clone(param_dtype=dtype)
    variables = module.init(jax.random.key(0), *module.example_inputs(), **module.example_kwargs())
    variables = jax.tree_util.tree_map(lambda x: (x + 0.1234567).astype(dtype), variables)  # non-trivial bits
    assert jax.tree_util.tree_leaves(variables)[0].dtype == dtype
    ck.save(tmp_path, 0, module, variables)
    _assert_bit_exact(ck.restore(tmp_path, module), variables)


def test_steps_keep_and_order(tmp_path):
    m = fa.MultiHeadAttention(4, 4, 8, 0.0, 2)
    v = m.init(jax.random.key(0), jnp.zeros((1, 2, 4)), deterministic=True)
    for step in (1, 5, 7):
        ck.save(tmp_path, step, m, jax.tree_util.tree_map(lambda x: x * step, v), keep=2)
    assert ck.steps(tmp_path) == [5, 7]
    _assert_bit_exact(ck.restore(tmp_path, m, step=5), jax.tree_util.tree_map(lambda x: x * 5, v))
    with pytest.raises(ValueError, match="step 6 is not after the latest saved step 7"):
        ck.save(tmp_path, 6, m, v)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint step 1 in .*complete steps: \[5, 7\]"):
        ck.restore(tmp_path, m, step=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        ck.restore(tmp_path / "absent", m)


KILLED_WRITER = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    import flax_attn as fa
    from flax_attn import checkpoint as ck
    m = fa.MultiHeadAttention(1024, 1024, 16, 0.0, 8)
    v = m.init(jax.random.key(0), jnp.zeros((1, 2, 1024)), deterministic=True)
    ck.save(sys.argv[1], 1, m, v)
    print("saved 1", flush=True)
    v = jax.tree_util.tree_map(lambda x: x + 1, v)
    for step in range(2, 1000):
        ck.save(sys.argv[1], step, m, v)
""")


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    assert writer.stdout.readline().startswith("saved 1")
    unfinished, deadline = [], time.time() + 120
    while not unfinished and time.time() < deadline:
        unfinished = [e for e in os.listdir(directory) if "tmp" in e]
        time.sleep(0.0005)
    os.kill(writer.pid, signal.SIGKILL)  # mid-write: a step's temporary directory exists
    writer.wait()
    assert unfinished, "the writer never began a second save"
    complete = ck.steps(directory)
    assert complete and all(str(s) in os.listdir(directory) for s in complete)
    assert not any(str(s) in unfinished[0].split(".")[0] for s in complete)  # the unfinished step is not listed
    m = fa.MultiHeadAttention(1024, 1024, 16, 0.0, 8)
    first = m.init(jax.random.key(0), jnp.zeros((1, 2, 1024)), deterministic=True)
    expected = first if complete[-1] == 1 else jax.tree_util.tree_map(lambda x: x + 1, first)
    _assert_bit_exact(ck.restore(directory, m), expected)
    # Saving goes on after the crash.
    ck.save(directory, complete[-1] + 1000, m, first)
    _assert_bit_exact(ck.restore(directory, m), first)


def test_restoring_into_another_configuration_is_an_error(tmp_path):
    m = fa.MultiHeadAttention(8, 8, 16, 0.0, 2)
    ck.save(tmp_path, 0, m, m.init(jax.random.key(0), jnp.zeros((1, 2, 8)), deterministic=True))
    # Same parameter shapes, another model: the heads split d_out differently.
    with pytest.raises(ck.CheckpointMismatchError, match="num_heads is 2 in the checkpoint, 4 in the module"):
        ck.restore(tmp_path, fa.MultiHeadAttention(8, 8, 16, 0.0, 4))
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ck.restore(tmp_path, fa.MultiHeadAttention(8, 12, 16, 0.0, 2))
    assert "d_out is 8 in the checkpoint, 12 in the module" in str(err.value)
    assert "parameter out_proj/kernel has shape (8, 8) in the checkpoint, (12, 12) in the module" in str(err.value)
    with pytest.raises(ck.CheckpointMismatchError, match="the checkpoint holds a MultiHeadAttention, not a Attention"):
        ck.restore(tmp_path, fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2)))
    # What does not change the model may differ.
    ck.restore(tmp_path, fa.MultiHeadAttention(8, 8, 16, 0.3, 2, implementation="blockwise"))


def test_attention_config_differences_are_listed(tmp_path):
    m = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, rope_layout="interleaved"))
    ck.save(tmp_path, 0, m, m.init(jax.random.key(0), *m.example_inputs(), **m.example_kwargs()))
    other = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, rope_layout="rotate_half", dropout=0.1))
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ck.restore(tmp_path, other)
    assert "config.rope_layout is 'interleaved' in the checkpoint, 'rotate_half' in the module" in str(err.value)
    assert "dropout" not in str(err.value)
