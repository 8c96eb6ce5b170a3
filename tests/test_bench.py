"""python -m kvsimd.bench: every subcommand in --quick mode writes JSON that follows the
documented schema (kvsimd.bench.schema) with positive, finite figures.  Speed is never asserted."""
import copy
import json
import os
import subprocess
import sys

import pytest

from kvsimd.bench import report, schema
from kvsimd.bench.__main__ import OVERVIEW, SUBCOMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the quality bench's text: the team's shared/ folder beside the checkout (as CI lays it out)
TEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "hamlet_gut.txt")


try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False
PLOT_HINT = 'pip install -e ".[plot]"'


def run_bench(tmp_path, *args, expect_rc=0, env=None):
    out = tmp_path / "bench.json"
    env = dict(os.environ if env is None else env, KVSIMD_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", *args, "--quick", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == expect_rc, p.stderr[-3000:]
    return json.loads(out.read_text()), p


def check_missing_matplotlib_message(p, json_path):
    """Without matplotlib, --plot ends in exit 1 and one line on stderr that says so, gives the
    install hint that works from a source checkout, and names the JSON already written."""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr[-3000:]
    assert "needs matplotlib" in lines[0] and PLOT_HINT in lines[0] and str(json_path) in lines[0]


HEADINGS = {"roofline": "### Roofline", "attention": "### Decode attention", "rope": "### K-cache shift",
            "decode": "### Decode (tokens/s", "complexity": "### Complexity", "streaming": "### Infinite generation",
            "quality": "### Perplexity"}


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_quick_json(tmp_path, sub):
    plot = sub in ("attention", "complexity")
    doc, p = run_bench(tmp_path, sub, *(["--plot", str(tmp_path)] if plot else []),
                       *(["--text", TEXT] if sub == "quality" else []),
                       expect_rc=1 if plot and not HAVE_MATPLOTLIB else 0)
    if plot and not HAVE_MATPLOTLIB:
        check_missing_matplotlib_message(p, tmp_path / "bench.json")
    schema.validate(doc)
    assert list(doc["results"]) == [sub]
    md = report.render(doc, quality=doc if sub == "quality" else None)
    assert HEADINGS[sub] in md
    rows = doc["results"][sub]
    if sub == "attention":
        impls = {r["impl"] for r in rows}
        assert {"kvsimd", "numpy", "torch-sdpa"} <= impls
        assert {r["isa"] for r in rows if r["impl"] == "kvsimd"} == set(doc["header"]["isa"]["supported"])
        assert not HAVE_MATPLOTLIB or (tmp_path / "attention.png").stat().st_size > 1000
    if sub == "roofline":
        assert {r["kind"] for r in rows} == {"read", "write", "copy", "fma"}
        assert {r["where"] for r in rows if r["kind"] != "fma"} == {"dram", "llc"}
    if sub == "complexity":
        seed = {r["regime"]: r for r in rows if r["op"] == "complexity-seed003"}
        assert {k: v["token_positions"] for k, v in seed.items()} == schema_counts()
        assert not HAVE_MATPLOTLIB or (tmp_path / "complexity.png").stat().st_size > 1000
    if sub == "decode":
        assert {r["impl"] for r in rows} == {"kvsimd", "transformers", "weights floor"}
    if sub == "streaming":
        assert {r["op"] for r in rows} == {"streaming-memory", "streaming-drift", "streaming-overhead"}
    if sub == "quality":
        assert len(doc["curves"]) == len(rows)


def test_plot_without_matplotlib_keeps_the_results(tmp_path):
    """matplotlib hidden (whether or not it is installed): the JSON is written before the charts,
    and the missing extra is one line with a hint that works from a source checkout."""
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), ROOT]))
    doc, p = run_bench(tmp_path, "complexity", "--plot", str(tmp_path / "png"), expect_rc=1, env=env)
    schema.validate(doc)
    assert list(doc["results"]) == ["complexity"]
    check_missing_matplotlib_message(p, tmp_path / "bench.json")
    assert not list((tmp_path / "png").glob("*.png"))


def test_quality_curves_plot_from_the_json_document(tmp_path):
    """The streaming NLL chart is drawn from the curves as the JSON stores them (None where a
    position was not scored), after the JSON is written, like every other chart."""
    from kvsimd.bench import plots
    doc = _doc()
    doc["curves"] = {"dense": [1.0, 2.0, None, 3.0], "W=64 oracle (re-prefill)": [None, 2.0, None, 3.0]}
    if not HAVE_MATPLOTLIB:
        with pytest.raises(plots.PlotUnavailable, match=r"needs matplotlib.*pip install -e \"\.\[plot\]\""):
            plots.write_all(doc, str(tmp_path))
        return
    paths = plots.write_all(doc, str(tmp_path))
    assert [os.path.basename(x) for x in paths] == ["decode.png", "streaming_nll.png"]
    assert all(os.path.getsize(x) > 1000 for x in paths)


def test_decode_contention_quick_json(tmp_path):
    """decode --contention: 1 thread, 2 threads and the default, with and without a busy
    neighbour, each as a paired ratio to 1 thread; the neighbour process is gone afterwards."""
    doc, p = run_bench(tmp_path, "decode", "--contention")
    schema.validate(doc)
    rows = doc["results"]["contention"]
    assert list(doc["results"]) == ["contention"]
    assert {(r["neighbour"], r["setting"]) for r in rows} == {(n, s) for n in ("none", "busy core")
                                                              for s in ("1 thread", "2 threads", "default")}
    from kvsimd import threads
    assert {r["threads"] for r in rows if r["setting"] == "default"} == {threads.default_num_threads()}
    assert all(r["vs_1_thread"] == 1 and r["vs_1_thread_ci95"] == [1, 1] for r in rows if r["setting"] == "1 thread")
    assert "### Decode beside a busy core" in report.render(doc)


def test_busy_neighbour_spins_on_one_core_and_is_gone_after():
    from kvsimd.bench.contention import BusyNeighbour
    with BusyNeighbour() as nb:
        assert nb.proc.poll() is None
        assert os.sched_getaffinity(nb.proc.pid) == {max(os.sched_getaffinity(0))}
        with open("/proc/%d/stat" % nb.proc.pid) as fh:
            assert fh.read().rsplit(")", 1)[1].split()[0] == "R"      # running, not sleeping
    assert nb.proc.poll() is not None


def test_contention_flag_needs_decode():
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", "attention", "--contention"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "--contention goes with the decode subcommand" in p.stderr


def schema_counts():
    from kvsimd.bench.complexity import SEED_COUNTS
    return SEED_COUNTS


def test_overview_covers_every_section_but_quality():
    assert set(OVERVIEW) == set(SUBCOMMANDS) - {"quality"}


def _doc():
    return {"schema": schema.SCHEMA_VERSION,
            "header": {"machine": {"cpu": "x", "cores": 2, "llc_bytes": 1 << 25}, "versions": {},
                       "isa": {"active": "avx2"}, "argv": [],
                       "roofline": {"read_GBps": 10.0, "copy_GBps": 12.0}},
            "results": {"decode": [{"model": "m", "impl": "kvsimd", "context": 128, "threads": 1, "tok_per_s": 3.0}]}}


@pytest.mark.parametrize("breakage", [
    lambda d: d.update(schema=0),
    lambda d: d["header"].pop("roofline"),
    lambda d: d["header"]["roofline"].update(read_GBps=float("nan")),
    lambda d: d["results"]["decode"][0].pop("tok_per_s"),
    lambda d: d["results"]["decode"][0].update(tok_per_s=-1.0),
    lambda d: d["results"]["decode"][0].update(tok_per_s=float("inf")),
    lambda d: d["results"].update(other=[{}]),
    lambda d: d["results"].update(decode=[]),
])
def test_schema_rejects_broken_documents(breakage):
    good = _doc()
    assert schema.validate(good)
    bad = copy.deepcopy(good)
    breakage(bad)
    with pytest.raises(ValueError):
        schema.validate(bad)


def test_bad_flags_fail_clearly(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", "attention", "--isa", "nope"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "not supported" in p.stderr


def test_report_replaces_only_the_marked_readme_section(tmp_path):
    doc = tmp_path / "r.json"
    d = _doc()
    doc.write_text(json.dumps(d))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n%s\nold table\n%s\noutro\n" % (report.BEGIN, report.END))
    assert report.main([str(doc), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert "| m | 128 | 1 | 3.0 |" in text
    readme.write_text("no markers")
    with pytest.raises(SystemExit):
        report.main([str(doc), "--readme", str(readme)])


# ---------------------------------------------------------------------------------- the text file
def test_text_path_precedence(tmp_path):
    """--text, else $KVSIMD_BENCH_TEXT, else $KVSIMD_SHARED_DIR/data/hamlet_gut.txt."""
    from kvsimd.bench.common import text_path
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    (tmp_path / "data").mkdir()
    shared = tmp_path / "data" / "hamlet_gut.txt"
    for f in (a, b, shared):
        f.write_text("x")
    env = {"KVSIMD_BENCH_TEXT": str(b), "KVSIMD_SHARED_DIR": str(tmp_path)}
    assert text_path(str(a), environ=env) == str(a)
    assert text_path(None, environ=env) == str(b)
    assert text_path(None, environ={"KVSIMD_SHARED_DIR": str(tmp_path)}) == str(shared)
    assert text_path(None, required=False, environ={}) is None
    assert text_path(None, required=False, environ={"KVSIMD_BENCH_TEXT": ""}) is None


@pytest.mark.parametrize("given, env, message", [
    (None, {}, r"^no text file given: pass --text PATH, or set KVSIMD_BENCH_TEXT=PATH or KVSIMD_SHARED_DIR=DIR"),
    ("/nonexistent/t.txt", {}, r"^--text /nonexistent/t\.txt: no such file .*KVSIMD_BENCH_TEXT.*KVSIMD_SHARED_DIR"),
    (None, {"KVSIMD_BENCH_TEXT": "/nonexistent/t.txt"}, r"^KVSIMD_BENCH_TEXT=/nonexistent/t\.txt: no such file"),
    (None, {"KVSIMD_SHARED_DIR": "/nonexistent"},
     r"^KVSIMD_SHARED_DIR=/nonexistent \(read as /nonexistent/data/hamlet_gut\.txt\): no such file"),
])
def test_text_path_refuses_clearly(given, env, message):
    from kvsimd import KVSimdValueError
    from kvsimd.bench.common import text_path
    with pytest.raises(KVSimdValueError, match=message):
        text_path(given, environ=env)
    if given is None and env:       # a variable that is set but wrong is an error even when optional
        with pytest.raises(KVSimdValueError, match=message):
            text_path(given, required=False, environ=env)


def _no_text_env():
    return {k: v for k, v in os.environ.items() if k not in ("KVSIMD_BENCH_TEXT", "KVSIMD_SHARED_DIR")}


@pytest.mark.parametrize("argv, extra_env, names", [
    (["-m", "kvsimd.bench", "quality", "--quick"], {}, ["--text", "KVSIMD_BENCH_TEXT", "KVSIMD_SHARED_DIR"]),
    (["-m", "kvsimd.bench", "quality", "--quick", "--text", "/nonexistent/t.txt"], {}, ["--text /nonexistent/t.txt"]),
    (["-m", "kvsimd.bench", "decode", "--model", "smollm2", "--quick"], {"KVSIMD_SHARED_DIR": "/nonexistent"},
     ["KVSIMD_SHARED_DIR=/nonexistent"]),
    (["-m", "kvsimd.bench.quality", "policies"], {}, ["--text", "KVSIMD_BENCH_TEXT", "KVSIMD_SHARED_DIR"]),
    (["-m", "kvsimd.bench.quality", "oracle"], {"KVSIMD_BENCH_TEXT": "/nonexistent/t.txt"},
     ["KVSIMD_BENCH_TEXT=/nonexistent/t.txt"]),
])
def test_missing_text_is_one_line_and_exit_2(tmp_path, argv, extra_env, names):
    """Run from elsewhere than the checkout (as an installed package would be): no text found is
    one line naming the argument and the variables, exit 2, before any model or timing runs."""
    env = dict(_no_text_env(), PYTHONPATH=ROOT, **extra_env)
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "error:" in lines[0] and all(n in lines[0] for n in names), lines
    assert "roofline" not in p.stdout


def test_text_flag_goes_with_the_subcommands_that_read_text():
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", "attention", "--text", TEXT],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "--text goes with quality or decode --model smollm2" in p.stderr


# ---------------------------------------------------------------------------------- import path
def test_plotting_and_report_stay_out_of_the_import_path():
    """import kvsimd (and kvsimd.bench, and the bench modules that run measurements) imports
    neither matplotlib nor the chart and README modules: those load only for --plot / report."""
    code = ("import sys, kvsimd\n"
            "def check(when):\n"
            "    bad = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'\n"
            "                 or m in ('kvsimd.bench.plots', 'kvsimd.bench.report'))\n"
            "    if bad:\n"
            "        sys.exit('%s imported %s' % (when, bad))\n"
            "check('import kvsimd')\n"
            "import kvsimd.bench\n"
            "check('import kvsimd.bench')\n"
            "import kvsimd.observe, kvsimd.bench.__main__, kvsimd.bench.common, kvsimd.bench.complexity, "
            "kvsimd.bench.kernels, kvsimd.bench.decode, kvsimd.bench.quality, kvsimd.bench.streaming, "
            "kvsimd.bench.contention\n"
            "check('the measuring modules')\n"
            "import kvsimd.bench.plots\n"
            "print('plots' if 'kvsimd.bench.plots' in sys.modules else 'no plots')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "plots"       # the check sees a module once it is imported


# ---------------------------------------------------------------------------------- A/B script
def test_ab_compare_runs_two_trees_interleaved(tmp_path):
    """bench/ab_compare.py on two copies of one tree (this checkout twice): every case of both
    sides, rounds alternating which side goes first, a ratio inside its own interval."""
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_compare.py"), ROOT, ROOT, "--quick",
                        "--rounds", "2", "--sections", "attention", "--json", str(out)],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "round 1/2 done (new first)" in p.stderr and "round 2/2 done (old first)" in p.stderr
    doc = json.loads(out.read_text())
    assert len(doc["new"]["runs"]) == len(doc["old"]["runs"]) == 2
    assert all(r["kvsimd"] == os.path.join(ROOT, "kvsimd") for r in doc["new"]["runs"] + doc["old"]["runs"])
    cases = {r["case"] for r in doc["rows"]}
    assert cases == {"attention smollm2-gqa %s N=%d" % (dt, n) for dt in ("float16", "float32")
                     for n in (512, 2048)} | {"attention: every case pooled"}
    for r in doc["rows"]:
        n = 2 if "pooled" not in r["case"] else 8
        for key in ("ratio", "control_ratio"):      # new/old, and new/old relative to the paired plain read
            lo, hi = r[key + "_ci95"]
            assert 0 < lo <= r[key] <= hi and len(r[key + "s"]) == n
        assert r["case"] in p.stdout
    run = doc["new"]["runs"][0]["times"]
    case = "attention smollm2-gqa float16 N=512"
    assert run[case] > 0 and run[case + " | control"] > 0


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/tree", ROOT], "new /nonexistent/tree is neither a kvsimd checkout nor a Python interpreter"),
    ([ROOT, os.path.join(ROOT, "tests")], "is a folder without kvsimd/__init__.py"),
    ([ROOT, ROOT, "--rounds", "1"], "--rounds must be >= 2"),
    ([ROOT, ROOT, "--sections", "rope"], "--sections takes a comma list of decode, attention, prefill"),
])
def test_ab_compare_refuses_bad_arguments(args, message):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_compare.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
