"""python -m kvsimd.bench: every subcommand in --quick mode writes JSON that follows the
documented schema (kvsimd.bench.schema) with positive, finite figures.  Speed is never asserted."""
import argparse
import copy
import json
import os
import subprocess
import sys

import numpy as np
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
            "quality": "### Perplexity", "hf": "### transformers with kvsimd"}


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
        ceil = [r for r in rows if r["op"] == "attend-ceiling"]
        assert {r["isa"] for r in ceil} == set(doc["header"]["isa"]["supported"]) and {r["threads"] for r in ceil} >= {1}
        for r in ceil:
            G = r["H"] // r["Hkv"]
            assert r["ceiling_GBps"] == min(r["read_GBps"], r["fma_GFLOPs"] / G)
            assert r["binds"] == ("memory" if r["read_GBps"] <= r["fma_GFLOPs"] / G else "compute")
            # paired: each repeat's call against a read of the same K and V beside it, median of the shares
            nb = 2 * r["Hkv"] * r["N"] * r["D"] * 2
            ts, tr = np.array(r["times_s"]), np.array(r["read_times_s"])
            assert len(ts) == len(tr) >= 3 and abs(r["median_s"] - np.median(ts)) <= 1e-12 * r["median_s"]
            assert abs(r["read_GBps"] - nb / np.median(tr) / 1e9) < 1e-9 * r["read_GBps"]
            share = (nb / ts / 1e9) / np.minimum(nb / tr / 1e9, r["fma_GFLOPs"] / G)
            assert abs(r["pct_ceiling"] - 100 * np.median(share)) < 1e-9
            lo, hi = r["pct_ceiling_ci95"]
            assert 100 * share.min() <= lo <= r["pct_ceiling"] <= hi <= 100 * share.max()
        assert "Against its ceiling" in md
        i8 = [r for r in rows if r["op"] == "attend-int8"]
        assert {r["isa"] for r in i8} == set(doc["header"]["isa"]["supported"])
        for r in i8:
            nb = -(-r["D"] // 32)
            assert r["bytes_per_token"] == 2 * r["Hkv"] * (r["D"] + 4 * nb)      # int8 + float32 block scales
            assert r["fp16_bytes_per_token"] == 2 * r["Hkv"] * r["D"] * 2
            assert r["ratio_ci95"][0] <= r["ratio"] <= r["ratio_ci95"][1]
        i4 = [r for r in rows if r["op"] == "attend-int4"]
        assert {r["isa"] for r in i4} == set(doc["header"]["isa"]["supported"])
        for r in i4:
            nb = -(-r["D"] // 32)
            assert r["bytes_per_token"] == 2 * r["Hkv"] * (16 * nb + 4 * nb)  # 4 bits a value + the block scales
            assert r["ratio_ci95"][0] <= r["ratio"] <= r["ratio_ci95"][1]
        mixed = [r for r in rows if r["op"] == "attend-int8/int4"]
        assert {r["isa"] for r in mixed} == set(doc["header"]["isa"]["supported"])
        for r in mixed:
            nb = -(-r["D"] // 32)
            assert r["bytes_per_token"] == r["Hkv"] * (r["D"] + 16 * nb + 8 * nb)   # int8 keys, int4 values
            assert r["ratio_ci95"][0] <= r["ratio"] <= r["ratio_ci95"][1]
        assert "An int8 and an int4 KV cache" in md and "int8/int4" in md
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


def test_quality_paired_ratio_against_statistics():
    """quality.paired_ratio: PPL over PPL on the same positions, with a block-bootstrap interval.
    Checked against what the construction implies, not against a copy of the code: a constant
    shift c of the NLL is a ratio of exactly e^c with a zero-width interval whatever the text's
    own difficulty; an offset shared by each block of 64 positions (losses of neighbouring tokens
    move together) gives a half-width of 1.96 sd / sqrt(blocks) and holds the true shift about 95%
    of the time; NaN positions are skipped."""
    from kvsimd.bench import quality
    rng = np.random.default_rng(3)
    base = rng.gamma(2.0, 1.5, 8192)                  # the text's difficulty: large, shared by both
    r, lo, hi = quality.paired_ratio(base + 0.01, base)
    assert r == pytest.approx(np.exp(0.01), rel=1e-12) and lo == pytest.approx(r) and hi == pytest.approx(r)
    sd, nb = 0.02, 8192 // quality.PAIRED_BLOCK
    offsets = np.repeat(rng.normal(0.0, sd, nb), quality.PAIRED_BLOCK)
    r, lo, hi = quality.paired_ratio(base + 0.005 + offsets, base)
    assert r == pytest.approx(np.exp(0.005 + offsets.mean()), rel=1e-12)
    half = (np.log(hi) - np.log(lo)) / 2
    assert half == pytest.approx(1.96 * sd / np.sqrt(nb), rel=0.25)
    assert lo < r < hi
    # coverage: over 200 texts the interval holds the true shift, 0.5%, about 95% of the time
    hits = 0
    for seed in range(200):
        off = np.repeat(np.random.default_rng(100 + seed).normal(0.0, sd, nb), quality.PAIRED_BLOCK)
        _, lo_s, hi_s = quality.paired_ratio(base + 0.005 + off, base, n_boot=500, seed=seed)
        hits += lo_s < np.exp(0.005) < hi_s
    assert 0.88 * 200 <= hits <= 0.99 * 200
    # the same per-position noise without the blocks' common part: a far narrower interval
    r2, lo2, hi2 = quality.paired_ratio(base + 0.005 + rng.permutation(offsets), base)
    assert np.log(hi2) - np.log(lo2) < 0.5 * (np.log(hi) - np.log(lo))
    gappy = base + 0.01
    gappy[::3] = np.nan                               # an oracle's unscored positions
    assert quality.paired_ratio(gappy, base)[0] == pytest.approx(np.exp(0.01), rel=1e-12)
    with pytest.raises(ValueError, match="8192 and 10"):
        quality.paired_ratio(base, base[:10])


def test_quality_summary_pairs_each_dtype_with_float16():
    """summarize: "<config> <dtype>" rows carry their PPL over float16's of the same configuration
    (int8/int4 is not mistaken for int4); float16 and oracle rows carry none; the report shows it."""
    from kvsimd.bench import quality
    rng = np.random.default_rng(4)
    base = rng.gamma(2.0, 1.5, 512)
    curves = {"dense": base, "dense int8": base + 0.003, "dense int8/int4": base + 0.02, "dense int4+32": base + 0.001,
              "W=64 4 sinks + shift": base + 0.1, "W=64 4 sinks + shift int4": base + 0.15,
              "W=64 oracle (re-prefill)": np.where(np.arange(512) % 8 == 0, base, np.nan)}
    rows = {r["config"]: r for r in quality.summarize(curves, 8)}
    assert rows["dense int8"]["vs_float16"] == pytest.approx(np.exp(0.003), rel=1e-12)
    assert rows["dense int8/int4"]["vs_float16"] == pytest.approx(np.exp(0.02), rel=1e-12)
    assert rows["dense int4+32"]["vs_float16"] == pytest.approx(np.exp(0.001), rel=1e-12)
    assert rows["W=64 4 sinks + shift int4"]["vs_float16"] == pytest.approx(np.exp(0.05), rel=1e-12)
    assert [c for c, r in rows.items() if "vs_float16" not in r] == ["dense", "W=64 4 sinks + shift",
                                                                     "W=64 oracle (re-prefill)"]
    doc = _doc()
    doc["results"] = {"quality": list(rows.values())}
    schema.validate(doc)
    md = report.quality_md(doc)
    assert "| dense int8/int4 |" in md and "+2.02% [+2.02, +2.02]" in md


def test_quality_merge_pairs_runs_and_refuses_different_lengths(tmp_path):
    """python -m kvsimd.bench.quality merge: runs of one dtype each (as the README's 8,192-token
    measurement makes them) are paired with float16's; runs over different --tokens are one line
    on stderr and exit 2, not a traceback."""
    base = np.random.default_rng(5).gamma(2.0, 1.5, 256)
    np.savez(tmp_path / "f16.npz", **{"dense": base})
    np.savez(tmp_path / "i8.npz", **{"dense int8": base + 0.004})
    np.savez(tmp_path / "short.npz", **{"dense int8/int4": base[:100] + 0.01})
    cmd = [sys.executable, "-m", "kvsimd.bench.quality", "merge"]
    p = subprocess.run(cmd + [str(tmp_path / "f16.npz"), str(tmp_path / "i8.npz")], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "dense int8" in p.stdout and "vs float16 +0.40% [+0.40, +0.40]" in p.stdout
    p = subprocess.run(cmd + [str(tmp_path / "f16.npz"), str(tmp_path / "short.npz")], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        "python -m kvsimd.bench.quality: error: 'dense int8/int4' has 100 positions and 'dense' 256: "
        "runs over different --tokens cannot be paired"]


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


@pytest.mark.parametrize("args, message", [
    (["decode", "--model", "smollm2", "--kv-dtype", "int8"], "--kv-dtype goes with the quality subcommand"),
    (["attention", "--kv-dtype", "int4"], "--kv-dtype goes with the quality subcommand"),
    (["decode", "--kv-int8"], "--kv-int8, --kv-int4 and --kv-recent go with decode of a GGUF model"),
    (["quality", "--kv-int4"], "--kv-int8, --kv-int4 and --kv-recent go with decode of a GGUF model"),
    (["quality", "--kv-recent", "32"], "--kv-int8, --kv-int4 and --kv-recent go with decode of a GGUF model"),
    (["decode", "--model", "smollm2", "--kv-recent", "0"], "--kv-recent must be >= 1"),
    (["quality", "--kv-dtype", "int4+0"], "a quantized one with +R"),
    (["quality", "--kv-dtype", "float16+8"], "a quantized one with +R"),
    (["quality", "--kv-dtype", "int3"], "a quantized one with +R")])
def test_cache_dtype_flags_name_their_subcommand(args, message):
    """A cache-dtype flag given to a subcommand that does not read it is one error line and exit 2,
    before anything runs (decode --kv-dtype int8 timed float16 caches only, saying nothing)."""
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr and "roofline" not in p.stdout


def schema_counts():
    from kvsimd.bench.complexity import SEED_COUNTS
    return SEED_COUNTS


def test_overview_covers_every_section_but_quality_and_hf():
    """quality reads a text for minutes; hf needs transformers and the real model: both on demand."""
    assert set(OVERVIEW) == set(SUBCOMMANDS) - {"quality", "hf"}


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


def test_report_joins_runs_of_one_machine(tmp_path):
    """--also: the rows of a second run (e.g. decode --model) join the main run's, and the machine
    line names it; runs on another CPU are refused."""
    main, other = _doc(), _doc()
    other["header"]["argv"] = ["decode", "--model", "smollm2"]
    other["results"]["decode"][0].update(model="n", context=4096, tok_per_s=2.0)
    paths = []
    for name, d in (("a.json", main), ("b.json", other)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(d))
    readme = tmp_path / "README.md"
    readme.write_text("%s\n%s\n" % (report.BEGIN, report.END))
    assert report.main([str(paths[0]), "--also", str(paths[1]), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "| m | 128 | 1 | 3.0 |" in text and "| n | 4096 | 1 | 2.0 |" in text
    assert "With `python -m kvsimd.bench decode --model smollm2`" in text
    other["header"]["machine"]["cpu"] = "y"
    with pytest.raises(ValueError, match="different machines"):
        report.merge(main, [other])


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


@pytest.mark.parametrize("argv, n", [
    (["-m", "kvsimd.bench", "quality", "--quick"], 256),
    (["-m", "kvsimd.bench.quality", "policies", "--tokens", "300"], 300),
])
@pytest.mark.parametrize("words", [0, 30])
def test_text_too_short_for_the_run_is_one_line_and_exit_2(tmp_path, argv, n, words):
    """A text that gives fewer tokens than the run reads (one more than it scores, from character
    20,000 on) is one line naming the file, the tokens it gave and the tokens needed, exit 2, before
    any model or timing runs: shorter than 20,000 characters it was a traceback from the run, a
    little longer a run that printed "PPL all nan"."""
    from kvsimd.bench.quality import TEXT_START
    text = tmp_path / "short.txt"
    text.write_text("x" * (100 if not words else TEXT_START) + " the king" * words)
    p = subprocess.run([sys.executable, *argv, "--text", str(text)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "error: text %s: " % text in lines[0] and "needs %d" % (n + 1) in lines[0], lines
    if not words:
        assert ": 0 tokens after its first %d characters" % TEXT_START in lines[0], lines
    else:
        got = int(lines[0].split("short.txt: ")[1].split()[0])
        assert 0 < got < n + 1, lines
    assert "roofline" not in p.stdout and "quality " not in p.stdout


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


def test_ab_compare_times_the_lanes_path_cases(tmp_path):
    """bench/ab_compare.py --sections lanes: each case (a prefill tile and an MQA decode step, the
    query-on-lanes path's calls) timed on both sides, with a ratio inside its interval."""
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_compare.py"), ROOT, ROOT, "--quick",
                        "--rounds", "2", "--sections", "lanes", "--json", str(out)],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {r["case"] for r in doc["rows"]} == {"lanes T=64 9/3/64 N=256", "lanes T=1 32/1/64 N=1024",
                                                "lanes: every case pooled"}
    for r in doc["rows"]:
        lo, hi = r["ratio_ci95"]
        assert 0 < lo <= r["ratio"] <= hi, r
    assert all(t > 0 for run in doc["new"]["runs"] + doc["old"]["runs"] for t in run["times"].values())


def test_ab_compare_times_decode_steps_of_a_gguf_file(tmp_path, tiny_gguf):
    """The gguf section: one case per KV-cache kind and depth, each side's median step time, the
    rounds alternating; the steps are real ones (a broken step fails the side)."""
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_compare.py"), ROOT, ROOT, "--rounds", "2",
                        "--sections", "gguf", "--model", tiny_gguf, "--depth", "40", "--depth", "7",
                        "--kv", "float16", "--kv", "int4+4", "--json", str(out)],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    name = os.path.basename(tiny_gguf)
    cases = {r["case"] for r in doc["rows"]}
    assert cases == {"gguf %s %s depth=%d" % (name, kind, d) for kind in ("float16", "int4+4")
                     for d in (40, 7)} | {"gguf: every case pooled"}
    for r in doc["rows"]:
        lo, hi = r["ratio_ci95"]
        assert 0 < lo <= r["ratio"] <= hi and "control_ratio" not in r
    assert all(t > 0 for run in doc["new"]["runs"] + doc["old"]["runs"] for t in run["times"].values())


@pytest.mark.parametrize("args, message", [
    ([ROOT, ROOT, "--sections", "gguf"], "the gguf section needs --model PATH"),
    ([ROOT, ROOT, "--sections", "gguf", "--model", "/nonexistent.gguf"], "no such file"),
    ([ROOT, ROOT, "--depth", "5"], "--depth and --kv go with --sections gguf"),
    ([ROOT, ROOT, "--sections", "gguf", "--model", __file__, "--depth", "0"], "--depth must be in 1..2**20"),
    ([ROOT, ROOT, "--sections", "gguf", "--model", __file__, "--kv", "int3"], "--kv a KV-cache kind is one of"),
    (["/nonexistent/tree", ROOT], "new /nonexistent/tree is neither a kvsimd checkout nor a Python interpreter"),
    ([ROOT, os.path.join(ROOT, "tests")], "is a folder without kvsimd/__init__.py"),
    ([ROOT, ROOT, "--rounds", "1"], "--rounds must be >= 2"),
    ([ROOT, ROOT, "--sections", "rope"], "--sections takes a comma list of decode, attention, prefill, lanes, gguf"),
])
def test_ab_compare_refuses_bad_arguments(args, message):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_compare.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


# ---------------------------------------------------------------------------------- in-cache attention script
@pytest.mark.parametrize("dtype", ["float16", "int8", "int4"])
def test_attn_rows_l2_times_every_row_asked(dtype):
    """bench/attn_rows_l2.py: one line per shape with each row asked for, in GFLOP/s and % of the
    row's peak, over float16, int8 or int4 K/V (their scales counted in the K+V bytes)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "attn_rows_l2.py"), "--isa", "scalar", "--isa",
                        "avx2", "--shape", "6/2/64/96", "--rounds", "2", "--dtype", dtype],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    head, line = p.stdout.strip().splitlines()
    assert "%s K/V" % dtype in head and "scalar" in head and "avx2" in head
    kib = {"float16": 2 * 2 * 96 * 64 * 2, "int8": 2 * (2 * 96 * 64 + 2 * 96 * 2 * 4),
           "int4": 2 * (2 * 96 * 32 + 2 * 96 * 2 * 4)}[dtype] / 2 ** 20
    assert line.startswith("6/2/64/96") and "K+V %5.2f MiB" % kib in line
    assert line.count("GFLOP/s") == 2 and "scalar" in line and "avx2" in line


@pytest.mark.parametrize("args, message", [
    (["--plot", "README.md", "--quick", "attention"], "--plot README.md: not a directory"),
    (["--threads", "2000", "--quick", "rope"], "--threads must be in 1..1024"),
    (["--repeat", "-1", "--quick", "rope"], "--repeat must be >= 1"),
    (["--quick", "--json", "/nonexistent/dir/x.json", "complexity"], "its directory does not exist"),
])
def test_bench_refuses_bad_arguments_before_it_runs(args, message):
    """python -m kvsimd.bench: a file where --plot wants a directory, more threads than kvsimd runs,
    no repeats, or a --json in no directory are one error line and exit 2, before the roofline."""
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "roofline" not in p.stdout


def test_bench_refuses_a_json_path_that_is_a_directory(tmp_path):
    """--json naming a directory is one error line and exit 2 before the roofline (it was found only
    when the results were written, an IsADirectoryError after the whole run)."""
    (tmp_path / "out.json").mkdir()
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", "attention", "--quick", "--json",
                        str(tmp_path / "out.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    message = "--json %s: a directory" % (tmp_path / "out.json")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "roofline" not in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--shape", "6/2/64"], "must be H/Hkv/D/N"),
    (["--rounds", "0"], "must be an integer >= 1"),
    (["--dtype", "bfloat16"], "invalid choice: 'bfloat16'"),
])
def test_attn_rows_l2_refuses_bad_arguments(args, message):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "attn_rows_l2.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


# ---------------------------------------------------------------------------------- one row of two trees
def test_kernel_ab_times_one_row_of_two_trees():
    """bench/kernel_ab.py with this checkout's HEAD against its work tree on the scalar row: a line
    per case (MQA over 40 query heads: the lanes path; a head_dim of 24; float16 and int8), both
    trees' medians and their ratio, and, the kernels being the same source, the same outputs to
    the last bit."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_ab.py"), "HEAD", ".", "--isa", "scalar",
                        "--shape", "40,1,32", "--shape", "4,2,24", "--tokens", "37", "--reps", "3",
                        "--dtype", "float16", "--dtype", "int8"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "OLD = A = HEAD, NEW = B = ., row scalar, 1 thread" and len(lines) == 5, p.stdout
    for line, case in zip(lines[1:], ["40/1/32 N=37 float16", "40/1/32 N=37 int8", "4/2/24 N=37 float16",
                                      "4/2/24 N=37 int8"]):
        assert line.startswith(case) and "B/A median" in line and line.endswith("max|A-B| 0"), line


@pytest.mark.parametrize("args, message", [
    (["--isa", "sse9"], "unknown row 'sse9'"),
    (["--shape", "32,1"], "expected H,HKV,D"),
    (["--shape", "32,5,128"], "HKV dividing H"),
    (["--reps", "0"], "--reps in 1..10000"),
    (["--tokens", str(2 ** 40)], "--tokens must be in 1..2**24"),
    (["--shape", "99999,1,64"], "H <= 4096"),
])
def test_kernel_ab_refuses_bad_arguments(args, message):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_ab.py"), ".", ".", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


# ---------------------------------------------------------------------------------- C microbenchmarks of the avx512 row
def _run_avx512_c(tmp_path, name, bad_length, timeout=300):
    """bench/<name>.c compiles with the avx512 row's flags on every machine (-Werror, through the
    script's build()); the script refuses a length outside (0, 100] (bad_length) with status 2;
    where the avx512 row does not run it says so with status 1 and None is returned, else the
    lines of a short run."""
    import kvsimd
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        module = __import__(name)
    finally:
        sys.path.pop(0)
    module.build(str(tmp_path / name))
    script = os.path.join(ROOT, "bench", name + ".py")
    p = subprocess.run([sys.executable, script, "--length", bad_length], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--length must be in (0, 100]" in p.stderr, p.stderr[-3000:]
    if "avx512" not in kvsimd.isa_info()["supported"]:
        p = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "does not run the avx512 row" in p.stderr, p.stderr[-3000:]
        return None
    p = subprocess.run([sys.executable, script, "--length", "0.02"], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()


def test_int8_dot_speed_builds_everywhere(tmp_path):
    """bench/int8_dot_speed.c (built from attn.inc.h's headers) compiles with the avx512 row's flags on
    every machine (a run takes minutes: not here)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import avx512_c
    finally:
        sys.path.pop(0)
    exe = tmp_path / "ids"
    avx512_c.build("int8_dot_speed", str(exe), werror=False)
    assert exe.stat().st_size > 0


def test_fp16_widen_cost_builds_everywhere_and_runs_on_the_avx512_row(tmp_path):
    """bench/fp16_widen_cost.py prints a header and one row per group of 2, 4 and 8 heads, every
    rate positive and each ratio the quotient of its two rates (to the printed digits)."""
    lines = _run_avx512_c(tmp_path, "fp16_widen_cost", "101")
    if lines is None:
        return
    assert lines[0].split() == ["heads", "fp32", "GFLOP/s", "fp16", "GFLOP/s", "int", "GFLOP/s", "fp16/fp32",
                                "int/fp32"] and len(lines) == 4, lines
    for line, heads in zip(lines[1:], (2, 4, 8)):
        n, a, b, c, ba, ca = line.split()
        a, b, c = float(a), float(b), float(c)
        assert int(n) == heads and min(a, b, c) > 0, line
        assert abs(float(ba) - b / a) <= 2e-3 + 0.06 / a and abs(float(ca) - c / a) <= 2e-3 + 0.06 / a, line


def test_lane_tile_loads_builds_everywhere_and_runs_on_the_avx512_row(tmp_path):
    """bench/lane_tile_loads.py prints a header and one row per measurement (loads, FMAs, the two
    lanes tiles), each with positive, ordered quartiles."""
    lines = _run_avx512_c(tmp_path, "lane_tile_loads", "0")
    if lines is None:
        return
    assert lines[0].split()[:4] == ["what", "q1", "median", "q3"], lines
    names = [" ".join(line.split()[:-3]) for line in lines[1:]]
    assert names == ["load zmm", "bcast zmm", "bcast ymm", "fma", "tile 2x8", "tile 4x6 pair"], lines
    for line in lines[1:]:
        q1, med, q3 = (float(x) for x in line.split()[-3:])
        assert 0 < q1 <= med <= q3, line


# ---------------------------------------------------------------------------------- GGUF files beside llama.cpp
TINY = dict(vocab=320, d=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, rope_theta=10000.0, context=512,
            tied=False)

try:
    import llama_cpp  # noqa: F401
    HAVE_LLAMA_CPP = True
except ImportError:
    HAVE_LLAMA_CPP = False


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from kvsimd.bench import models
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-random.gguf")
    models.write_random_llama(path, TINY, "Q4_0", seed=1)
    return path


def _hide(tmp_path, *modules):
    """A PYTHONPATH entry on which importing each of ``modules`` fails as if it were not installed."""
    for m in modules:
        d = tmp_path / "shim" / m
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named '%s'\")\n" % m)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), ROOT]))


def _check_ratio(r):
    lo, hi = r["speedup_ci95"]
    assert 0 < lo <= r["speedup"] <= hi, r


def test_greedy_divergence_finds_the_first_differing_token(tiny_gguf, monkeypatch):
    """quality.greedy_divergence: None when a cache dtype gives float16's tokens, else the first
    step where they differ (checked against generate's own tokens; a forced difference found)."""
    import kvsimd
    from kvsimd.bench import quality
    m = kvsimd.Decoder.from_gguf(tiny_gguf)
    rows = quality.greedy_divergence(m, ("float16", "int8", "int4+4"), n=12, prompts=["abc abc", "hello"])
    assert [(r["prompt"], r["dtype"]) for r in rows] == [(p, d) for p in (0, 1) for d in ("float16", "int8", "int4+4")]
    for r in rows:
        ids = m.tokenizer.encode(["abc abc", "hello"][r["prompt"]])
        a = list(m.generate(ids, max_new_tokens=12, cache_dtype="float16"))
        dt, _, recent = r["dtype"].partition("+")
        b = list(m.generate(ids, max_new_tokens=12, cache_dtype=dt, cache_recent=int(recent or 0)))
        want = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert r["first_divergence"] == want
    assert all(r["first_divergence"] is None for r in rows if r["dtype"] == "float16")
    real = m.generate

    def shifted(ids, **kw):            # a cache dtype whose 5th token differs
        toks = list(real(ids, **kw))
        if kw.get("cache_dtype") == "int8":
            toks[4] = (toks[4] + 1) % m.cfg.vocab_size
        return iter(toks)
    monkeypatch.setattr(m, "generate", shifted)
    assert [r["first_divergence"] for r in quality.greedy_divergence(m, ("int8",), n=12, prompts=["abc abc"])] == [4]


def _died(rows):
    """The peers whose process a signal killed during the run.  A natively built llama.cpp has died
    of SIGILL on a Xeon with AMX (in its AMX matrix product on these tiny random models, in some
    runs and not others); the bench reports that and goes on
    (test_decode_gguf_goes_on_when_a_peer_dies), and these tests then check kvsimd and the others."""
    return {r["impl"] for r in rows if r.get("op") == "peer" and "worker killed by SIG" in r["status"]}


def test_decode_gguf_kv_int8(tmp_path):
    """decode --kv-int8: kvsimd with an int8 KV cache and llama.cpp with q8_0 K/V (when installed)
    beside the float16 ones, each with its paired ratio to kvsimd's float16 cache and its cache named
    (head_dim 32: llama.cpp quantizes K/V rows in blocks of 32)."""
    from kvsimd.bench import models
    path = str(tmp_path / "tiny-random-d32.gguf")
    models.write_random_llama(path, dict(TINY, heads=2, kv_heads=1, head_dim=32), "Q4_0", seed=1)
    doc, p = run_bench(tmp_path, "decode", "--model", path, "--threads", "1", "--prefill-tokens", "0", "--kv-int8")
    schema.validate(doc)
    rows = doc["results"]["decode"]
    died = _died(rows)
    rows = [r for r in rows if r["impl"] not in died or r.get("op") == "peer"]   # what it did before it died
    steps = [r for r in rows if "op" not in r]
    impls = {"kvsimd", "kvsimd-int8", "transformers"} | ({"llama.cpp", "llama.cpp-q8_0"} - died if HAVE_LLAMA_CPP else set())
    assert {r["impl"] for r in steps} == impls
    caches = {r["impl"]: r.get("cache") for r in steps}
    assert caches["kvsimd"] == "float16" and caches["kvsimd-int8"] == "int8"
    if HAVE_LLAMA_CPP:
        for impl, cache in (("llama.cpp", "f16"), ("llama.cpp-q8_0", "q8_0")):
            assert impl in died or caches[impl] == cache
        assert all(r["flash_attn"] for r in steps if r["impl"] == "llama.cpp-q8_0")
    else:
        assert {r["impl"] for r in rows if r.get("op") == "peer"} >= {"llama.cpp", "llama.cpp-q8_0"}
    for r in steps:
        if r["impl"] != "kvsimd":
            _check_ratio(r)
    assert not [r for r in rows if r.get("op") == "prefill"]


def test_decode_gguf_beside_llama_cpp_and_transformers(tmp_path, tiny_gguf):
    """decode --model PATH: load, prefill and decode rows of kvsimd and both peers (llama.cpp
    when llama-cpp-python is importable, else its "not installed" row), paired ratios inside
    their intervals, the schema and the README section."""
    doc, p = run_bench(tmp_path, "decode", "--model", tiny_gguf, "--threads", "1", "--threads", "2",
                       "--prefill-tokens", "48", "--prefill-tokens", "16")
    schema.validate(doc)
    rows = doc["results"]["decode"]
    died = _died(rows)
    rows = [r for r in rows if r["impl"] not in died or r.get("op") == "peer"]   # what it did before it died
    llama = HAVE_LLAMA_CPP and "llama.cpp" not in died
    impls = {"kvsimd", "transformers"} | ({"llama.cpp"} if llama else set())
    steps = [r for r in rows if "op" not in r]
    assert {(r["impl"], r["context"], r["threads"]) for r in steps} == {
        (i, c, t) for i in impls for c in (0, 64) for t in (1, 2)}
    assert all(r["model"] == "tiny-random" and r["weights"] == "Q4_0" and r["steps"] == 12 for r in steps)
    assert {r["context_tokens"] for r in steps} == {1, 64}         # depth 0: a one-token prompt
    for r in steps:
        lo, hi = r["tok_per_s_ci95"]
        assert lo <= r["tok_per_s"] <= hi
        if r["impl"] != "kvsimd":
            _check_ratio(r)
            assert 0 <= r["same_tokens"] <= r["greedy_tokens"] == 2 + 12      # warm-up steps and timed ones
    pre = [r for r in rows if r.get("op") == "prefill"]
    assert {(r["impl"], r["threads"], r["tokens"]) for r in pre} == {
        (i, t, n) for i in impls for t in (1, 2) for n in (16, 48)}
    for r in pre:
        if r["impl"] != "kvsimd":
            _check_ratio(r)
    # the scaling table: each rate over the same implementation's rate at the shortest prompt
    rate = {(r["impl"], r["threads"], r["tokens"]): r["tok_per_s"] for r in pre}
    scaling = report.prefill_scaling_md(pre)
    assert "over the same implementation's rate at 16 tokens" in scaling
    for impl, t in {(i, t) for i, t, _ in rate}:
        want = "| tiny-random | %s | %d | 1.00 | %.2f |" % (impl, t, rate[(impl, t, 48)] / rate[(impl, t, 16)])
        assert want in scaling, (want, scaling)
    assert {(r["impl"], r["start"], r["tokens"]) for r in rows if r.get("op") == "fill"} == {(i, 1, 63) for i in impls}
    loads = {r["impl"]: r for r in rows if r.get("op") == "load"}
    assert set(loads) == impls
    size = os.path.getsize(tiny_gguf) / 2**20
    for r in loads.values():
        assert r["file_MiB"] == pytest.approx(size) and r["rss_after_MiB"] > r["rss_before_MiB"] > 0
    assert loads["kvsimd"]["isa"] == doc["header"]["isa"]["active"]
    status = [r for r in rows if r.get("op") == "peer"]
    md = report.render(doc)
    assert "### Decode of GGUF files as stored, beside llama.cpp" in md and "kvsimd / transformers" in md
    if llama:
        assert not status
        assert loads["llama.cpp"]["version"] == doc["header"]["versions"]["llama_cpp"]
        assert "kvsimd / llama.cpp" in md and "llama-cpp-python %s" % loads["llama.cpp"]["version"] in md
    elif HAVE_LLAMA_CPP:
        assert [r["impl"] for r in status] == ["llama.cpp"]
    else:
        assert [(r["impl"], r["status"]) for r in status] == [("llama.cpp", "not installed")]
        assert "llama.cpp on tiny-random: not installed" in md


FAKE_PEER = '''
import json, os, signal, sys
crash_at = int(sys.argv[1])
def send(d):
    print(json.dumps(d), flush=True)
send({"version": "fake", "load_s": 0.01, "rss_before_MiB": 1.0, "rss_MiB": 2.0, "rss_anon_MiB": 1.0,
      "rss_file_MiB": 1.0})
steps = 0
for line in sys.stdin:
    cmd = json.loads(line)
    name = cmd["cmd"]
    if name == "quit":
        break
    if name == "steps":
        steps += 1
        if steps == crash_at:
            sys.stderr.write("ggml: tilezero\\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGILL)
        send({"times": [1e-3] * cmd["n"], "tokens": [7] * cmd["n"]})
    elif name == "fill":
        send({"tokens": len(cmd["tokens"]), "seconds": 0.01})
    elif name == "prefill":
        send({"seconds": 0.01})
    elif name == "rss":
        send({"rss_MiB": 2.0, "rss_peak_MiB": 2.0})
    else:
        send({})
'''


def test_decode_gguf_goes_on_when_a_peer_dies(tmp_path, tiny_gguf, monkeypatch):
    """A peer whose process dies mid-run (a natively built llama.cpp died of SIGILL in its AMX
    matrix product on a Xeon) is reported -- the signal by name and its stderr's tail -- and
    dropped; kvsimd's figures for every depth are still measured, and the run ends normally.  One
    of kvsimd's own caches dying ends the run."""
    from kvsimd.bench import decode
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    real = subprocess.Popen
    started = []

    def popen(args, **kw):
        if "llama.cpp" in args or "kvsimd-int8" in args:     # [python, -m, kvsimd.bench.peers, impl, path, ...]
            args = [sys.executable, str(script), "3"]      # dies at its third "steps"
            started.append(1)
        return real(args, **kw)
    monkeypatch.setattr(decode.subprocess, "Popen", popen)
    monkeypatch.setattr(decode, "available_peers", lambda path, n, peers: {p: None for p in peers})
    rows = decode.bench_gguf([("tiny", tiny_gguf)], [0, 16], [1], steps=2, rounds=2, prefill_tokens=(8,),
                             prefill_repeat=1, load_repeat=1, peers=("llama.cpp",))
    assert len(started) == 2                    # the load run and the measured one
    peer = [r for r in rows if r.get("op") == "peer"]
    assert [r["impl"] for r in peer] == ["llama.cpp"]
    assert peer[0]["status"].startswith("failed: llama.cpp worker killed by SIGILL") and "tilezero" in peer[0]["status"]
    steps = [r for r in rows if "op" not in r]
    assert {(r["impl"], r["context"]) for r in steps} == {("kvsimd", 0), ("kvsimd", 16)}
    pre = {r["impl"]: r for r in rows if r.get("op") == "prefill"}
    assert set(pre) == {"kvsimd", "llama.cpp"} and "speedup" in pre["llama.cpp"]     # before it died
    assert [r["impl"] for r in rows if r.get("op") == "memory"] == ["kvsimd"]
    assert decode._exit_text(-11) == "killed by SIGSEGV" and decode._exit_text(3) == "exited with status 3"
    # kvsimd's own caches are not peers: their failure ends the run
    with pytest.raises(decode.WorkerError, match="kvsimd-int8 worker killed by SIGILL"):
        decode.bench_gguf([("tiny", tiny_gguf)], [0], [1], steps=2, rounds=2, prefill_tokens=(), load_repeat=1,
                          peers=("kvsimd-int8",))


def test_decode_gguf_says_not_installed(tmp_path, tiny_gguf):
    """Without llama-cpp-python (and transformers), the bench says so, with the install hint, in
    its output, its JSON and the report, and still times kvsimd (here on a random context)."""
    env = _hide(tmp_path, "llama_cpp", "transformers")
    doc, p = run_bench(tmp_path, "decode", "--model", tiny_gguf, "--threads", "1", "--depth", "8", "--fill", "random",
                       env=env)
    schema.validate(doc)
    rows = doc["results"]["decode"]
    status = {r["impl"]: r for r in rows if r.get("op") == "peer"}
    assert {k: v["status"] for k, v in status.items()} == {"llama.cpp": "not installed",
                                                            "transformers": "not installed"}
    hint = status["llama.cpp"]["hint"]
    assert 'pip install -e ".[peers]"' in hint and "GGML_NATIVE=ON" in hint
    assert "llama.cpp    not installed" in p.stdout
    assert {r["impl"] for r in rows if r.get("op") != "peer"} == {"kvsimd"}
    assert {(r["context"], r["threads"], r["fill"]) for r in rows if "op" not in r} == {(8, 1, "random")}
    assert not [r for r in rows if r.get("op") == "fill"]          # random K/V: no prefill to report
    assert "llama_cpp" not in doc["header"]["versions"]
    assert "llama.cpp on tiny-random: not installed" in report.render(doc)


@pytest.mark.parametrize("args, message", [
    (["decode", "--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no such file"),
    (["attention", "--model", "smollm2"], "--model goes with the decode subcommand"),
    (["decode", "--model", "smollm2", "--depth", "-1"], "--depth and --prefill-tokens must be >= 0"),
])
def test_decode_gguf_bad_flags(args, message):
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("kind, message", [
    ("file", "not a GGUF file kvsimd reads: %s is not a readable GGUF file"),
    ("directory", "a directory, not a GGUF file"),
])
def test_decode_gguf_refuses_a_model_that_is_not_gguf(tmp_path, kind, message):
    """decode --model PATH of an existing file that is not GGUF (or of a directory) is one error line
    naming it and exit 2, before the roofline (it was a GGUFError traceback from the run)."""
    path = tmp_path / "bad.gguf"
    if kind == "file":
        path.write_text("not a gguf file at all")
    else:
        path.mkdir()
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", "decode", "--model", str(path), "--quick"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    message = "--model %s: " % path + (message % path if "%s" in message else message)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "roofline" not in p.stdout


# ---------------------------------------------------------------------------------- the model files
def test_random_llama_file_is_what_the_loaders_read(tiny_gguf):
    """The random Q4_0 file: tensors in converter order and shapes, weights of the intended size
    (gguf's own dequantization is the reference), F32 norms, a tokenizer kvsimd's loader takes."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    import kvsimd
    from kvsimd.bench import models
    r = gguf.GGUFReader(tiny_gguf)
    assert [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in r.tensors] == models.llama_tensors(TINY)
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        if t.name.endswith("norm.weight"):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and abs(float(w.mean()) - 1) < 0.05
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert 0.7 < float(w.std()) * np.sqrt(w.shape[-1]) < 1.3, t.name
        scales = np.frombuffer(t.data.tobytes(), np.uint8).reshape(-1, 18)[:, :2].copy().view(np.float16)
        assert (scales > 0).all()
    m = kvsimd.Decoder.from_gguf(tiny_gguf)
    text = "hello there, the world"
    ids = m.tokenizer.encode(text)
    assert m.tokenizer.decode(ids) == text and max(ids) < TINY["vocab"]
    logits = m.prefill(ids, cache=m.new_cache(capacity=64))
    assert logits.shape == (TINY["vocab"],) and np.isfinite(logits).all()


def test_random_blocks_q8_0_and_float():
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from kvsimd import KVSimdValueError
    from kvsimd.bench import models
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    b = models.random_blocks(64, 256, Q.Q8_0, rng)
    assert b.shape == (64, 8 * 34) and b.dtype == np.uint8
    assert (b.reshape(-1, 34)[:, 2:].view(np.int8) != -128).all()
    w = dequantize(b, Q.Q8_0)
    assert w.shape == (64, 256) and 0.8 < float(w.std()) * 16 < 1.2
    assert models.random_blocks(3, 32, Q.F16, rng).dtype == np.float16
    with pytest.raises(KVSimdValueError, match="Q4_K"):
        models.random_blocks(1, 256, Q.Q4_K, rng)


def test_llama3_8b_shapes_make_a_4_5_gb_q4_0_file():
    from kvsimd.bench import models
    n = sum(models._tensor_bytes(s, models._qtype("F32" if len(s) == 1 else "Q4_0"))
            for _, s in models.llama_tensors(models.LLAMA3_8B))
    assert 4.4e9 < n < 4.6e9
    names = [t for t, _ in models.llama_tensors(models.LLAMA3_8B)]
    assert len(names) == 2 + 9 * 32 + 1 and "output.weight" in names       # untied, as Llama 3 8B
    tokens, types, merges, bos, eos = models.tokenizer_metadata(128256)
    assert len(tokens) == len(set(tokens)) == len(types) == 128256
    assert (tokens[bos], tokens[eos], types[bos]) == ("<|begin_of_text|>", "<|end_of_text|>", 3)


def test_requantize_keeps_metadata_and_values(tmp_path, tiny_gguf):
    """Q4_0 -> Q8_0 and F16: every key but general.file_type the same, 1-D tensors byte for byte,
    2-D tensors within the target type's rounding of gguf's dequantization of the source."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from kvsimd.bench import models
    src = gguf.GGUFReader(tiny_gguf)
    fields = {f.name: f.contents() for f in src.fields.values()}
    for weights, tol in (("Q8_0", 1 / 127), ("F16", 1e-3)):
        dest = str(tmp_path / ("tiny.%s.gguf" % weights))
        models.requantize(tiny_gguf, dest, weights)
        out = gguf.GGUFReader(dest)
        got = {f.name: f.contents() for f in out.fields.values()}
        assert {k for k in fields if fields[k] != got.get(k)} == {"general.file_type"} and set(got) == set(fields)
        assert got["general.file_type"] == getattr(gguf.LlamaFileType, "MOSTLY_" + weights)
        for a, b in zip(src.tensors, out.tensors):
            assert a.name == b.name and list(a.shape) == list(b.shape)
            x, y = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
            if len(a.shape) == 1:
                assert b.tensor_type == a.tensor_type and np.array_equal(x, y)
            else:
                assert b.tensor_type.name == weights
                assert np.abs(x - y).max() <= tol * np.abs(x).max(), a.name
    assert not list(tmp_path.glob("*.part.*"))


def test_smollm2_variants_are_built_once(tmp_path, monkeypatch):
    """The Q8_0 variant of the real SmolLM2 file goes into the model cache and is not rebuilt."""
    import gguf

    from kvsimd import KVSimdValueError
    from kvsimd.bench import models
    from kvsimd.loaders import registry
    src = registry.smollm2_path()
    monkeypatch.setenv("KVSIMD_CACHE", str(tmp_path))
    os.symlink(src, tmp_path / registry.SMOLLM2_FILE)
    assert models.smollm2_variant("Q4_1", log=None) == str(tmp_path / registry.SMOLLM2_FILE)
    p = models.smollm2_variant("Q8_0", log=None)
    assert p == str(tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(p).tensors}
    assert kinds == {"Q8_0", "F32"}
    stamp = os.stat(p).st_mtime_ns
    assert models.smollm2_variant("Q8_0", log=None) == p and os.stat(p).st_mtime_ns == stamp
    with pytest.raises(KVSimdValueError, match="weights must be one of Q4_1, Q8_0, F16, got 'Q5_0'"):
        models.smollm2_variant("Q5_0", log=None)


@pytest.mark.parametrize("breakage", [
    lambda r: r.pop("load_s"),
    lambda r: r.update(load_s=0.0),
    lambda r: r.update(op="nope"),
])
def test_schema_checks_gguf_rows(breakage):
    good = _doc()
    good["results"]["decode"] += [
        {"model": "m", "impl": "kvsimd", "context": 0, "threads": 1, "tok_per_s": 2.0},
        {"op": "load", "model": "m", "impl": "kvsimd", "load_s": 0.5, "rss_before_MiB": 30.0,
         "rss_after_MiB": 90.0, "file_MiB": 50.0},
        {"op": "peer", "model": "m", "impl": "llama.cpp", "status": "not installed"}]
    assert schema.validate(good)
    bad = copy.deepcopy(good)
    breakage(bad["results"]["decode"][2])
    with pytest.raises(ValueError):
        schema.validate(bad)
    neg = copy.deepcopy(good)
    neg["results"]["decode"][1]["context"] = -1
    with pytest.raises(ValueError, match="context = -1 is not non-negative"):
        schema.validate(neg)


def test_workers_decode_the_same_tokens_as_the_decoder(tiny_gguf):
    """A worker's context and its restore before each thread count give the Decoder's own greedy
    continuation of the same prompt (kvsimd), and every implementation repeats itself after start."""
    import kvsimd
    from kvsimd.bench.decode import Worker, prompt_ids
    ids = prompt_ids(tiny_gguf, 80)
    direct = kvsimd.Decoder.from_gguf(tiny_gguf)
    for impl in ["kvsimd", "transformers"] + (["llama.cpp"] if HAVE_LLAMA_CPP else []):
        w = Worker(impl, tiny_gguf, 128)
        try:
            for depth in (20, 50):              # 50 extends 20: only the new tokens are prefilled
                assert w.call("fill", tokens=ids[:depth])["tokens"] == (20 if depth == 20 else 30)
                w.call("start", first=ids[depth])
                got = w.call("steps", n=6)["tokens"]
                w.call("threads", n=2)
                w.call("start", first=ids[depth])
                assert w.call("steps", n=6)["tokens"] == got, impl
                w.call("threads", n=1)
                if impl == "kvsimd":
                    assert got == list(direct.generate(ids[:depth + 1], max_new_tokens=6))
        finally:
            w.close()


def test_int4_recent_ppl_reads_the_recent_tokens_as_computed(tmp_path):
    """bench/int4_recent_ppl.py over 24 tokens: with --recent 64 every key a query reads is among its
    last 64, so int4 (or int8/int4) K/V read as computed, with q as computed, give float's
    perplexity exactly; with --recent 0 the quantized rows give another; --sinks 24 reads every key as computed too.  Bad arguments
    end in one usage line, exit 2."""
    script = os.path.join(ROOT, "bench", "int4_recent_ppl.py")
    env = dict(os.environ, KVSIMD_NUM_THREADS="1", KVSIMD_BENCH_TEXT=TEXT)

    def rows(*args):
        out = tmp_path / "r.json"
        p = subprocess.run([sys.executable, script, "--tokens", "24", *args, "--json", str(out)], capture_output=True,
                           text=True, cwd=str(tmp_path), env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        doc = json.loads(out.read_text())
        assert doc["tokens"] == 24 and doc["text"] == "hamlet_gut.txt"
        return doc["rows"]

    r = rows("--kind", "int4", "--kind", "int4-plain", "--kind", "int8/int4", "--recent", "0", "--recent", "64")
    base = r["float"]["perplexity"]
    for kind in ("int4", "int4-plain", "int8/int4"):   # int8 keys: q rounded for them, not for the recent ones
        assert r["%s, recent 64, sinks 0" % kind]["perplexity"] == base
        assert r["%s, recent 64, sinks 0" % kind]["vs_float"] == 1.0
        assert abs(r["%s, recent 0, sinks 0" % kind]["perplexity"] / base - 1) > 1e-6
    assert rows("--recent", "0", "--sinks", "24")["int4, recent 0, sinks 24"]["perplexity"] == base
    for bad, words in [(["--tokens", "0"], "--tokens must be >= 1"), (["--recent", "-1"], "must be >= 0"),
                       (["--kind", "int3"], "invalid choice")]:
        p = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and words in p.stderr, p.stderr


def test_hf_recent_ppl_reads_every_key_as_float_rows(tmp_path):
    """bench/hf_recent_ppl.py over 24 tokens with --recent 64: every key a query reads is among its
    last 64, so the int8 caches with float rows (not turned) read the float16 cache's values:
    float16's perplexity within float32 rounding, through transformers and the Decoder alike,
    while int8 without them reads other values: token by token its log-losses part from float16's
    over 100x as far (a perplexity over 24 tokens can still land near float16's by chance: -0.05%
    through the Decoder on a Zen 4, +0.8% on a Zen 5); --recent 0 ends in one usage line, exit 2."""
    pytest.importorskip("transformers")
    script = os.path.join(ROOT, "bench", "hf_recent_ppl.py")
    env = dict(os.environ, KVSIMD_NUM_THREADS="1", KVSIMD_BENCH_TEXT=TEXT)
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, script, "--tokens", "24", "--recent", "64", "--json", str(out)],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["tokens"] == 24 and doc["text"] == "hamlet_gut.txt"
    r = doc["results"]
    for side in ("transformers", "decoder"):
        base = r["float16"]["ppl_" + side]
        assert abs(r["int8+recent64"]["ppl_" + side] / base - 1) < 1e-4, (side, r["int8+recent64"])
        near, far = r["int8+recent64"]["max_nll_diff_" + side], r["int8"]["max_nll_diff_" + side]
        assert far > 1e-2 and far > 10 * near, (side, near, far)                      # the rows matter
    p = subprocess.run([sys.executable, script, "--recent", "0"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and "--recent must be >= 1" in p.stderr, p.stderr


def test_hf_recent_decode_runs_both_caches():
    """bench/hf_recent_decode.py at a tiny size: both caches' tok/s and a ratio (speed is not
    asserted); bad arguments exit 2."""
    pytest.importorskip("transformers")
    script = os.path.join(ROOT, "bench", "hf_recent_decode.py")
    p = subprocess.run([sys.executable, script, "--depth", "16", "--steps", "2", "--rounds", "1", "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "int4 + recent 32 " in p.stdout and p.stdout.count("tok/s median") == 2 and "ratio" in p.stdout, p.stdout
    p = subprocess.run([sys.executable, script, "--steps", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "must be >= 1" in p.stderr


def test_attend_recent_speed_runs_every_case():
    """bench/attend_recent_speed.py: one line per shape, key count and turn, each with the four
    timings and two ratios (speed is not asserted); bad arguments exit 2."""
    script = os.path.join(ROOT, "bench", "attend_recent_speed.py")
    p = subprocess.run([sys.executable, script, "--calls", "2", "--recent", "4"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [x for x in p.stdout.splitlines() if "N=" in x]
    assert len(lines) == 8 and all("int4 + recent / int4 " in x and "int4 + window / int4 " in x
                                   and "recent alone" in x for x in lines), p.stdout
    assert {x.split("N=")[1].split()[0] for x in lines} == {"8192", "32768"}
    p = subprocess.run([sys.executable, script, "--recent", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "must be >= 1" in p.stderr


def test_cache_kinds_with_recent_rows():
    """A quality / decode cache kind "int4+32": KVCache(dtype="int4", recent=32) (and int4-plain+8
    unturned); float ones and R < 1 refused; the decode worker takes kvsimd-<kind>."""
    from kvsimd.bench import peers, quality
    assert quality.cache_args("int4+32") == dict(dtype="int4", recent=32)
    assert quality.cache_args("int4-plain+8") == dict(dtype="int4", hadamard=False, recent=8)
    assert quality.cache_args("int8/int4") == dict(dtype="int8/int4")
    for bad in ("float32+4", "int4+", "int4+x", "int4+-1", "int5"):
        with pytest.raises(ValueError, match="a quantized one with"):
            quality.parse_kind(bad)
    assert peers._impl("kvsimd-int4+32") == "kvsimd-int4+32" and peers._impl("llama.cpp") == "llama.cpp"
    for bad in ("kvsimd-int4+0", "llama.cpp-q4"):
        with pytest.raises(argparse.ArgumentTypeError):
            peers._impl(bad)
