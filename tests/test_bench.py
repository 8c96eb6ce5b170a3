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


def run_bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    env = dict(os.environ, KVSIMD_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "kvsimd.bench", *args, "--quick", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


HEADINGS = {"roofline": "### Roofline", "attention": "### Decode attention", "rope": "### K-cache shift",
            "decode": "### Decode (tokens/s", "complexity": "### Complexity", "streaming": "### Infinite generation",
            "quality": "### Perplexity"}


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_quick_json(tmp_path, sub):
    doc, stdout = run_bench(tmp_path, sub, *(["--plot", str(tmp_path)] if sub in ("attention", "complexity") else []))
    schema.validate(doc)
    assert list(doc["results"]) == [sub]
    md = report.render(doc, quality=doc if sub == "quality" else None)
    assert HEADINGS[sub] in md
    rows = doc["results"][sub]
    if sub == "attention":
        impls = {r["impl"] for r in rows}
        assert {"kvsimd", "numpy", "torch-sdpa"} <= impls
        assert {r["isa"] for r in rows if r["impl"] == "kvsimd"} == set(doc["header"]["isa"]["supported"])
        assert (tmp_path / "attention.png").stat().st_size > 1000
    if sub == "roofline":
        assert {r["kind"] for r in rows} == {"read", "write", "copy", "fma"}
        assert {r["where"] for r in rows if r["kind"] != "fma"} == {"dram", "llc"}
    if sub == "complexity":
        seed = {r["regime"]: r for r in rows if r["op"] == "complexity-seed003"}
        assert {k: v["token_positions"] for k, v in seed.items()} == schema_counts()
        assert (tmp_path / "complexity.png").stat().st_size > 1000
    if sub == "decode":
        assert {r["impl"] for r in rows} == {"kvsimd", "transformers", "weights floor"}
    if sub == "streaming":
        assert {r["op"] for r in rows} == {"streaming-memory", "streaming-drift", "streaming-overhead"}
    if sub == "quality":
        assert len(doc["curves"]) == len(rows)


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
