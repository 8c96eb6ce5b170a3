"""Bad input to kvsimd.ops: a clear exception naming the problem, never a crash,
and in-place operands left unchanged."""
import numpy as np
import pytest

from kvsimd import KVSimdError, ops


def qkv(H=4, Hkv=2, N=10, D=16, dtype=np.float16):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((H, D)).astype(np.float32), rng.standard_normal((Hkv, N, D)).astype(dtype),
            rng.standard_normal((Hkv, N, D)).astype(dtype))


def misaligned(shape, dtype):
    """A C-contiguous array whose data pointer is off its element alignment."""
    itemsize = np.dtype(dtype).itemsize
    buf = np.zeros(int(np.prod(shape)) * itemsize + 1, np.uint8)
    a = np.ndarray(shape, dtype=dtype, buffer=buf, offset=1)
    assert not a.flags.aligned
    return a


@pytest.mark.parametrize("case, exc, msg", [
    (lambda q, k, v: ops.attend(q[0], k, v), ValueError, "q must be 2-D"),
    (lambda q, k, v: ops.attend(q, k[0], v), ValueError, "k must be 3-D"),
    (lambda q, k, v: ops.attend(q.astype(np.float64), k, v), TypeError, "q must have dtype float32"),
    (lambda q, k, v: ops.attend(q, k.astype(np.float64), v), TypeError, "k must have dtype"),
    (lambda q, k, v: ops.attend(q, k, v.astype(np.float32)), TypeError, "same dtype"),
    (lambda q, k, v: ops.attend(q, k, v[:, :5].copy()), ValueError, "same shape"),
    (lambda q, k, v: ops.attend(q[:3], k, v), ValueError, "multiple of KV heads"),
    (lambda q, k, v: ops.attend(q[:, :8].copy(), k, v), ValueError, "head_dim mismatch"),
    (lambda q, k, v: ops.attend(q, k[:, ::2], v[:, ::2]), ValueError, "C-contiguous"),
    (lambda q, k, v: ops.attend(np.asfortranarray(q), k, v), ValueError, "q must be C-contiguous"),
    (lambda q, k, v: ops.attend(q, k[:, :0], v[:, :0]), ValueError, "empty"),
    (lambda q, k, v: ops.attend(q, k, v, scale=float("nan")), ValueError, "scale must be finite"),
    (lambda q, k, v: ops.attend(q, k, v, alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes must have H=4"),
    (lambda q, k, v: ops.attend(q, k, v, alibi_slopes=np.ones(4)), TypeError, "alibi_slopes must have dtype float32"),
    (lambda q, k, v: ops.attend(q, k, v, alibi_slopes=np.ones(4, np.float32), key_positions=np.arange(9)),
     ValueError, "key_positions must have N=10"),
    (lambda q, k, v: ops.attend(q, k, v, key_positions=np.arange(10)), ValueError, "only apply with alibi_slopes"),
    (lambda q, k, v: ops.attend(q, k, v, alibi_slopes=np.ones(4, np.float32), query_position=1.5),
     TypeError, "query_position must be an integer"),
    (lambda q, k, v: ops.attend(q, k, v, out=np.empty((4, 15), np.float32)), ValueError, "out must have shape"),
    (lambda q, k, v: ops.attend(q, k, v, out=q), ValueError, "out overlaps q"),
    (lambda q, k, v: ops.attend(q.tolist(), k, v), TypeError, "q must be a numpy.ndarray"),
    (lambda q, k, v: ops.attend(misaligned((4, 16), np.float32), k, v), ValueError, "not aligned"),
    (lambda q, k, v: ops.attend(np.zeros((4, 600), np.float32), np.zeros((2, 3, 600), np.float16),
                                np.zeros((2, 3, 600), np.float16)), ValueError, "head_dim must be in 1..512"),
])
def test_attend_rejects(case, exc, msg):
    q, k, v = qkv()
    with pytest.raises(exc, match=msg) as ei:
        case(q, k, v)
    assert isinstance(ei.value, KVSimdError)


def rope_calls():
    pos = np.arange(10, dtype=np.int64)
    return [
        (lambda x: ops.apply_rope(x, pos, rotary_dim=7), ValueError, "rotary_dim must be even"),
        (lambda x: ops.apply_rope(x, pos, rotary_dim=18), ValueError, "rotary_dim must be even and in 2..head_dim=16"),
        (lambda x: ops.apply_rope(x, pos, rotary_dim=0), ValueError, "rotary_dim"),
        (lambda x: ops.apply_rope(x, pos[:9]), ValueError, "positions must have N=10"),
        (lambda x: ops.apply_rope(x, pos.astype(np.int32)), TypeError, "positions must have dtype int64"),
        (lambda x: ops.apply_rope(x, pos, style="llama"), ValueError, "style must be 'gptj' or 'neox'"),
        (lambda x: ops.apply_rope(x, pos, theta=-1.0), ValueError, "theta must be a positive"),
        (lambda x: ops.apply_rope(x, pos + 2**60), ValueError, "2\\*\\*53"),
        (lambda x: ops.apply_rope(x[:, :, ::2], pos), ValueError, "C-contiguous"),
        (lambda x: ops.apply_rope(x.astype(np.float64), pos), TypeError, "x must have dtype"),
        (lambda x: ops.shift_keys(x, 1.5), TypeError, "delta must be an integer"),
        (lambda x: ops.shift_keys(x, 3, start=5, stop=11), ValueError, "stop <= N=10"),
        (lambda x: ops.shift_keys(x, 3, start=-1), ValueError, "0 <= start"),
        (lambda x: ops.shift_keys(x, 3, rotary_dim=5), ValueError, "rotary_dim must be even"),
        (lambda x: ops.shift_keys(x, 2**60), ValueError, "delta must be within"),
        # an odd head_dim and no rotary_dim: the message names what the caller gave
        (lambda x: ops.shift_keys(x[:, :, :15].copy(), 1), ValueError,
         r"head_dim \(last axis\) is 15: RoPE turns pairs of dims, and rotary_dim defaults to head_dim"),
        (lambda x: ops.apply_rope(x[:, :, :15].copy(), pos), ValueError, r"head_dim \(last axis\) is 15"),
    ]


@pytest.mark.parametrize("i", range(len(rope_calls())))
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rope_rejects_and_leaves_data_unchanged(i, dtype):
    case, exc, msg = rope_calls()[i]
    x = np.random.default_rng(1).standard_normal((2, 10, 16)).astype(dtype)
    before = x.copy()
    with pytest.raises(exc, match=msg) as ei:
        case(x)
    assert isinstance(ei.value, KVSimdError)
    assert np.array_equal(x, before)


def test_read_only_cache_is_refused():
    k = np.zeros((1, 4, 8), np.float16)
    k.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ops.shift_keys(k, 1)


def test_empty_rope_input():
    with pytest.raises(ValueError, match="empty"):
        ops.apply_rope(np.zeros((2, 0, 8), np.float32), np.zeros(0, np.int64))


def test_conversion_rejects():
    with pytest.raises(TypeError, match="x must have dtype float32"):
        ops.to_float16(np.zeros(4, np.float64))
    with pytest.raises(TypeError, match="x must have dtype float16"):
        ops.to_float32(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        ops.to_float16(np.zeros(4, np.float32), out=np.zeros(5, np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.to_float32(np.zeros(8, np.float16)[::2])
