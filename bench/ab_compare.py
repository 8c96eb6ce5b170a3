"""A/B speed check: kvsimd's decode step and attention kernel, one tree against another.

    python bench/ab_compare.py NEW OLD [--rounds 10] [--threads 1] [--isa NAME] [--quick] [--json PATH]

NEW and OLD are each a source checkout built in place (``python setup.py -q build_clib
build_ext --inplace`` in it; it is run with ``PYTHONPATH=CHECKOUT``) or a Python interpreter
whose environment has kvsimd installed (``/path/to/venv/bin/python``).  Every round starts one
fresh process per side, one after the other, the order alternating round by round (new then
old, old then new, ...), both with the same environment, the same ``KVSIMD_NUM_THREADS`` and
the same cases, each timed by its own tree's ``kvsimd.bench`` code, as ``python -m kvsimd.bench``
times them:

* ``decode`` (``kvsimd.bench.decode``): median seconds of one decode step of the random
  SmolLM2-shaped model at each context and of the BART-shaped encoder-decoder; its control is
  the "weights floor", the step's matrix products alone (plain BLAS), timed step by step beside it;
* ``prefill`` (``--sections ...,prefill``): median seconds of one prefill of 128 and 1024 random
  tokens through the same random SmolLM2-shaped model (no control);
* ``lanes`` (``--sections ...,lanes``): median seconds of one warm ``ops.attend`` call of T rows over
  N float16 keys (causal, the last T keys the rows' own) and of an MQA decode step: the cases the
  query-on-lanes path computes (tiles of 32 or more query vectors; no control);
* ``gguf`` (``--sections gguf --model PATH [--depth N ...] [--kv KIND ...]``): median seconds of
  one decode step of a GGUF model at each context depth (random K/V up to it, as ``python -m
  kvsimd.bench decode --fill random`` fills it: ``kvsimd.bench.peers.KVSimdRunner``) with each
  KV-cache kind (default float16; e.g. int8, int4, int4+32); no control;
* ``attention`` (``kvsimd.bench.kernels``): median seconds of one ``ops.attend`` call with cold
  caches, per shape x dtype x context, on the active ISA path (``--isa`` forces one on both
  sides through ``KVSIMD_FORCE_ISA``); its control is a plain read of the same bytes, timed
  repeat by repeat beside it.

Printed per case: each side's median seconds; **new/old**, the median over rounds of new seconds
/ old seconds (1.00 = same speed, below 1: new is faster) with its 95% bootstrap interval
(``kvsimd.bench.common.median_ci``); and **vs control**, the same for new/old of (seconds /
the control's seconds in the same process).  On a shared machine the load changes from one
process to the next and moves a case and its control alike: "vs control" cancels it (two copies
of one tree measured here, 2 cores shared with other jobs: new/old of a decode step 1.36
[1.05, 1.61], vs control 1.02 [0.97, 1.07]).  A change that speeds up or slows down the BLAS
products themselves (another weight layout) shows in new/old only.  Then both figures over the
rounds of every case of a section pooled.  ``--json`` keeps every round's times.

The integrator's check of issue 14 (the final tree against the previous main)::

    git -C /work/main worktree add /tmp/kvsimd-old <previous main commit>
    (cd /tmp/kvsimd-old && python setup.py -q build_clib build_ext --inplace)
    python bench/ab_compare.py . /tmp/kvsimd-old --rounds 10 --json /tmp/ab.json

About 25 s per process on a 2-core machine (``--quick``: about 5 s), so 10 rounds take about
nine minutes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = dict(os.environ)        # before kvsimd is imported here (it sets OMP_WAIT_POLICY for itself)

FULL = {"sections": ["decode", "attention"], "models": ["smollm2-shaped", "bart-shaped"],
        "contexts": [128, 2048, 8192], "steps": 24,
        "shapes": ["smollm2-gqa", "llama-gqa", "mha-128"], "attn_contexts": [512, 2048, 8192],
        "dtypes": ["float16", "float32"], "repeat": 11, "prefill_tokens": [128, 1024], "prefill_repeat": 3,
        # lanes: (T, H, Hkv, D, N)
        "lanes": [(128, 9, 3, 64, 128), (256, 9, 3, 64, 4096), (256, 32, 8, 128, 4096), (64, 32, 32, 128, 4096),
                  (1, 32, 1, 128, 16384), (1, 64, 1, 64, 16384)], "lanes_repeat": 21}
CONTROL = "control"       # a case's control: the same process's plain-BLAS step, or plain read of the same bytes
QUICK = dict(FULL, models=["smollm2-shaped"], contexts=[128], steps=8, shapes=["smollm2-gqa"],
             attn_contexts=[512, 2048], repeat=3, prefill_tokens=[64], prefill_repeat=1,
             lanes=[(64, 9, 3, 64, 256), (1, 32, 1, 64, 1024)], lanes_repeat=3)


# ------------------------------------------------------------------------------------ in a side
def worker(spec):
    """In a side's process: time the cases with that tree's kvsimd.bench; one JSON line out."""
    import kvsimd
    from kvsimd.bench import cases, decode, kernels
    threads = spec["threads"]
    times = {}
    if "decode" in spec["sections"]:
        for name in spec["models"]:
            model = dict(decode.SHAPES[name], name=name)
            if model["kind"] == "llama":
                rows = decode.bench_decoder_only(model, spec["contexts"], [threads], spec["steps"], with_hf=False)
            else:
                rows = decode.bench_encoder_decoder(model, [threads], spec["steps"], with_hf=False)
            for r in rows:
                key = "decode %s context=%d" % (name, r["context"])
                times[key if r["impl"] == "kvsimd" else "%s | %s" % (key, CONTROL)] = 1.0 / r["tok_per_s"]
    if "attention" in spec["sections"]:
        kvsimd.set_num_threads(threads)
        shapes = [s for s in cases.ATTN_SHAPES if s[0] in spec["shapes"]]
        no_roof = {"read_GBps": 1.0, "copy_GBps": 1.0}     # the % of roofline columns are not used here
        for r in kernels.bench_attention([kvsimd.active_isa()], shapes, spec["attn_contexts"], spec["dtypes"],
                                         spec["repeat"], no_roof):
            key = "attention %s %s N=%d" % (r["shape"], r["dtype"], r["N"])
            times[key] = r["median_s"]
            times["%s | %s" % (key, CONTROL)] = r["bytes"] / (r["paired_read_GBps"] * 1e9)   # its paired plain read
    if "gguf" in spec["sections"]:
        import numpy as np
        from kvsimd.bench.peers import KVSimdRunner
        kvsimd.set_num_threads(threads)
        for kind in spec["kv"]:
            for depth in spec["depths"]:
                run = KVSimdRunner(spec["model"], depth + spec["steps"] + 8, fill="random", dtype=kind)
                run.fill(np.random.default_rng(depth).integers(0, run.m.cfg.vocab_size, depth).tolist())
                run.start(1)
                run.steps(2)                                    # warm: first touches of the step's buffers
                run.start(1)
                ts = run.steps(spec["steps"])["times"]
                times["gguf %s %s depth=%d" % (os.path.basename(spec["model"]), kind, depth)] = statistics.median(ts)
    if "lanes" in spec["sections"]:
        import numpy as np
        from kvsimd import ops
        kvsimd.set_num_threads(threads)
        rng = np.random.default_rng(0)
        for T, H, Hkv, D, N in spec["lanes"]:
            q = rng.standard_normal((T, H, D) if T > 1 else (H, D)).astype(np.float32)
            k, v = rng.standard_normal((2, Hkv, N, D)).astype(np.float16)
            ops.attend(q, k, v)
            ts = []
            for _ in range(spec["lanes_repeat"]):
                t0 = time.perf_counter()
                ops.attend(q, k, v)
                ts.append(time.perf_counter() - t0)
            times["lanes T=%d %d/%d/%d N=%d" % (T, H, Hkv, D, N)] = statistics.median(ts)
    if "prefill" in spec["sections"]:
        # a whole prompt through the random SmolLM2-shaped model (no control: prefill is
        # BLAS-bound matrix products plus attention over the prompt so far)
        import numpy as np
        kvsimd.set_num_threads(threads)
        name = "smollm2-shaped"
        model = kvsimd.Decoder.from_transformers(decode._hf_model(dict(decode.SHAPES[name], name=name)))
        rng = np.random.default_rng(0)
        for T in spec["prefill_tokens"]:
            toks = rng.integers(0, model.cfg.vocab_size, T).tolist()
            ts = []
            for _ in range(spec["prefill_repeat"]):
                cache = model.new_cache(capacity=T)
                t0 = time.perf_counter()
                model.prefill(toks, cache=cache)
                ts.append(time.perf_counter() - t0)
            times["prefill %s T=%d" % (name, T)] = sorted(ts)[len(ts) // 2]
    print(json.dumps({"kvsimd": os.path.dirname(os.path.abspath(kvsimd.__file__)), "isa": kvsimd.active_isa(),
                      "threads": kvsimd.get_num_threads(), "times": times}))


# ------------------------------------------------------------------------------------ the parent
class Side:
    def __init__(self, label, where):
        self.label = label
        where = os.path.abspath(where)
        if os.path.isdir(where):
            if not os.path.isfile(os.path.join(where, "kvsimd", "__init__.py")):
                raise SystemExit("ab_compare: %s %s is a folder without kvsimd/__init__.py (not a checkout)"
                                 % (label, where))
            self.checkout, self.python = where, sys.executable
        elif os.path.isfile(where) and os.access(where, os.X_OK):
            self.checkout, self.python = None, where
        else:
            raise SystemExit("ab_compare: %s %s is neither a kvsimd checkout nor a Python interpreter" % (label, where))
        self.where = where
        self.commit = None
        if self.checkout:
            r = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
            self.commit = r.stdout.strip() or None
        self.runs = []

    def env(self, threads, isa):
        env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
        if self.checkout:
            env["PYTHONPATH"] = self.checkout
        env["KVSIMD_NUM_THREADS"] = str(threads)
        if isa:
            env["KVSIMD_FORCE_ISA"] = isa
        return env

    def run(self, spec, isa, cwd):
        p = subprocess.run([self.python, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                           capture_output=True, text=True, env=self.env(spec["threads"], isa), cwd=cwd, timeout=3600)
        if p.returncode != 0 or not p.stdout.strip():
            raise SystemExit("ab_compare: the %s side (%s) failed (exit %d):\n%s"
                             % (self.label, self.where, p.returncode, p.stderr[-3000:]))
        res = json.loads(p.stdout.strip().splitlines()[-1])
        if self.checkout and not res["kvsimd"].startswith(os.path.join(self.checkout, "")):
            raise SystemExit("ab_compare: the %s side imported kvsimd from %s, not from %s (is it built in place?)"
                             % (self.label, res["kvsimd"], self.checkout))
        self.runs.append(res)
        return res

    def describe(self):
        return "%s%s" % (self.where, " (%s)" % self.commit if self.commit else "")


def compare(new, old, median_ci):
    """One row per kvsimd case common to both sides: median seconds of each side, the median over
    rounds of new/old with its interval, and the same for the time relative to the case's control
    timed beside it in the same process (new/old of kvsimd / control); then the rounds of every
    case of a section pooled."""
    def times(side, case):
        return [r["times"][case] for r in side.runs]
    common = [c for c in new.runs[0]["times"] if all(c in r["times"] for r in new.runs + old.runs)]
    rows, pooled = [], {}
    for c in common:
        if c.endswith(" | " + CONTROL):
            continue
        tn, to = times(new, c), times(old, c)
        row = {"case": c, "new_s": statistics.median(tn), "old_s": statistics.median(to),
               "ratios": [a / b for a, b in zip(tn, to)]}
        ctl = "%s | %s" % (c, CONTROL)
        if ctl in common:
            cn, co = times(new, ctl), times(old, ctl)
            row["control_ratios"] = [(a / ca) / (b / cb) for a, ca, b, cb in zip(tn, cn, to, co)]
        rows.append(row)
        section = pooled.setdefault(c.split()[0], {"case": "%s: every case pooled" % c.split()[0], "ratios": []})
        section["ratios"] += row["ratios"]
        if "control_ratios" in row:
            section.setdefault("control_ratios", []).extend(row["control_ratios"])
    for row in rows + list(pooled.values()):
        for key in ("ratios", "control_ratios"):
            if key in row:
                med, lo, hi = median_ci(row[key])
                row[key[:-1]], row[key[:-1] + "_ci95"] = med, [lo, hi]
    return rows + list(pooled.values())


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python bench/ab_compare.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", help="the new tree: a checkout built in place, or a Python with kvsimd installed")
    ap.add_argument("old", help="the old tree, likewise")
    ap.add_argument("--rounds", type=int, default=10, help="processes per side, interleaved (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="kvsimd threads on both sides (default 1)")
    ap.add_argument("--isa", help="force this ISA path on both sides (KVSIMD_FORCE_ISA)")
    ap.add_argument("--sections", default="decode,attention", help="a comma list of decode, attention, prefill, "
                    "lanes, gguf (default decode,attention)")
    ap.add_argument("--model", metavar="PATH", help="the GGUF file of the gguf section")
    ap.add_argument("--depth", type=int, action="append", help="gguf: context depths (repeatable; default 8192)")
    ap.add_argument("--kv", action="append", help="gguf: KV-cache kinds (repeatable; default float16)")
    ap.add_argument("--quick", action="store_true", help="one model, one context, one attention shape")
    ap.add_argument("--json", metavar="PATH", help="write every round's times and the ratios")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rounds < 2:
        ap.error("--rounds must be >= 2 (the interval needs several rounds), got %d" % a.rounds)
    if a.threads < 1:
        ap.error("--threads must be >= 1, got %d" % a.threads)
    sections = [s for s in a.sections.split(",") if s]
    if not sections or any(s not in ("decode", "attention", "prefill", "lanes", "gguf") for s in sections):
        ap.error("--sections takes a comma list of decode, attention, prefill, lanes, gguf, got %r" % a.sections)
    if ("gguf" in sections) != (a.model is not None):
        ap.error("--model goes with --sections gguf, and the gguf section needs --model PATH")
    if a.model is not None and not os.path.isfile(a.model):
        ap.error("--model %r: no such file" % a.model)
    if any(d < 1 or d > 1 << 20 for d in a.depth or []):
        ap.error("--depth must be in 1..2**20, got %r" % a.depth)
    if (a.depth or a.kv) and "gguf" not in sections:
        ap.error("--depth and --kv go with --sections gguf")

    sys.path.insert(0, ROOT)           # the statistics helper of this script's own tree
    from kvsimd.bench.common import median_ci

    if a.kv:
        from kvsimd.bench.quality import _kind_arg
        for kind in a.kv:
            try:
                _kind_arg(kind)
            except argparse.ArgumentTypeError as e:
                ap.error("--kv %s" % e)
    spec = dict(QUICK if a.quick else FULL, sections=sections, threads=a.threads,
                model=a.model and os.path.abspath(a.model), depths=a.depth or [8192], kv=a.kv or ["float16"])
    new, old = Side("new", a.new), Side("old", a.old)
    print("# A/B: new = %s, old = %s; %d rounds, %d thread(s)%s" % (new.describe(), old.describe(), a.rounds,
                                                                    a.threads, ", isa %s" % a.isa if a.isa else ""),
          flush=True)
    t0 = time.perf_counter()
    cwd = os.path.abspath(os.sep)      # neither tree's folder: each imports kvsimd from its PYTHONPATH only
    for i in range(a.rounds):
        order = (new, old) if i % 2 == 0 else (old, new)
        for side in order:
            side.run(spec, a.isa, cwd)
        print("# round %d/%d done (%s first), %.0f s" % (i + 1, a.rounds, order[0].label, time.perf_counter() - t0),
              file=sys.stderr, flush=True)
    isas = {r["isa"] for r in new.runs + old.runs}
    if len(isas) != 1:
        raise SystemExit("ab_compare: the sides ran different ISA paths %s; pass --isa" % sorted(isas))
    rows = compare(new, old, median_ci)
    print("# isa %s; new/old = new seconds / old seconds in the same round (1.00 = same speed, < 1: new faster),"
          " median over %d rounds [95%% bootstrap interval]" % (isas.pop(), a.rounds))
    print("# vs control: new/old of (kvsimd seconds / its control's seconds in the same process); the control"
          " of a decode step is its matrix products alone (plain BLAS, step by step beside it), of an attend"
          " call a plain read of the same bytes (repeat by repeat): load on a shared machine cancels")
    print("%-44s %9s %9s   %-22s %s" % ("case", "new ms", "old ms", "new/old [95% interval]", "vs control"))
    for r in rows:
        times = ("%9.3f %9.3f" % (r["new_s"] * 1e3, r["old_s"] * 1e3)) if "new_s" in r else "%19s" % ""
        ctl = "%.3f [%.3f, %.3f]" % (r["control_ratio"], *r["control_ratio_ci95"]) if "control_ratio" in r else ""
        print("%-44s %s   %-22s %s" % (r["case"], times, "%.3f [%.3f, %.3f]" % (r["ratio"], *r["ratio_ci95"]), ctl))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"new": {"where": new.where, "commit": new.commit, "runs": new.runs},
                       "old": {"where": old.where, "commit": old.commit, "runs": old.runs},
                       "spec": spec, "isa": a.isa, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        if HERE in sys.path:        # this folder holds no kvsimd: the side's own comes from its PYTHONPATH
            sys.path.remove(HERE)
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
