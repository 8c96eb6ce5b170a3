"""fp32 <-> fp16 conversion on every compiled ISA row (the ``row`` fixture: native, or emulated
when this CPU lacks the row): bit-identical to NumPy's casts, including inf, NaN payloads,
subnormals and rounding ties, and never a write outside the output (the runners check)."""
import numpy as np
import pytest

from kvsimd import ops


def all_halves():
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def interesting_floats(rng):
    """Every rounding boundary that matters, plus random bit patterns and NaN payloads."""
    special = np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,             # zeros, infs
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F802000, 0x7FA00000,  # NaNs with payloads
        0x7FBFFFFF, 0xFF800001, 0x7F801FFF,
        0x477FEFFF, 0x477FF000, 0x477FE000, 0x47800000,             # around 65504 / 65520
        0x38800000, 0x387FFFFF, 0x387FC000, 0x387FE000,             # smallest normal half
        0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000, 0x33C00000,  # around 2^-25 / 2^-24
        0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001,             # ties at 1.0
    ], dtype=np.uint32)
    halves = all_halves().astype(np.float32).view(np.uint32)
    # exact midpoints between consecutive halves (ties) and their neighbours
    mids = ((halves[:-1].astype(np.uint64) + halves[1:]) // 2).astype(np.uint32)
    rand = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([special, halves, mids, mids + 1, mids - 1, rand])
    return bits.view(np.float32)


def test_to_float32_all_halves_bit_identical(row):
    h = all_halves()
    out = row.to_float32(h)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.view(np.uint32), h.astype(np.float32).view(np.uint32))


def test_to_float16_bit_identical(row, rng):
    f = interesting_floats(rng)
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    got = row.to_float16(f).view(np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(hex(f.view(np.uint32)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 1000, 1001])
def test_lengths_round_trip(row, rng, n):
    """Every vector-width tail, both directions (unaligned and guarded: see the runners)."""
    f = (rng.standard_normal(n) * 100).astype(np.float32)
    h = row.to_float16(f)
    np.testing.assert_array_equal(h.view(np.uint16), f.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(row.to_float32(h), f.astype(np.float16).astype(np.float32))


# ---------------------------------------------------------------- the Python API (native rows)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 33, 1001])
def test_lengths_and_shapes(isa, rng, n):
    f = rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(ops.to_float16(f).view(np.uint16), f.astype(np.float16).view(np.uint16))
    m = rng.standard_normal((3, n, 2)).astype(np.float16)
    out = np.empty((3, n, 2), np.float32)
    assert ops.to_float32(m, out=out) is out
    np.testing.assert_array_equal(out, m.astype(np.float32))


def test_no_write_past_the_end(isa, rng):
    f = rng.standard_normal(37).astype(np.float32)
    buf = np.full(64, 0x5A5A, np.uint16)
    ops.to_float16(f, out=buf[:37].view(np.float16))
    assert np.all(buf[37:] == 0x5A5A)
