"""Turn one ``python -m kvsimd.bench --json PATH`` run into Markdown (the README's Performance
section).  Every figure comes from the JSON; nothing is typed in by hand.

    python -m kvsimd.bench.report results.json                 # print the Markdown
    python -m kvsimd.bench.report results.json --readme README.md [--quality q.json] [--images docs]
    python -m kvsimd.bench.report results.json --also gguf.json ...   # + runs of single subcommands

With ``--readme`` the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` is
replaced.  ``--quality`` adds the table of a separate ``quality`` run (it needs the real model
and, with the full oracle, hours)."""
import argparse
import json
import math
import sys

from kvsimd.bench.schema import QUANTIZED_OPS, validate, vs_float16_text

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _f(x, nd=1):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return ("%%.%df" % nd) % x


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def machine_line(doc):
    h = doc["header"]
    m, v = h["machine"], h["versions"]
    vers = ", ".join("%s %s" % ("llama-cpp-python" if k == "llama_cpp" else k, v[k])
                     for k in ("python", "numpy", "torch", "transformers", "llama_cpp") if k in v)
    load = h.get("loadavg")
    busy = (", load average %.1f at the start and %.1f at the end" % (load["start"][0], load["end"][0])
            if load else "")
    return ("Measured on **%s** (%d cores, LLC %d MiB), %s; kvsimd %s, active path `%s`; whole run %.0f s%s "
            "(`python -m kvsimd.bench %s`)."
            % (m["cpu"], m["cores"], m["llc_bytes"] >> 20, vers, v.get("kvsimd", "?"), h["isa"]["active"],
               h.get("seconds", 0), busy, " ".join(h["argv"])))


def roofline_md(rows):
    mem = {(r["kind"], r["where"], r["threads"]): r["GBps"] for r in rows if r["kind"] != "fma"}
    threads = sorted({k[2] for k in mem})
    body = []
    for where, label in (("dram", "beyond the LLC"), ("llc", "inside the LLC")):
        for t in threads:
            body.append([label, t] + [_f(mem.get((k, where, t))) for k in ("read", "write", "copy")])
    fma = [r for r in rows if r["kind"] == "fma"]
    text = _table(["buffer", "threads", "read GB/s", "write GB/s", "copy GB/s (read+write)"], body)
    if fma:
        text += "\n\nfp32 multiply-add peak: " + "; ".join(
            "%s %s GFLOP/s (%d thread%s)" % (r["isa"], _f(r["GFLOPs"]), r["threads"], "s" if r["threads"] > 1 else "")
            for r in fma)
    return text


def _kernel_md(rows, kind):
    """One row per (shape, N): kvsimd per ISA/dtype and the peers, GB/s (% of paired roofline)."""
    key = "pct_read_roofline" if kind == "read" else "pct_copy_roofline"
    cols = []
    for r in rows:
        c = ("kvsimd " + r["isa"], r["dtype"]) if r["impl"] == "kvsimd" else (r["impl"], r["dtype"])
        if c not in cols:
            cols.append(c)
    cases = []
    for r in rows:
        c = (r["shape"], r["H"], r["Hkv"], r["D"], r["N"])
        if c not in cases:
            cases.append(c)
    peers = [c for c in cols if not c[0].startswith("kvsimd")]
    isas = [c[0] for c in cols if c[0].startswith("kvsimd")]
    fast = isas[-1] if isas else None   # the last ISA listed is the best supported one
    body = []
    for shape, H, Hkv, D, N in cases:
        line = ["%s %d/%d/%d" % (shape, H, Hkv, D), N]
        got = {}
        for c in cols:
            hit = [r for r in rows if (r["shape"], r["N"]) == (shape, N) and r["dtype"] == c[1] and
                   (("kvsimd " + r.get("isa", "")) if r["impl"] == "kvsimd" else r["impl"]) == c[0]]
            line.append("%s (%s%%)" % (_f(hit[0]["GBps"]), _f(hit[0][key], 0)) if hit else "-")
            if hit:
                got[c] = hit[0]["median_s"]
        ours = got.get((fast, "float16"))
        line.append(", ".join("%sx" % _f(got[p] / ours, 1) for p in peers if p in got) if ours else "-")
        body.append(line)
    ratio = "%s float16 speedup over %s" % (fast, " / ".join("%s %s" % p for p in peers)) if fast else "speedup"
    return _table(["shape H/Hkv/D", "N"] + ["%s %s" % c for c in cols] + [ratio], body)


def ceiling_md(rows):
    """Decode attention against min(read bandwidth, FMA peak / G), per row and thread count."""
    body = [["%s %d/%d/%d" % (r["shape"], r["H"], r["Hkv"], r["D"]), r["H"] // r["Hkv"], r["N"], r["isa"], r["threads"],
             _f(r["GBps"]), "%s / %s" % (_f(r["read_GBps"]), _f(r["fma_GFLOPs"] / (r["H"] // r["Hkv"]))),
             "%s [%s, %s] (%s)" % (_f(r["pct_ceiling"], 1), _f(r["pct_ceiling_ci95"][0], 1),
                                   _f(r["pct_ceiling_ci95"][1], 1), r["binds"])] for r in rows]
    return ("Against its ceiling: a group of G query heads over float16 K/V does G FLOP per byte, so a decode step "
            "cannot beat min(read bandwidth, FMA peak / G) GB/s of K+V (float16, beyond the LLC, cold; each call "
            "paired with a plain read of the same K and V on as many threads: the median over repeats of the "
            "call's share of that repeat's ceiling, with a 95% interval).  Targets on the best row: >= 85% for MHA, G = 8 and MQA, "
            ">= 75% for GQA 32/8/128 and SmolLM2, on 1 thread and on every core.\n\n"
            + _table(["shape H/Hkv/D", "G", "N", "row", "threads", "GB/s", "ceilings GB/s: read / FMA peak / G",
                      "% of the lower (binds)"], body))


def int8_md(rows):
    """The int8, int4 and int8/int4 KV caches beside float16: time per call, ratio, bytes per token."""
    body = [["%s %d/%d/%d" % (r["shape"], r["H"], r["Hkv"], r["D"]), r["N"], r["dtype"], r["isa"], r["threads"],
             "%s / %s" % (_f(r["fp16_median_s"] * 1e3, 3), _f(r["median_s"] * 1e3, 3)),
             "%s / %s" % (_f(r["fp16_GBps"]), _f(r["GBps"])),
             "%s [%s, %s]" % (_f(r["ratio"], 3), _f(r["ratio_ci95"][0], 3), _f(r["ratio_ci95"][1], 3)),
             "%d / %d" % (r["fp16_bytes_per_token"], r["bytes_per_token"])] for r in rows]
    return ("An int8 and an int4 KV cache (one float32 scale per 32 values; int8/int4: int8 keys, int4 values) "
            "beside float16: the same keys, the calls alternated, each cold (LLC evicted), median of repeats; "
            "targets beyond the LLC: int8 time <= 0.6x float16, int4 <= 0.4x.\n\n"
            + _table(["shape H/Hkv/D", "N", "cache", "row", "threads", "ms float16 / cache", "GB/s float16 / cache",
                      "cache / float16 time [95% CI]", "K+V bytes per token and layer"], body))


def _targets_md(rows, kind):
    """The rows the targets are about: fp16, best path, beyond the LLC; % with its interval."""
    key = "pct_%s_roofline" % kind
    ours = [r for r in rows if r["impl"] == "kvsimd" and r["dtype"] == "float16" and r.get("beyond_llc")]
    if not ours:
        return ""
    best = [r for r in ours if r["isa"] == ours[-1]["isa"]]
    return "On the targets' cases (float16, %s, beyond the LLC), median over repeats of the paired ratio with its " \
        "95%% bootstrap interval: " % best[0]["isa"] + "; ".join(
            "%d/%d/%d N=%d %s%%%s" % (r["H"], r["Hkv"], r["D"], r["N"], _f(r[key], 1),
                                       " [%s, %s]" % tuple(_f(x, 1) for x in r[key + "_ci95"]) if key + "_ci95" in r
                                       else "") for r in best) + "."


def _kernel_section(rows, kind, title, intro):
    """Title, intro, the table, the targets' cases and where a peer is faster."""
    b = _behind(rows)
    return [title, intro, _kernel_md(rows, kind), _targets_md(rows, kind),
            "Where a peer is faster: " + ("; ".join(b) if b else "nowhere in this run") + "."]


def _behind(rows):
    """Peers that beat kvsimd's best row on the same case."""
    notes = []
    best = {}
    for r in rows:
        if r["impl"] == "kvsimd":
            k = (r["shape"], r["N"])
            best[k] = min(best.get(k, float("inf")), r["median_s"])
    for r in rows:
        k = (r["shape"], r["N"])
        if r["impl"] != "kvsimd" and k in best and r["median_s"] < best[k]:
            notes.append("%s %s at %s N=%d is %.2fx faster than kvsimd" % (r["impl"], r["dtype"], r["shape"], r["N"],
                                                                        best[k] / r["median_s"]))
    return notes


def decode_md(rows):
    keys = []
    for r in rows:
        k = (r["model"], r["context"], r["threads"])
        if k not in keys:
            keys.append(k)
    body = []
    for k in keys:
        v = {r["impl"]: r for r in rows if (r["model"], r["context"], r["threads"]) == k}
        ours, hf, floor = v.get("kvsimd"), v.get("transformers"), v.get("weights floor")

        def ratio(peer, pct=False):
            if not (ours and peer):
                return "-"
            if "speedup" not in peer:    # older result files: ratio of the medians
                r = ours["tok_per_s"] / peer["tok_per_s"]
                return "%s%%" % _f(100 * r, 0) if pct else "**%sx**" % _f(r, 2)
            lo, hi = peer["speedup_ci95"]
            if pct:
                return "%s%% [%s, %s]" % (_f(100 * peer["speedup"], 0), _f(100 * lo, 0), _f(100 * hi, 0))
            return "**%sx** [%s, %s]" % (_f(peer["speedup"], 2), _f(lo, 2), _f(hi, 2))
        body.append([k[0], k[1], k[2], _f(ours["tok_per_s"]) if ours else "-", _f(hf["tok_per_s"]) if hf else "-",
                     ratio(hf), _f(floor["tok_per_s"]) if floor else "-", ratio(floor, pct=True)])
    return _table(["model", "context", "threads", "kvsimd tok/s", "transformers tok/s", "kvsimd / transformers",
                   "weight-streaming floor tok/s", "kvsimd % of floor"], body) + (
        "\n\nRatios: median over rounds of the two step times of the same round (drift of the machine between "
        "rounds cancels), 95% bootstrap interval in brackets." if any("speedup" in r for r in rows) else "")


def _ratio(r):
    if not r or "speedup" not in r:
        return "-"
    lo, hi = r["speedup_ci95"]
    return "**%sx** [%s, %s]" % (_f(r["speedup"], 2), _f(lo, 2), _f(hi, 2))


def _peer_columns(rows):
    return [p for p in ("llama.cpp", "transformers") if any(r["impl"] == p for r in rows)]


def _speed_table(rows, key, first, same=False):
    """One line per (model, key..., threads): kvsimd's tok/s, each peer's and kvsimd / peer (the
    paired ratio with its interval; rows without one -- single runs -- the ratio of the rates)."""
    peers = _peer_columns(rows)
    cases = []
    for r in rows:
        k = (r["model"],) + tuple(r[x] for x in key) + (r["threads"],)
        if k not in cases:
            cases.append(k)
    body = []
    for k in cases:
        v = {r["impl"]: r for r in rows if (r["model"],) + tuple(r[x] for x in key) + (r["threads"],) == k}
        ours = v.get("kvsimd")
        line = list(k) + [_f(ours["tok_per_s"]) if ours else "-"]
        for p in peers:
            ratio = _ratio(v.get(p))
            if ratio == "-" and ours and p in v:
                ratio = "%sx" % _f(ours["tok_per_s"] / v[p]["tok_per_s"], 2)
            line += [_f(v[p]["tok_per_s"]) if p in v else "-", ratio]
            if same:
                line.append("%d/%d" % (v[p]["same_tokens"], v[p]["greedy_tokens"]) if "same_tokens" in v.get(p, {})
                            else "-")
        body.append(line)
    head = ["model"] + first + ["threads", "kvsimd tok/s"]
    for p in peers:
        head += ["%s tok/s" % p, "kvsimd / %s" % p] + (["same tokens"] if same else [])
    return _table(head, body)


def gguf_md(rows):
    """Decode, prefill, load and RSS of GGUF files as stored, beside llama.cpp and transformers."""
    steps = [r for r in rows if "op" not in r]
    pre = [r for r in rows if r.get("op") == "prefill"]
    loads = [r for r in rows if r.get("op") == "load"]
    fills = [r for r in rows if r.get("op") == "fill"]
    status = [r for r in rows if r.get("op") == "peer"]
    out = []
    lc = next((r for r in rows if r["impl"] == "llama.cpp" and "version" in r), None)
    intro = ("Each implementation runs in its own process on the same GGUF file, the others idle meanwhile; "
             "same prompt tokens, same number of greedy steps, rounds interleaved round robin.  ")
    if lc:
        intro += ("llama.cpp: llama-cpp-python %s, KV cache f16, flash attention %s.  "
                  % (lc["version"], "on" if lc.get("flash_attn") else "off"))
    intro += ("transformers runs the file dequantized to float32.  Ratios: median over rounds of the peer's step "
              "time over kvsimd's in the same round, 95% bootstrap interval in brackets.  Targets: decode >= "
              "llama.cpp at every depth and thread count and >= 1.5x at depth 8192; prefill >= 0.8x llama.cpp.")
    out.append(intro)
    for r in status:
        out.append("%s on %s: %s%s." % (r["impl"], r["model"], r["status"],
                                        " (%s)" % r["hint"] if r.get("hint") else ""))
    if steps:
        out.append("Decode (a context of `context` prompt tokens, 0 meaning a one-token prompt; tok/s = 1 / the "
                   "median step; `same tokens`: the greedy steps, warm-up included, before the peer's first token "
                   "different from kvsimd's, of all of them):")
        out.append(_speed_table(steps, ["context"], ["context"], same=any("same_tokens" in r for r in steps)))
    if pre:
        out.append("Prefill of one prompt (each repeat on an empty cache):")
        out.append(_speed_table(pre, ["tokens"], ["prompt tokens"]))
        scaling = prefill_scaling_md(pre)
        if scaling:
            out.append(scaling)
    if fills:
        out.append("Prefill of the decode contexts, each extending the one before (chunks of 512 tokens; one run "
                   "each, so no interval):")
        out.append(_speed_table(fills, ["start", "tokens"], ["cached tokens", "new tokens"]))
    if loads:
        body = [[r["model"], r["impl"], _f(r["file_MiB"]), "%s s" % _f(r["load_s"], 2), _f(r["rss_after_MiB"]),
                 "%+.1f" % r["rss_delta_MiB"] if "rss_delta_MiB" in r else "-",
                 "%s / %s" % (_f(r.get("rss_anon_MiB")), _f(r.get("rss_file_MiB")))] for r in loads]
        out.append("Load (a fresh process each time, warm page cache, the library already imported; median of %s; "
                   "llama.cpp with a context of 512 tokens):"
                   % "/".join(sorted({str(len(r.get("load_s_runs", [1]))) for r in loads})))
        out.append(_table(["model", "implementation", "file MiB", "load", "RSS after load MiB",
                           "RSS added by the load MiB", "RSS anonymous / file-backed MiB"], body))
    return "\n\n".join(out)


def prefill_scaling_md(pre):
    """Each implementation's prefill rate at every prompt length over its rate at 512 tokens (else
    its shortest prompt), same model and thread count: how far from linear a long prompt is."""
    lengths = sorted({r["tokens"] for r in pre})
    if len(lengths) < 2:
        return ""
    ref = 512 if 512 in lengths else lengths[0]
    rate = {(r["model"], r["impl"], r["threads"], r["tokens"]): r["tok_per_s"] for r in pre}
    body = []
    for model, impl, threads in sorted({k[:3] for k in rate}, key=lambda k: (k[0], k[2], k[1] != "kvsimd", k[1])):
        base = rate.get((model, impl, threads, ref))
        if not base or sum((model, impl, threads, n) in rate for n in lengths) < 2:
            continue
        body.append([model, impl, threads] + [_f(rate[(model, impl, threads, n)] / base, 2)
                                              if (model, impl, threads, n) in rate else "-" for n in lengths])
    if not body:
        return ""
    return ("Prefill rate at each prompt length over the same implementation's rate at %d tokens (attention makes "
            "a long prompt cost more per token; 1 would be linear):\n\n" % ref
            + _table(["model", "implementation", "threads"] + ["%d tokens" % n for n in lengths], body))


def contention_md(rows):
    body = [[r["model"], r["context"], r["neighbour"], r["setting"], r["threads"], r.get("blas_threads", "-"),
             _f(r["tok_per_s"]),
             "%s [%s, %s]" % (_f(r["vs_1_thread"], 3), _f(r["vs_1_thread_ci95"][0], 3), _f(r["vs_1_thread_ci95"][1], 3))
             if r["setting"] != "1 thread" else "1"] for r in rows]
    cores = sorted({r.get("available_cores") for r in rows if r.get("available_cores")})
    return _table(["model", "context", "neighbour", "setting", "kernel threads", "BLAS threads", "tok/s",
                   "step time / 1-thread step time"],
                  body) + (
        "\n\nThe neighbour is a process spinning on one of the %s cores this process may use.  Settings timed round "
        "robin, step by step; ratio: median over rounds of the two step times of the same round, 95%% bootstrap "
        "interval in brackets (below 1: faster than 1 thread).  `1 thread` and `2 threads` are "
        "`set_num_threads(n)` (n kernel and n BLAS threads); `default` is kvsimd's default (kernel threads = "
        "the cores it may use, up to 8; BLAS 1 thread).  Target: the default never more than 10%% slower than "
        "1 thread." % ("/".join(str(c) for c in cores) or "?"))


def hf_md(rows):
    """The hf section: transformers decode with and without kvsimd, and the sink cache over time."""
    dec = [r for r in rows if r["op"] == "hf-decode"]
    out = []
    if dec:
        by = {}
        for r in dec:
            by.setdefault((r["context"], r["threads"]), {})[r["impl"]] = r
        body = []
        def vs_sdpa(k):
            return ("%s [%s, %s]" % (_f(k["speedup_vs_sdpa"], 2), _f(k["speedup_vs_sdpa_ci95"][0], 2),
                                     _f(k["speedup_vs_sdpa_ci95"][1], 2)) if "speedup_vs_sdpa" in k else "-")
        int8 = any(r["impl"] == "kvsimd-int8" for r in dec)
        for (ctx, nt), v in sorted(by.items()):
            k, k8 = v.get("kvsimd", {}), v.get("kvsimd-int8", {})
            impls = ("eager", "sdpa", "kvsimd") + (("kvsimd-int8",) if int8 else ())
            body.append([ctx, nt] + [_f(v[i]["tok_per_s"]) if i in v else "-" for i in impls] + [vs_sdpa(k)]
                        + ([vs_sdpa(k8)] if int8 else []) + [_f(k.get("speedup_vs_eager"), 2)])
        out += [_table(["context", "threads", "eager + DynamicCache", "SDPA + DynamicCache", "kvsimd + KVSimdCache"]
                       + (["kvsimd + KVSimdCache(int8)"] if int8 else []) + ["kvsimd / SDPA"]
                       + (["kvsimd int8 / SDPA"] if int8 else []) + ["kvsimd / eager"], body),
                "tok/s of one-token forward passes (what `generate` runs per step) of %s; the variants timed round robin "
                "from the same cache contents; ratios: median over rounds of the step-time ratio, 95%% bootstrap "
                "interval.  Targets: >= 2.5x SDPA at 8192, never slower than stock at 128." % dec[0]["model"]]
    sink = [r for r in rows if r["op"] == "hf-sink"]
    if sink:
        out += [_table(["run", "generated tokens", "threads", "tok/s", "RSS MiB", "cache bytes"],
                       [[r.get("how", "generate"), r["generated"], r["threads"], "%s [%s, %s]" % (_f(r["tok_per_s"]), _f(r["tok_per_s_ci95"][0]),
                                                                      _f(r["tok_per_s_ci95"][1])),
                         _f(r["rss_MiB"]), r["cache_bytes"]] for r in sink]),
                "`KVSimdSinkCache(window=%d, n_keep=%d)` on a %s, through `generate` (its own bookkeeping grows: "
                "it concatenates input_ids and the attention mask every step) and through the model's one-token "
                "passes in a loop (`forward`): tok/s over the 200 steps before each count.  Target: flat from 10^3 "
                "to 10^5." % (sink[0]["window"], sink[0]["n_keep"],
                                                                   sink[0]["model"])]
    return "\n\n".join(out)


def streaming_md(rows):
    out = []
    mem = [r for r in rows if r["op"] == "streaming-memory"]
    if mem:
        out.append("Memory: " + "; ".join("%s RSS %+.2f%% from %d to %d tokens" % (r["policy"], r["growth_pct"],
                                                                                  r["first"], r["tokens"]) for r in mem)
                   + " (target < 5%).")
    drift = [r for r in rows if r["op"] == "streaming-drift"]
    if drift:
        out.append("Drift against a fresh prefill of the kept tokens (fp16 cache): " + "; ".join(
            "%s %.1e after %d tokens" % (r["policy"], r["rel_err"], r["tokens"]) for r in drift) + ".")
    ov = [r for r in rows if r["op"] == "streaming-overhead"]
    if ov:
        caps = sorted({r["capacity"] for r in ov})
        pols = [p for p in ("fixed", "sink_query", "shift", "reevaluate") if any(r["policy"] == p for r in ov)]
        body = []
        for p in pols:
            line = [p]
            for c in caps:
                hit = [r for r in ov if r["policy"] == p and r["capacity"] == c]
                if not hit:
                    line.append("-")
                    continue
                r = hit[0]
                ci = (" [%+.2f, %+.2f]" % tuple(r["overhead_ci95_pct"])) if "overhead_ci95_pct" in r and p != "fixed" else ""
                line.append("%s tok/s (%+.2f%%%s)" % (_f(r["tok_per_s"]), r["overhead_pct"], ci))
            body.append(line)
        out.append(_table(["policy (SmolLM2-shaped, 1 thread)"] + ["capacity %d" % c for c in caps], body))
        out.append("Targets: sink_query < 1%, shift < 3% overhead against the fixed cache of the same size "
                   "(timed step by step, interleaved, the fixed cache attending over exactly `capacity` tokens at every "
                   "step; median of per-round ratios, with its 95% bootstrap interval in brackets; shift and "
                   "reevaluate include their discard events amortized).")
    return "\n\n".join(out)


def complexity_md(rows):
    pts = [r for r in rows if r["op"] == "complexity"]
    ms = sorted({r["M"] for r in pts})
    regimes = [g for g in ("none", "encoder", "cached") if any(r["regime"] == g for r in pts)]
    label = {"none": "no cache (encoder re-run)", "encoder": "encoder hoisted", "cached": "full caching"}
    fits = {r["regime"]: r for r in rows if r["op"] == "complexity-fit"}
    body = []
    for g in regimes:
        line = [label[g]]
        for m in ms:
            hit = [r for r in pts if r["regime"] == g and r["M"] == m]
            line.append("%s s" % _f(hit[0]["seconds"], 3) if hit else "-")
        line.append("M^%s" % _f(fits[g]["time_exponent"], 2) if g in fits else "-")
        body.append(line)
    text = _table(["regime (N=%d source tokens)" % pts[0]["N"]] + ["M=%d" % m for m in ms] + ["fitted time"], body)
    text += ("\n\nWithout a cache every step recomputes the whole prefix, so the attention work grows as M^3 "
             "and the linear layers as M^2; the fitted exponent sits between the two and rises with M.  With "
             "the caches a step costs its projections plus O(M) attention: on this tiny model the per-step "
             "constant dominates up to M = 1,000, so total time grows about linearly (the O(M^2) attention "
             "term shows only at much larger M).")
    seed = [r for r in rows if r["op"] == "complexity-seed003"]
    if seed:
        text += "\n\nSeed 003's count for N = 1024, M = 100, from the model's own counters: " + " / ".join(
            "%s %d" % (r["regime"], r["token_positions"]) for r in seed) + " token positions (expected " + \
            " / ".join("%d" % r["expected"] for r in seed) + ")."
    return text


def quality_md(doc):
    rows = doc["results"]["quality"]
    oracle = {r["config"].split(" ")[0]: r["ppl_oracle_positions"] for r in rows if "oracle" in r["config"]}
    body = []
    for r in rows:
        w = r["config"].split(" ")[0]
        ref = oracle.get(w)
        rel = "%+.1f%%" % (100 * (r["ppl_oracle_positions"] / ref - 1)) if ref and "oracle" not in r["config"] else "-"
        body.append([r["config"], _f(r["ppl_all"], 2) if math.isfinite(r["ppl_all"]) else "-",
                     _f(r["ppl_oracle_positions"], 2), rel, vs_float16_text(r)])
    return _table(["configuration", "PPL, all positions", "PPL, oracle's positions",
                   "vs the oracle of its window (same positions)",
                   "vs float16, same configuration (paired, 95% interval)"], body)


def merge(doc, others):
    """``doc`` with the results of ``others`` (runs of single subcommands on the same machine, e.g.
    ``decode --model smollm2``) joined in: lists of rows concatenated.  Each other run is named
    after the main run's machine line; a run on another CPU is refused."""
    validate(doc)
    out = json.loads(json.dumps(doc))
    for o in others:
        validate(o)
        if o["header"]["machine"]["cpu"] != doc["header"]["machine"]["cpu"]:
            raise ValueError("runs on different machines: %r and %r"
                             % (doc["header"]["machine"]["cpu"], o["header"]["machine"]["cpu"]))
        for k, v in o["results"].items():
            if isinstance(v, list):
                out["results"].setdefault(k, []).extend(v)
            else:
                out["results"].setdefault(k, v)
        out.setdefault("also", []).append({"argv": o["header"]["argv"], "seconds": o["header"].get("seconds", 0)})
    return out


def render(doc, quality=None, images=None):
    validate(doc)
    res = doc["results"]
    parts = [machine_line(doc)]
    for a in doc.get("also", []):
        parts[0] += "  With `python -m kvsimd.bench %s` (%.0f s) on the same machine." % (" ".join(a["argv"]),
                                                                                     a["seconds"])
    if "roofline" in res:
        parts += ["### Roofline", roofline_md(res["roofline"])]
    if "attention" in res:
        ceiling = [r for r in res["attention"] if r["op"] == "attend-ceiling"]
        int8 = [r for r in res["attention"] if r["op"] in QUANTIZED_OPS]
        parts += _kernel_section([r for r in res["attention"]
                                  if r["op"] != "attend-ceiling" and r["op"] not in QUANTIZED_OPS],
                                 "read",
                                 "### Decode attention (`attend`)",
                                 "GB/s of K+V read per call, cold caches, 1 thread, median of repeats, K/V arrays "
                                 "64-byte aligned (as a KVCache stores them); in brackets the % of a plain streaming "
                                 "read of the same bytes timed beside it.  Targets beyond the LLC (fp16): "
                                 "MHA >= 80%, GQA >= 70%.")
        if ceiling:
            parts += [ceiling_md(ceiling)]
        if int8:
            parts += [int8_md(int8)]
    if "rope" in res:
        parts += _kernel_section(res["rope"], "copy", "### K-cache shift (`shift_keys`, shift-RoPE-K)",
                                 "GB/s read + written (in place), in brackets the % of a plain copy of the same bytes "
                                 "timed beside it (target >= 60%).  Peers apply the same rotation with the usual "
                                 "rotate_half formula.")
    gguf_rows = [r for r in res.get("decode", []) if "weights" in r or "op" in r]
    if gguf_rows:
        parts += ["### Decode of GGUF files as stored, beside llama.cpp", gguf_md(gguf_rows)]
    if any(r not in gguf_rows for r in res.get("decode", [])):
        parts += ["### Decode (tokens/s, float32 weights, same weights for both)",
                  "Implementations timed round robin, step by step.  The weight-streaming floor is the step's "
                  "matrix-vector products alone (same BLAS): no implementation reading float32 weights can beat "
                  "it.  Targets (1 thread): >= 2x transformers at context 128, >= 3x at 8192.",
                  decode_md([r for r in res["decode"] if r not in gguf_rows])]
    if "contention" in res:
        parts += ["### Decode beside a busy core (threads under contention)", contention_md(res["contention"])]
    if "streaming" in res:
        parts += ["### Infinite generation", streaming_md(res["streaming"])]
    if "complexity" in res:
        parts += ["### Complexity (seed 003, tiny random encoder-decoder)", complexity_md(res["complexity"])]
    if "hf" in res:
        parts += ["### transformers with kvsimd (attention backend and caches)", hf_md(res["hf"])]
    if quality is not None:
        q = quality["results"]["quality"]
        n = max(r["scored"] for r in q)
        o = min(r["scored"] for r in q)
        every = "every position" if o == n else "every %d-th position (others on all %d)" % (round(n / o), n)
        parts += ["### Perplexity under infinite generation (real SmolLM2, Hamlet)",
                  "One token per step, NLL of the next token, PPL = exp(mean).  The oracle re-prefills the last W "
                  "tokens at %s; each policy is compared with the oracle of its window." % every, quality_md(quality)]
    if images:
        parts += ["![%s](%s)" % (alt, path) for alt, path in images]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--quality", help="JSON of a separate `quality` run to include")
    ap.add_argument("--readme", help="replace the marked section of this file")
    ap.add_argument("--image", action="append", default=[], metavar="ALT=PATH", help="charts to show")
    ap.add_argument("--also", action="append", default=[], metavar="JSON",
                    help="a run of one subcommand on the same machine (e.g. decode --model smollm2) to join in")
    args = ap.parse_args(argv)
    with open(args.json) as fh:
        doc = json.load(fh)
    if args.also:
        others = []
        for path in args.also:
            with open(path) as fh:
                others.append(json.load(fh))
        doc = merge(doc, others)
    quality = None
    if args.quality:
        with open(args.quality) as fh:
            quality = json.load(fh)
        validate(quality)
    md = render(doc, quality, [tuple(s.split("=", 1)) for s in args.image])
    if not args.readme:
        sys.stdout.write(md)
        return 0
    with open(args.readme) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        raise SystemExit("%s has no %s ... %s markers" % (args.readme, BEGIN, END))
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(args.readme, "w") as fh:
        fh.write(head + BEGIN + "\n" + md + END + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
