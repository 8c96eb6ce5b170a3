"""PNG charts from a bench result document (matplotlib, an optional extra).

Every chart gets pyplot from :func:`pyplot`, which raises :class:`PlotUnavailable` (one line, with
the install hint) when matplotlib is missing; the command lines write their JSON before drawing."""
import os

from kvsimd.bench.schema import QUANTIZED_OPS

# kvsimd is installed from its source checkout (it is on no package index): this is the hint that works
INSTALL_HINT = 'pip install -e ".[plot]" (from the kvsimd source checkout)'


class PlotUnavailable(RuntimeError):
    """--plot was asked for but matplotlib cannot be imported."""


def pyplot():
    """matplotlib.pyplot on the Agg backend, or PlotUnavailable."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed (%s): %s" % (e, INSTALL_HINT)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_plt = pyplot


def _kernel_chart(rows, roof, key, title, path):
    plt = _plt()
    shapes = sorted({r["shape"] for r in rows}, key=[r["shape"] for r in rows].index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        series = {}
        for r in rows:
            if r["shape"] != shape:
                continue
            who = ("kvsimd " + r["isa"]) if r["impl"] == "kvsimd" else r["impl"]
            series.setdefault("%s %s" % (who, r["dtype"]), []).append((r["N"], r["GBps"]))
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "kvsimd" in name else "s--", label=name, lw=1)
        ax.axhline(roof[key], color="k", lw=0.8, ls=":", label="%s roofline" % key.split("_")[0])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length N")
        ax.set_ylabel("GB/s")
        ax.set_title(shape, fontsize=9)
        ax.grid(True, which="both", lw=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _decode_chart(rows, path):
    plt = _plt()
    rows = [r for r in rows if "op" not in r]       # decode steps (not load, prefill, memory, peer rows)
    keys = sorted({(r["model"], r["context"], r["threads"]) for r in rows})
    impls = [i for i in ("kvsimd", "llama.cpp", "weights floor", "transformers") if any(r["impl"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys)), 4))
    w = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [next((r["tok_per_s"] for r in rows if (r["model"], r["context"], r["threads"]) == k
                      and r["impl"] == impl), 0) for k in keys]
        ax.bar([i + j * w for i in range(len(keys))], vals, w, label=impl)
    ax.set_xticks([i + w for i in range(len(keys))])
    ax.set_xticklabels(["%s\nctx %d, %dT" % (m.replace("-shaped", ""), c, t) for m, c, t in keys], fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7)
    ax.set_title("Decode speed, GGUF weights as stored (same file for all)" if any("weights" in r for r in rows)
                 else "Decode speed, float32 weights (same weights for both)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(doc, outdir):
    res, roof = doc["results"], doc["header"]["roofline"]
    out = []
    if "attention" in res:
        out.append(os.path.join(outdir, "attention.png"))
        _kernel_chart([r for r in res["attention"] if r["op"] != "attend-ceiling" and r["op"] not in QUANTIZED_OPS],
                      roof, "read_GBps",
                      "Decode attention: GB/s of K+V vs context length", out[-1])
    if "rope" in res:
        out.append(os.path.join(outdir, "rope.png"))
        _kernel_chart(res["rope"], roof, "copy_GBps", "K-cache shift (shift-RoPE-K): GB/s read+written", out[-1])
    if "decode" in res:
        out.append(os.path.join(outdir, "decode.png"))
        _decode_chart(res["decode"], out[-1])
    if "complexity" in res:
        from kvsimd.bench import complexity
        out.append(os.path.join(outdir, "complexity.png"))
        complexity.plot(res["complexity"], out[-1])
    if doc.get("curves"):
        from kvsimd.bench import quality
        out.append(os.path.join(outdir, "streaming_nll.png"))
        quality.plot(doc["curves"], out[-1])
    return out
