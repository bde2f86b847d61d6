"""Checkpoints: bit-exact round trips, atomic saves that survive a kill, and restores that refuse
a module of another configuration."""
import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from conftest import child_env
from flax_attn import checkpoint as ck


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _assert_bit_exact(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _init(module, key=0):
    """``module.init`` on one example: two tokens of the module's width."""
    if isinstance(module, fa.Attention):
        return module.init(jax.random.key(key), jnp.zeros((1, 2, module.config.d_model)), jnp.arange(2)[None])
    return module.init(jax.random.key(key), jnp.zeros((1, 2, module.d_in)), deterministic=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
@pytest.mark.parametrize("module", [
    fa.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True),
    fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, qk_norm=True, position="t5")),
    fa.MultiHeadAttentionWrapper(4, 2, 8, 0.0, 3),
], ids=["MultiHeadAttention", "Attention", "MultiHeadAttentionWrapper"])
def test_round_trip_is_bit_exact(module, dtype, tmp_path):
    module = module.clone(param_dtype=dtype)
    variables = _init(module)
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


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=child_env())
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
    ck.save(tmp_path, 0, m, _init(m))
    other = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, rope_layout="rotate_half", dropout=0.1))
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ck.restore(tmp_path, other)
    assert "config.rope_layout is 'interleaved' in the checkpoint, 'rotate_half' in the module" in str(err.value)
    assert "dropout" not in str(err.value)


def test_an_implementation_object_or_absorb_may_differ(tmp_path):
    """An implementation given as an object is recorded field by field; none of its fields, nor
    MLAConfig.absorb (the same function), is the model."""
    m = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2))
    v = _init(m)
    ck.save(tmp_path / "a", 0, m.clone(implementation=fa.core.Blockwise(block_q=16)), v)
    _assert_bit_exact(ck.restore(tmp_path / "a", m), v)
    _assert_bit_exact(ck.restore(tmp_path / "a", m.clone(implementation=fa.core.QueryBlocks())), v)
    config = fa.MLAConfig(d_model=16, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
                          v_head_dim=4)
    mla = fa.MultiHeadLatentAttention(config)
    w = mla.init(jax.random.key(0), jnp.zeros((1, 2, 16)), jnp.arange(2)[None])
    ck.save(tmp_path / "b", 0, mla, w)
    _assert_bit_exact(ck.restore(tmp_path / "b", fa.MultiHeadLatentAttention(dataclasses.replace(config, absorb=True))), w)
    with pytest.raises(ck.CheckpointMismatchError, match="config.num_heads is 2 in the checkpoint, 4"):
        ck.restore(tmp_path / "b", fa.MultiHeadLatentAttention(dataclasses.replace(config, num_heads=4)))


def test_a_context_parallel_layer_saves_restores_and_converts(tmp_path):
    """The parameters' template is made with the default implementation: a context-parallel one
    refuses the two-token example whose length does not divide by its devices."""
    from flax_attn import parallel as fp

    mesh = fp.make_mesh((1,), ("seq",))
    plain = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2))
    ring = plain.clone(implementation=fp.context_parallel(mesh, "seq"))
    v = _init(plain)
    ck.save(tmp_path, 0, ring, v)
    _assert_bit_exact(ck.restore(tmp_path, ring), v)
    _assert_bit_exact(ck.restore(tmp_path, plain), v)
    state_dict = fa.to_torch_state_dict(ring, v)
    _assert_bit_exact(fa.from_torch_state_dict(ring, state_dict), v)
    # an implementation that refuses the example call (no lengths bound its keys) is no obstacle either
    picky = plain.clone(implementation="key_blocks")
    with pytest.raises(ValueError, match="key_blocks"):
        picky.apply(v, jnp.zeros((1, 2, 8)), jnp.arange(2)[None])
    _assert_bit_exact(fa.from_torch_state_dict(picky, fa.to_torch_state_dict(picky, v)), v)


def test_save_checks_the_variables_and_the_module(tmp_path):
    m = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2))
    other = _init(fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, num_kv_heads=1, qk_norm=True)))
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ck.save(tmp_path, 0, m, other)
    assert "nothing was saved" in str(err.value)
    assert "parameter k_proj/kernel has shape (8, 4) in variables, (8, 8) in the module" in str(err.value)
    assert "variables has parameter q_norm/scale the module does not" in str(err.value)
    ints = jax.tree.map(lambda x: x.astype(jnp.int32), _init(m))
    with pytest.raises(ck.CheckpointMismatchError, match="parameter k_proj/kernel has dtype int32; parameters are "
                                                         "floating-point"):
        ck.save(tmp_path, 0, m, ints)
    assert ck.steps(tmp_path) == []
    import flax
    ck.save(tmp_path, 0, m, flax.core.freeze(_init(m)))  # a FrozenDict is a dict of collections too
    assert ck.steps(tmp_path) == [0]
    from flax import nnx
    layer = fa.nnx.Attention(fa.AttentionConfig(d_model=8, num_heads=2), rngs=nnx.Rngs(0))
    for call in (lambda: ck.save(tmp_path, 0, layer, fa.nnx.to_linen(layer)), lambda: ck.restore(tmp_path, layer)):
        with pytest.raises(TypeError, match=r"NNX module Attention: pass its Linen twin, fa.nnx.linen_twin\(module\)"):
            call()


# ----------------------------------------------------------------------------------------------
# Checkpoints that cannot lie: damage is an error naming the step and the array; one writer.

def _paths(variables):
    return ["/".join(p) for p, _ in
            sorted(jax.tree_util.tree_flatten_with_path(variables["params"])[0], key=lambda e: str(e[0]))]


def _incompressible(module, seed):
    """Variables whose bytes do not compress (random bits, finite), so Orbax stores them verbatim."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        bits = rng.integers(0, 2**32, size=x.shape, dtype=np.uint32).view(np.float32)
        return np.where(np.isfinite(bits), bits, np.float32(0.5))
    return jax.tree_util.tree_map(leaf, _init(module))


def _files(step_dir):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs)


def _flip_bit(path, offset, bit=3):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 1 << bit
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reader threads, on damage
def test_a_flipped_bit_in_any_array_is_an_error_naming_the_step_and_the_array(tmp_path):
    m = fa.MultiHeadAttention(32, 32, 16, 0.0, 2, qkv_bias=True)  # kernels 4 KiB, biases 128 B
    good, latest = _incompressible(m, 1), _incompressible(m, 2)
    ck.save(tmp_path, 1, m, good)
    ck.save(tmp_path, 2, m, latest)
    flat = {"/".join(k.key for k in p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(latest["params"])[0]}
    assert len(flat) == 8
    for name, array in flat.items():
        raw = array.tobytes()
        middle = raw[len(raw) // 2 - 16: len(raw) // 2 + 16]
        # Where Orbax keeps this array's bytes (the merged database; a per-process copy may exist too).
        hits = [(f, open(f, "rb").read().find(middle)) for f in _files(tmp_path / "2")]
        hits = [(f, i) for f, i in hits if i >= 0]
        assert hits, f"the bytes of {name} were not found in any file of step 2"
        for f, i in hits:
            _flip_bit(f, i + 5)
        with pytest.raises(ck.CheckpointCorruptError) as err:
            ck.restore(tmp_path, m)
        assert err.value.step == 2 and name in err.value.arrays, (name, err.value)
        if array.nbytes > 1024:  # Orbax stores it apart (small arrays share a checksummed node with the rest)
            assert err.value.arrays == (name,), (name, err.value)
        assert "step 2 is damaged" in str(err.value) and name in str(err.value)
        assert "Other steps: [1] (restore one with step=)" in str(err.value)
        with pytest.raises(ck.CheckpointCorruptError, match=name):
            ck.verify(tmp_path)
        _assert_bit_exact(ck.restore(tmp_path, m, step=1), good)  # the previous step is untouched
        for f, i in hits:
            _flip_bit(f, i + 5)  # undo: the flip alone made the difference
        _assert_bit_exact(ck.restore(tmp_path, m), latest)
    assert ck.verify(tmp_path) == 2 and ck.verify(tmp_path, step=1) == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reader threads, on damage
def test_any_damage_to_any_file_is_an_error_or_harmless(tmp_path):
    """Every file of a step, a bit flipped at the start, the middle or the end, or the file cut
    to half its length: restore either raises CheckpointCorruptError for that step or
    returns the saved bits (the file held nothing restore reads, such as Orbax's per-process copy
    or a commit log). Never other values, never another exception; the previous step restores."""
    m = fa.MultiHeadAttention(16, 16, 16, 0.0, 2, qkv_bias=True)
    good, latest = _init(m, 1), _init(m, 2)
    latest = jax.tree_util.tree_map(lambda x: x + 0.25, latest)  # realistic, compressible values
    ck.save(tmp_path, 1, m, good)
    ck.save(tmp_path, 2, m, latest)
    outcomes = collections.Counter()
    for f in _files(tmp_path / "2"):
        original = open(f, "rb").read()
        size = len(original)
        damages = [("flip", o) for o in sorted({0, size // 2, size - 1})] + [("cut", size // 2)]
        for kind, offset in damages:
            if kind == "flip":
                _flip_bit(f, offset)
            else:
                os.truncate(f, offset)
            try:
                restored = ck.restore(tmp_path, m)
            except ck.CheckpointCorruptError as e:
                assert e.step == 2 and "step 2 is damaged" in str(e), (f, kind, offset, e)
                outcomes["error"] += 1
            else:
                _assert_bit_exact(restored, latest)
                outcomes["harmless"] += 1
            with open(f, "wb") as out:
                out.write(original)
        _assert_bit_exact(ck.restore(tmp_path, m, step=1), good)
    _assert_bit_exact(ck.restore(tmp_path, m), latest)
    # The parameters' data, their tree metadata and the checksum record are among the files.
    assert outcomes["error"] >= 20, outcomes


def test_a_missing_checksum_record_or_module_description_is_an_error(tmp_path):
    m = fa.MultiHeadAttention(8, 8, 16, 0.0, 2)
    v = _init(m)
    ck.save(tmp_path, 3, m, v)
    description = tmp_path / "3" / "module" / "metadata"
    text = description.read_text()
    description.write_text(text.replace('"num_heads": 2', '"num_heads": 4'))  # still valid JSON
    with pytest.raises(ck.CheckpointCorruptError, match="step 3 is damaged: the module description fails its checksum"):
        ck.restore(tmp_path, fa.MultiHeadAttention(8, 8, 16, 0.0, 4))
    description.write_text(text)
    _assert_bit_exact(ck.restore(tmp_path, m), v)
    # A step without checksums (as written before they were recorded) is not trusted silently.
    shutil.rmtree(tmp_path / "3" / "checksums")
    with pytest.raises(ck.CheckpointCorruptError, match="holds no checksums.*verify_checksums=False"):
        ck.restore(tmp_path, m)
    _assert_bit_exact(ck.restore(tmp_path, m, verify_checksums=False), v)


def _write_lock(directory, pid, host=None):
    os.makedirs(directory, exist_ok=True)
    lock = os.path.join(directory, ck.LOCK_NAME)
    with open(lock, "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname(), "since": "earlier", "token": "x"}, f)
    return lock


def test_a_second_writer_is_refused_and_a_dead_writers_lock_is_taken_over(tmp_path):
    m = fa.MultiHeadAttention(8, 8, 16, 0.0, 2)
    v = _init(m)
    # A live writer (this process stands in for it) holds the lock: refused, nothing written.
    lock = _write_lock(tmp_path, os.getpid())
    with pytest.raises(ck.CheckpointLockedError, match=rf"being written by pid {os.getpid()} on host .*nothing was saved"):
        ck.save(tmp_path, 1, m, v)
    assert ck.steps(tmp_path) == [] and os.path.exists(lock)
    # A lock left on another host cannot be checked: refused, saying how to clear it.
    _write_lock(tmp_path, 1, host="elsewhere.invalid")
    with pytest.raises(ck.CheckpointLockedError, match="another host is not checked.*delete it"):
        ck.save(tmp_path, 1, m, v)
    # A lock left by a process of this host that has died is stale: taken over.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, dead.pid)
    ck.save(tmp_path, 1, m, v)
    assert ck.steps(tmp_path) == [1] and not os.path.exists(lock)  # released after the save
    _assert_bit_exact(ck.restore(tmp_path, m), v)
    with pytest.raises(ValueError, match=r"step 1 is not after the latest saved step 1 .*\(step 1 exists; a saved step is never replaced\)"):
        ck.save(tmp_path, 1, m, jax.tree_util.tree_map(lambda x: x + 1, v))
    _assert_bit_exact(ck.restore(tmp_path, m), v)


CONCURRENT_WRITER = textwrap.dedent("""
    import os, sys, time, jax, jax.numpy as jnp
    import flax_attn as fa
    from flax_attn import checkpoint as ck
    directory, who, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    m = fa.MultiHeadAttention(64, 64, 16, 0.0, 4)
    v = m.init(jax.random.key(0), jnp.zeros((1, 2, 64)), deterministic=True)
    open(f"{ready}.{who}", "w").close()
    while not all(os.path.exists(f"{ready}.{w}") for w in (1, 2)):  # start together
        time.sleep(0.001)
    for step in range(12):
        for attempt in range(5):  # a refused writer may try again
            try:
                ck.save(directory, step, m, jax.tree_util.tree_map(lambda x: x * (step + 1) + 1000 * who, v))
                print("saved", step, flush=True)
            except ck.CheckpointLockedError:
                print("locked", step, flush=True)
                time.sleep(0.02)
                continue
            except ValueError as e:
                assert "is not after the latest saved step" in str(e), e
                print("behind", step, flush=True)
            break
""")


@pytest.mark.slow
def test_two_processes_saving_into_one_directory_lose_nothing_reported_saved(tmp_path):
    directory = tmp_path / "ckpt"
    writers = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, str(directory), str(who),
                                 str(tmp_path / "ready")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env())
               for who in (1, 2)]
    reports = {}
    for who, w in zip((1, 2), writers):
        out, err = w.communicate(timeout=600)
        assert w.returncode == 0, err[-3000:]
        reports[who] = [line.split() for line in out.splitlines()]
    saved = {who: {int(s) for kind, s in lines if kind == "saved"} for who, lines in reports.items()}
    refused = collections.Counter(kind for lines in reports.values() for kind, _ in lines if kind != "saved")
    print(saved, refused)
    assert refused["locked"] > 0, "the writers never overlapped: the test did not test concurrency"
    assert not saved[1] & saved[2], "a step was reported saved by both writers"
    # Exactly the steps reported saved exist, each restorable, bit for bit what its writer saved.
    assert ck.steps(directory) == sorted(saved[1] | saved[2])
    m = fa.MultiHeadAttention(64, 64, 16, 0.0, 4)
    v = m.init(jax.random.key(0), jnp.zeros((1, 2, 64)), deterministic=True)
    for who, their_steps in saved.items():
        for step in their_steps:
            expected = jax.tree_util.tree_map(lambda x: x * (step + 1) + 1000 * who, v)
            _assert_bit_exact(ck.restore(directory, m, step=step), expected)
    assert not [e for e in os.listdir(directory) if "tmp" in e or e.startswith(ck.LOCK_NAME)]


NEW_FIELDS = ("chunk_size", "temperature_tuning", "qk_norm_weight", "alibi_scaled")


def test_a_checkpoint_saved_before_a_field_existed_restores_with_its_default(tmp_path, monkeypatch):
    # A checkpoint whose recorded configuration lacks fields added since (as one saved by an
    # earlier flax_attn) stands for their defaults: it restores into a module that keeps them,
    # and a module that sets one is refused, the message naming the field and its default.
    m = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2))
    variables = jax.tree_util.tree_map(lambda x: x + 0.25, _init(m))
    describe = ck.describe

    def describe_without_new_fields(module):
        d = describe(module)
        for name in NEW_FIELDS:
            del d["config"]["config"][name]
        return d

    monkeypatch.setattr(ck, "describe", describe_without_new_fields)
    ck.save(tmp_path, 0, m, variables)
    monkeypatch.setattr(ck, "describe", describe)
    _assert_bit_exact(ck.restore(tmp_path, m), variables)
    chunked = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, chunk_size=4, alibi_scaled=False))
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ck.restore(tmp_path, chunked)
    assert ("config.chunk_size is absent from the checkpoint (saved before the field existed: its default None), "
            "4 in the module") in str(err.value)
    assert "alibi_scaled" not in str(err.value) and "qk_norm_weight" not in str(err.value)
    # A field the module does not know (or no longer has) is still a difference.
    assert ck._config_differences({"class": "A", "config": {"x": 1}}, {"class": "A", "config": {}}, m) == [
        "x is 1 in the checkpoint, '<absent>' in the module"]


def test_restore_into_shardings_checks_them(tmp_path):
    """restore(shardings=) places each array (a one-device mesh here; the 8-device case is in
    parallel/test_sharding.py) and names every array a sharding is missing for, extra or unfit."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flax_attn import parallel as fp

    module = fa.Attention(fa.AttentionConfig(d_model=32, num_heads=4))
    variables = _init(module)
    ck.save(tmp_path, 1, module, variables)
    mesh = fp.make_mesh((1, 1), ("data", "model"))
    shardings = fp.named_shardings(fp.partition_specs(module, variables), mesh)
    got = ck.restore(tmp_path, module, shardings=shardings)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(variables)):
        _assert_bit_exact(a, b)
        assert isinstance(a.sharding, NamedSharding)
    params = dict(shardings["params"])
    missing = {k: v for k, v in params.items() if k != "o_proj"}
    extra = {**params, "w_extra": {"kernel": NamedSharding(mesh, P())}}
    with pytest.raises(ValueError, match=r"no sharding for o_proj/kernel"):
        ck.restore(tmp_path, module, shardings=missing)
    with pytest.raises(ValueError, match=r"a sharding for w_extra/kernel, which the checkpoint does not hold"):
        ck.restore(tmp_path, module, shardings={"params": extra})
    specs = {**params, "q_proj": {"kernel": P(None, "model")}}
    with pytest.raises(ValueError, match=r"q_proj/kernel: .*'model'.* is not a jax.sharding.Sharding"):
        ck.restore(tmp_path, module, verify_checksums=False, shardings=specs)
    too_long = {**params, "q_proj": {"kernel": NamedSharding(mesh, P(None, None, "model"))}}
    with pytest.raises(ValueError, match=r"q_proj/kernel of shape \(32, 32\) cannot be split by"):
        ck.restore(tmp_path, module, shardings=too_long)
    with pytest.raises(TypeError, match=r"shardings must be a mapping \(dict, FrozenDict\)"):
        ck.restore(tmp_path, module, shardings=NamedSharding(mesh, P()))
    frozen = ck.restore(tmp_path, module, shardings=flax.core.freeze(shardings))  # any Mapping, FrozenDict included
    leaves = jax.tree_util.tree_leaves
    assert len(leaves(frozen)) == len(leaves(shardings)) == len(leaves(variables))
    for a, b, sharding in zip(leaves(frozen), leaves(variables), leaves(shardings)):
        _assert_bit_exact(a, b)
        assert a.sharding == sharding

