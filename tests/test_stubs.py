"""The type stubs of the compiled core (kvsimd/_kvsimd.pyi) agree with the built module, and the
pure-Python modules type-check against them: mypy's stubtest, which fails on a function, argument
or class that one side has and the other lacks."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stubtest_finds_no_disagreement():
    pytest.importorskip("mypy", reason="the test extra installs mypy")
    import kvsimd
    pkg = os.path.dirname(kvsimd.__file__)
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "kvsimd", "--mypy-config-file",
                        os.path.join(ROOT, "pyproject.toml"), "--allowlist",
                        os.path.join(pkg, "_stubtest_allowlist.txt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
