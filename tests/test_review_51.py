"""What an attacker's probe of the API found (stop 51), each case in a child process: before the
fixes the first two ended the interpreter with SIGSEGV, the third raised a bare MemoryError.

* A cache's claim and transaction objects made with ``__new__`` (no cache behind them) are refused
  with a KVSimdValueError when entered or exited.
* ``Layers.blocks`` is a tuple: appending or replacing a block after the sizes were checked (when
  the Layers was built) is impossible, so a forward pass never reads past its per-layer tables.
* Arrays kvsimd allocates for its results (``out`` of attend and the conversions, quantize_kv's
  values, QMatrix.dequantize) raise KVSimdMemoryError naming the array when the allocation fails.
* KVCache.commit keeps the positions and ``seen`` that a step's discard reads, as append does
  (before, a sink_query step after write + commit raised a bare IndexError).
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code, timeout=120):
    env = dict(os.environ, KVSIMD_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=ROOT)
    assert p.returncode == 0, "child exited %d\n%s" % (p.returncode, p.stderr[-3000:])
    return p.stdout


@pytest.mark.parametrize("make, what", [("c._claim()", "claim object"), ("c.transaction()", "transaction object")])
@pytest.mark.parametrize("method", ["__enter__()", "__exit__(None, None, None)"])
def test_claim_and_transaction_objects_without_a_cache_are_refused(make, what, method):
    out = run_child("""
import kvsimd
c = kvsimd.KVCache(1, 1, 8, 4)
T = type(%s)
try:
    T.__new__(T).%s
except kvsimd.KVSimdValueError as e:
    print("refused:", e)
""" % (make, method))
    assert out.startswith("refused:") and ("%s was not made" % what in out or "not open" in out), out


def test_layers_blocks_cannot_be_changed_after_the_sizes_were_checked():
    out = run_child("""
import numpy as np
import kvsimd
from kvsimd.testing import random_decoder
a = random_decoder(64, 32, 2, 4, 2, 8, 48, seed=1)
a._ensure_valid()
L = a._packed.layers
print(type(L.blocks).__name__, len(L.blocks))
for change in (lambda: L.blocks.append(L.blocks[0]), lambda: L.blocks.__setitem__(0, 5)):
    try:
        change()
    except (AttributeError, TypeError) as e:
        print("refused")
logits = a.forward([1, 2, 3])
print("forward", np.asarray(logits).shape, bool(np.isfinite(logits).all()))
""")
    lines = out.split("\n")
    assert lines[0] == "tuple 2" and lines[1:3] == ["refused", "refused"], out
    assert lines[3].startswith("forward") and lines[3].endswith("True"), out


MEMORY_CASES = {
    "to_float32": ("x = np.ones(1 << 26, np.float16)", "ops.to_float32(x)", "out: cannot allocate the float32 array"),
    "to_float16": ("x = np.ones(1 << 26, np.float32)", "ops.to_float16(x)", "out: cannot allocate the float16 array"),
    "quantize_kv": ("x = np.ones((1 << 21, 64), np.float32)", "ops.quantize_kv(x, 'int8')",
                    "quantize_kv's values: cannot allocate the int8 array"),
    "dequantize": ("w = kvsimd.QMatrix(np.zeros(1 << 27, np.uint8), 'f32', (4096, 8192), name='w')",
                   "w.dequantize()", "w: dequantize's output: cannot allocate the float32 array"),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child caps its address space (RLIMIT_AS)")
def test_a_kvcache_whose_bookkeeping_cannot_be_allocated_is_a_kvsimd_memory_error():
    """batch 16 x 2**24 slots of head_dim 1: 1 GiB of float16 K/V, which the child's cap (1.25 GiB
    above what it maps) leaves room for, and 3 GiB of positions and rotations, which it does not."""
    out = run_child("""
import resource
import kvsimd
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (5 << 28), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    kvsimd.KVCache(1, 1, 1, 1 << 24, batch=16)
    print("allocated")
except kvsimd.KVSimdMemoryError as e:
    print("refused:", e)
""", timeout=300)
    assert out.startswith("refused:") and "positions and rotations" in out, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child caps its address space (RLIMIT_AS)")
@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_result_arrays_that_cannot_be_allocated_are_kvsimd_memory_errors(name):
    """The child's address space is capped 32 MiB above what it maps once its input exists, and the
    result needs 128 MiB or more."""
    setup, call, message = MEMORY_CASES[name]
    out = run_child("""
import resource
import numpy as np
import kvsimd
from kvsimd import ops
%s
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    %s
    print("allocated")
except kvsimd.KVSimdMemoryError as e:
    print("refused:", e)
""" % (setup, call), timeout=300)
    assert out.startswith("refused:") and message in out, out


@pytest.mark.parametrize("policy", ["sink_query", "shift", "fixed"])
def test_commit_on_a_kvcache_keeps_the_bookkeeping_a_step_reads(policy):
    """KVCache.commit after write() records the tokens' positions and ``seen`` (ids unknown) as
    append does; before, it moved only the length, and the discard of the next step under
    "sink_query" raised a bare IndexError, under "shift" left 2 token ids for 4 tokens."""
    import numpy as np
    import kvsimd
    from kvsimd.cache import RopeSpec
    c = kvsimd.KVCache(1, 1, 8, 4, n_keep=1, policy=policy)
    k = np.ones((1, 4, 8), np.float32)
    c.write(0, k, k)
    c.commit(4)
    assert c.seen[0] == 4 and list(c.positions[0]) == [0, 1, 2, 3] and list(c.tokens[0]) == [-1] * 4
    if policy == "fixed":   # a full cache with no discard: the step is refused, the cache unchanged
        with pytest.raises(kvsimd.KVSimdError):
            c.begin_step(np.array([7]), rope=RopeSpec(1e4, "gptj", None, 8))
        assert c.seen[0] == 4 and list(c.tokens[0]) == [-1] * 4
        return
    c.begin_step(np.array([7]), rope=RopeSpec(1e4, "gptj", None, 8))
    # the step discarded token 1 (the oldest after the sink) and writes token 4 into its slot:
    # "sink_query" at position 4, keys kept where they were; "shift" moves tokens 2 and 3 to
    # positions 1 and 2 (rotated once) and writes the new token at position 3
    assert int(c.lengths[0]) == 3 and c.seen[0] == 4 and list(c.tokens[0]) == [-1] * 3
    if policy == "sink_query":
        assert list(c.positions[0]) == [0, 4, 2, 3] and list(c.rotations[0]) == [0, 0, 0, 0]
    else:
        assert list(c.positions[0]) == [0, 3, 1, 2] and list(c.rotations[0]) == [0, 0, 1, 1]


def test_commit_under_reevaluate_needs_the_token_ids():
    import numpy as np
    import kvsimd
    c = kvsimd.KVCache(1, 1, 8, 4, n_keep=1, policy="reevaluate")
    k = np.ones((1, 2, 8), np.float32)
    c.write(0, k, k)
    with pytest.raises(kvsimd.KVSimdValueError, match="reevaluate.*append"):
        c.commit(2)
    with pytest.raises(kvsimd.KVSimdCapacityError, match="cannot append 9223372036854775807 tokens"):
        c.append(0, 2 ** 63 - 1)   # start + n wrapped to a negative sum before: a bare MemoryError
    assert int(c.lengths[0]) == 0
    c.commit(0)
    c.append(0, 2, np.array([5, 6]))
    assert list(c.tokens[0]) == [5, 6] and int(c.lengths[0]) == 2


def test_wrong_keyword_arguments_and_ragged_ids_are_kvsimd_type_errors():
    """Three more of the probe's bare exceptions: an unknown KVCache keyword (a Cython TypeError
    before), a QMatrix name that is not a str (the same), ragged take() ids (numpy's ValueError)."""
    import numpy as np
    import kvsimd
    with pytest.raises(kvsimd.KVSimdTypeError, match="KVCache got unexpected arguments foo"):
        kvsimd.KVCache(1, 1, 8, 4, foo=1)
    buf = np.zeros(4 * 32 * 4, np.uint8)
    with pytest.raises(kvsimd.KVSimdTypeError, match="name must be a str, got 1"):
        kvsimd.QMatrix(buf, "f32", (4, 32), name=1)
    w = kvsimd.QMatrix(buf, "f32", (4, 32), name="emb")
    with pytest.raises(kvsimd.KVSimdTypeError, match="emb: ids must be a 1-D sequence of integers"):
        w.take([[1], [1, 2]])
    assert w.take([1, 3]).shape == (2, 32)


@pytest.mark.parametrize("call, error, message", [
    ("bounds.attend_bound([1], [2], [3])", "KVSimdTypeError", "q must be a NumPy array, got [1]"),
    ("bounds.attend_bound(np.ones((4, 8)), np.ones((3, 5, 8)), np.ones((3, 5, 8)))", "KVSimdValueError",
     "got q (4, 8), k (3, 5, 8), v (3, 5, 8)"),
    ("bounds.attend_bound(np.ones((4, 8)), np.ones((2, 5, 8)), np.ones((2, 5, 4)))", "KVSimdValueError",
     "v (2, 5, 4)"),
    ("bounds.quantized_step_bound('a', 3)", "KVSimdTypeError", "scale must be an array of numbers, got 'a'"),
    ("bounds.alibi_score_error([0.5], [[1, 2], [3]])", "KVSimdTypeError", "distances must be an array of numbers"),
    ("bounds.x8_block_magnitude(b'abc', 'q4_0')", "KVSimdValueError", "raw must be uint8 [rows, row bytes]"),
    ("bounds.x8_block_magnitude(np.zeros((2, 20), np.uint8), 'q4_0')", "KVSimdValueError", "uint8 (2, 20)"),
    ("bounds.rope_coefficients('avx2', 'x')", "KVSimdTypeError", "dtype must be float16 or float32, got 'x'"),
    ("bounds.rope_bound('avx2', np.float16, [1.0], [1.0], factor='big')", "KVSimdTypeError",
     "factor must be a number, got 'big'"),
    ("bounds.softcap_score_error([1.0], None)", "KVSimdTypeError", "softcap must be a number, got None"),
])
def test_bounds_refuse_arguments_of_the_wrong_kind(call, error, message):
    """kvsimd.bounds is public (users check kvsimd on their own data with it): arguments of the
    wrong kind raise a KVSimdError naming them, not numpy's or Python's own exceptions."""
    import numpy as np  # noqa: F401  (used by the calls)
    import kvsimd
    from kvsimd import bounds  # noqa: F401
    with pytest.raises(getattr(kvsimd, error)) as e:
        eval(call)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("field", ["final_softcap", "embed_scale", "norm_eps"])
def test_config_reals_beyond_float32_are_refused(field):
    """Finite as float64 but inf as the float32 the passes use: the logits were NaN, with no error."""
    import kvsimd
    from kvsimd.testing import random_decoder
    with pytest.raises(kvsimd.KVSimdValueError, match="%s must be finite and within float32 range" % field):
        random_decoder(64, 32, 2, 4, 2, 8, 48, **{field: 1e39})


def test_attn_windows_cannot_be_edited_in_place():
    """A list given as attn_windows is stored as a tuple: an edit in place was silently ignored
    (the model kept the windows it had checked); assigning a new value is checked and used."""
    import numpy as np
    import kvsimd
    from kvsimd.testing import random_decoder
    d = random_decoder(64, 32, 2, 4, 2, 8, 48, attn_windows=[0, 0])
    assert d.cfg.attn_windows == (0, 0)
    with pytest.raises(TypeError):
        d.cfg.attn_windows[0] = 2
    ids = [1, 2, 3, 4, 5]
    full = d.forward(ids)
    d.cfg.attn_windows = [2, 0]
    windowed = d.forward(ids)
    ref = random_decoder(64, 32, 2, 4, 2, 8, 48, attn_windows=(2, 0)).forward(ids)
    assert np.array_equal(windowed, ref) and not np.array_equal(windowed, full)
    with pytest.raises(kvsimd.KVSimdValueError, match="attn_windows"):
        d.cfg.attn_windows = [-5, 0]
        d.forward(ids)
