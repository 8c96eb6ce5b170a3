"""Shared fixtures: the ISA paths to test, a reproducible seed, hypothesis profiles."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import kvsimd
from kvsimd.testing import use_isa

settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])
# CI replays the same examples every run (reproducible); dev runs explore new ones
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("KVSIMD_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

INFO = kvsimd.isa_info()
# Paths this CPU runs natively.  avx512fp16 is compiled but runs only in the emulator here:
# tests/test_avx512fp16_emu.py executes the same machine code in an emulated Sapphire Rapids.
NATIVE_ISAS = INFO["supported"]
SIMD_ISAS = [isa for isa in NATIVE_ISAS if isa != "scalar"]


@pytest.fixture(params=NATIVE_ISAS)
def isa(request):
    """Run the test on each ISA path this CPU supports."""
    with use_isa(request.param):
        yield request.param


@pytest.fixture
def seed():
    return int(os.environ.get("KVSIMD_TEST_SEED", "20261122"))


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)
