"""Cases that must end in a KVSimdError whose message matches a pattern, all run in ONE child
process per test module, so that a crash (the defect under test) fails those cases instead of
the whole test run.  A module keeps its own registry::

    CASES = {}
    case = childcases.registrar(CASES)
    child_results = childcases.results_fixture(__name__, CASES)

    @case(r"cache must be a kvsimd.KVCache")
    def prefill_without_cache(): ...

    @pytest.mark.parametrize("name", list(CASES))
    def test_x(name, child_results):
        childcases.check(name, child_results, CASES)
"""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def registrar(cases):
    def case(pattern):
        """Register a callable that must raise a KVSimdError whose message matches ``pattern``."""
        def deco(fn):
            cases[fn.__name__] = (fn, pattern)
            return fn
        return deco
    return case


def run_here(cases, names):
    """In the child: run the named cases, one tab-separated result line each."""
    from kvsimd import KVSimdError
    for name in names:
        try:
            cases[name][0]()
            res = ("NOERROR", "", "")
        except KVSimdError as e:
            res = ("KVSIMD", type(e).__name__, str(e))
        except BaseException as e:  # noqa: B902 - reported to the parent
            res = ("OTHER", type(e).__name__, str(e))
        print("\t".join((name,) + tuple(x.replace("\t", " ").replace("\n", " ") for x in res)), flush=True)


def results_fixture(module, cases):
    """A module-scoped fixture: every case of ``module`` run in one child process."""
    @pytest.fixture(scope="module")
    def child_results():
        code = ("import sys; sys.path.insert(0, %r); import childcases, %s as t; childcases.run_here(t.CASES, sys.argv[1:])"
                % (HERE, module))
        env = dict(os.environ, KVSIMD_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", code] + list(cases), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        res = {}
        for line in r.stdout.splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                res[parts[0]] = parts[1:]
        return res, r.returncode, r.stderr
    return child_results


def check(name, child_results, cases):
    res, rc, err = child_results
    assert name in res, "the child process died (exit status %d) before case %s:\n%s" % (rc, name, err[-3000:])
    kind, cls, msg = res[name]
    assert kind == "KVSIMD", "%s: expected a KVSimdError, got %s %s: %s" % (name, kind, cls, msg)
    assert re.search(cases[name][1], msg), "%s: %s: %s" % (name, cls, msg)
