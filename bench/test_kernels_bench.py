"""pytest-benchmark suites over the same case lists as `python -m kvsimd.bench`.

    pytest bench/ --benchmark-only            (plain `pytest` does not collect this folder)

One benchmarked call per test, parametrized ISA x case; the result is checked once, outside
the timed call, against the float64 reference."""
import numpy as np
import pytest

import kvsimd
from kvsimd import ops, reference
from kvsimd.bench import cases
from kvsimd.bench.common import fill
from kvsimd.testing import use_isa

ISAS = kvsimd.isa_info()["supported"]
CONTEXTS = [512, 2048]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", cases.ATTN_SHAPES, ids=[s[0] for s in cases.ATTN_SHAPES])
@pytest.mark.parametrize("N", CONTEXTS)
@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_attend(benchmark, isa, shape, N, dtype):
    name, H, Hkv, D = shape
    k, v, q = fill((Hkv, N, D), dtype, 1), fill((Hkv, N, D), dtype, 2), fill((H, D), np.float32, 3)
    out = np.empty((H, D), np.float32)
    benchmark.group = "attend %s N=%d %s" % (name, N, dtype)
    benchmark.extra_info.update(isa=isa, bytes=k.nbytes + v.nbytes)
    with use_isa(isa):
        benchmark(ops.attend, q, k, v, out=out)
    ref = reference.attend(q, k, v)
    assert np.abs(out - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", cases.ATTN_SHAPES, ids=[s[0] for s in cases.ATTN_SHAPES])
@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_shift_keys(benchmark, isa, shape, dtype):
    name, _, Hkv, D = shape
    k = fill((Hkv, 2048, D), dtype, 1)
    benchmark.group = "shift_keys %s %s" % (name, dtype)
    benchmark.extra_info.update(isa=isa, bytes=2 * k.nbytes)
    with use_isa(isa):
        benchmark(ops.shift_keys, k, 1)
    assert np.isfinite(k.astype(np.float32)).all()
