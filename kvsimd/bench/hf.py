"""python -m kvsimd.bench hf: transformers models with kvsimd's attention and caches
(kvsimd.integrations.transformers) beside stock transformers, side by side in one process.

- decode: SmolLM2 loaded by transformers from its GGUF (float32 weights), its cache filled with
  the text's first C tokens (C in --depth, default 128, 4096, 8192), then greedy one-token forward
  passes -- what ``generate`` runs per step -- under eager + DynamicCache, SDPA + DynamicCache and
  kvsimd + KVSimdCache (float16, and int8), in rounds that go round robin over them (the order rotated
  each round), each round starting from the same cache contents (cropped back).  Rows: tok/s
  (median step, 95% interval), and for kvsimd its speed-up over each stock variant: the median
  over rounds of (their round's median step / kvsimd's).
- sink: ``generate`` with KVSimdSinkCache for --sink-tokens new tokens (default 100,000) on a
  model of SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64, hidden 576) with 4 layers,
  a 2,048-token vocabulary and random weights (a step of the real 30-layer model takes ~40 ms: 10^5
  of them would take over an hour; the cache's behaviour does not depend on the weights): tok/s over
  the 200 steps before each of 10^3, 10^4, 10^5 generated tokens, with the resident set and the
  cache's bytes there.
"""
import os
import statistics
import time

import numpy as np

from kvsimd.bench.decode import _ci_rate, _paired_ratio, _rotated, prompt_ids
from kvsimd.bench.peers import rss_mib

VARIANTS = ("eager", "sdpa", "kvsimd", "kvsimd-int8")
_CACHE = {"kvsimd": "float16 KVSimdCache", "kvsimd-int8": "int8 KVSimdCache"}
DEPTHS = (128, 4096, 8192)
SINK_MARKS = (1000, 10_000, 100_000)


def _libs():
    import torch
    import transformers as T

    import kvsimd.integrations.transformers as kt
    T.logging.set_verbosity_error()
    return torch, T, kt


def transformers_from_gguf(path, tokenizer=False):
    """transformers' own load of a GGUF file, ``AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=...)`` with float32 weights (its dequantization), in eval mode; with ``tokenizer``,
    ``(model, AutoTokenizer.from_pretrained(dir, gguf_file=...))``.

    What transformers converts is kept in ``$KVSIMD_CACHE/hf/`` (the same float32 tensors as
    safetensors, the config and the tokenizer), one copy per file and per transformers version,
    and read from there next time.  A file is its real path, size, mtime and ctime: a file copied
    with its mtime (``cp -p``) elsewhere, or over the same path, is another file (its ctime is the
    copy's).  transformers' GGUF path took ~34 s for SmolLM2 (gguf's Python parser of the
    49k-token vocabulary and transformers' tensor-name maps), the copy ~2 s.  A copy half written
    by a process that is gone is removed.  The decode bench's transformers worker (:mod:`.peers`)
    does not use it: its load is part of what it reports."""
    import hashlib

    from kvsimd.loaders import registry
    from kvsimd.loaders.gguf import open_gguf
    open_gguf(path).close()   # the loader's checks first: a KVSimdError naming a bad path or file (0.2 s)
    torch, T, _ = _libs()
    path = os.path.realpath(os.fsdecode(path))     # transformers takes str paths only
    st = os.stat(path)
    where = hashlib.sha1(os.path.dirname(path).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    key = "%s-%s-%d-%d-%d-tf%s" % (os.path.basename(path), where, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                   T.__version__)
    saved = os.path.join(registry.cache_dir(), "hf", key)
    _remove_abandoned_copies(os.path.dirname(saved))
    if not os.path.isfile(os.path.join(saved, "done")):
        kw = dict(gguf_file=os.path.basename(path))
        model = T.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32, **kw)
        tok = T.AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)
        tmp = "%s.tmp%d" % (saved, os.getpid())
        try:      # written whole beside, then renamed: a reader never sees half a copy
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            _save_dequantized(model, tmp)
            tok.save_pretrained(tmp)
            open(os.path.join(tmp, "done"), "w").close()
            os.rename(tmp, saved)
        except OSError:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(saved, "done")):   # no room: this load stands
                return (model.eval(), tok) if tokenizer else model.eval()
        del model, tok       # (the copy, from here on, whichever process wrote it)
    model = T.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    return (model, T.AutoTokenizer.from_pretrained(saved)) if tokenizer else model


def _remove_abandoned_copies(where):
    """Half-written copies (``<key>.tmp<pid>``, ~520 MB for SmolLM2) of processes that are gone: a
    load interrupted while writing leaves one behind."""
    import shutil
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        base, sep, pid = name.rpartition(".tmp")
        if not (sep and base and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            continue                  # its process is still writing it
        except ProcessLookupError:
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)
        except (OSError, OverflowError):
            continue


def _save_dequantized(model, where):
    """A model transformers loaded from GGUF, as a plain float32 checkpoint (its save_pretrained
    refuses models it loaded from GGUF, though their tensors are float32 by then): the config
    without the GGUF quantization entry, the tensors (tied ones once) as safetensors."""
    import copy

    from safetensors.torch import save_model
    os.makedirs(where)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(where)
    model.generation_config.save_pretrained(where)
    save_model(model, os.path.join(where, "model.safetensors"), metadata={"format": "pt"})


def load_smollm2(path):
    return transformers_from_gguf(path)


def bench_decode(model, ids, depths, threads, steps, rounds, progress=None, warmup=2):
    """Rows of op "hf-decode" (see the module docstring)."""
    import copy

    import kvsimd
    torch, T, kt = _libs()
    rows = []

    def step(cache, tok):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    for depth in sorted(depths):
        ctx = ids[:depth]
        torch.set_num_threads(max(threads))
        kvsimd.set_num_threads(max(threads))
        model.set_attn_implementation("sdpa")
        dyn = T.DynamicCache()
        with torch.no_grad():
            for i in range(0, depth, 512):
                model(input_ids=torch.tensor([ctx[i:i + 512]]), past_key_values=dyn, use_cache=True, logits_to_keep=1)
        caches = {"eager": dyn, "sdpa": copy.deepcopy(dyn), "kvsimd": kt.KVSimdCache(model),
                  "kvsimd-int8": kt.KVSimdCache(model, dtype="int8")}
        model.set_attn_implementation(kt.NAME)
        with torch.no_grad():
            for v in ("kvsimd", "kvsimd-int8"):
                for i in range(0, depth, 512):
                    model(input_ids=torch.tensor([ctx[i:i + 512]]), past_key_values=caches[v], use_cache=True,
                          logits_to_keep=1)
        for nt in threads:
            torch.set_num_threads(nt)
            kvsimd.set_num_threads(nt)
            every = {v: [] for v in VARIANTS}
            per_round = {v: [] for v in VARIANTS}
            chosen = {v: [] for v in VARIANTS}
            for i in range(rounds + 1):                   # round 0: warm-up, untimed
                for v in _rotated(list(VARIANTS), i):
                    model.set_attn_implementation(kt.NAME if v.startswith("kvsimd") else v)
                    cache = caches[v]
                    cache.crop(-(cache.get_seq_length() - depth)) if cache.get_seq_length() > depth else None
                    tok, times = ids[depth], []
                    for _ in range(warmup if i == 0 else steps):
                        t0 = time.perf_counter()
                        tok = step(cache, tok)
                        times.append(time.perf_counter() - t0)
                        if i:
                            chosen[v].append(tok)
                    if i:
                        every[v] += times
                        per_round[v].append(statistics.median(times))
            for v in VARIANTS:
                rate, ci = _ci_rate(every[v])
                row = dict(op="hf-decode", model="SmolLM2-135M (transformers, float32 weights)", impl=v,
                           context=depth, threads=nt, tok_per_s=rate, tok_per_s_ci95=ci, steps=len(every[v]),
                           rounds=rounds, cache=_CACHE.get(v, "float32 DynamicCache"))
                if v.startswith("kvsimd"):
                    for s in ("eager", "sdpa"):
                        med, lo, hi = _paired_ratio(per_round[s], per_round[v])
                        row["speedup_vs_%s" % s], row["speedup_vs_%s_ci95" % s] = med, [lo, hi]
                else:
                    row["same_tokens"] = next((j for j, (a, b) in enumerate(zip(chosen[v], chosen["kvsimd"]))
                                               if a != b), len(chosen[v]))
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def sink_model(n_layers=4, vocab=2048, seed=0):
    """A Llama of SmolLM2's attention shape with random weights (see the module docstring)."""
    torch, T, kt = _libs()
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=n_layers,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                        rope_theta=100000.0, attn_implementation=kt.NAME)
    return T.LlamaForCausalLM(cfg).eval()


class _Clock:
    """A logits processor (transformers calls it once per generated token) that records the time of
    each call, and the resident set and cache bytes at the marks."""

    def __init__(self, marks, cache):
        self.marks, self.cache, self.stamps, self.at = set(marks), cache, [], {}

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        n = len(self.stamps)
        if n in self.marks:
            self.at[n] = (rss_mib()["rss_MiB"], self.cache.nbytes)
        return scores


def bench_sink(tokens, threads, window=1020, n_keep=4, marks=SINK_MARKS, progress=None, span=200):
    """Rows of op "hf-sink" (see the module docstring), two ways: ``generate`` as a user calls it
    (its own bookkeeping included: it concatenates input_ids and the attention mask every step,
    O(tokens)), and ``forward``, the model's one-token passes in a loop (positions from the cache):
    the cache's and the model's cost alone."""
    import kvsimd
    torch, T, kt = _libs()
    model = sink_model()
    marks = sorted({m for m in marks if m <= tokens} | {tokens})
    ids = torch.randint(1, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    rows = []
    nt = threads[0]                  # the flatness over 10^5 tokens, not thread scaling, is the point here
    torch.set_num_threads(nt)
    kvsimd.set_num_threads(nt)
    for how in ("generate", "forward"):
        cache = kt.KVSimdSinkCache(model, window=window, n_keep=n_keep)
        clock = _Clock(marks, cache)
        if how == "generate":
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, past_key_values=cache,
                           logits_processor=T.LogitsProcessorList([clock]), pad_token_id=0, eos_token_id=None)
        else:
            with torch.no_grad():
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                for _ in range(tokens):
                    tok = out.logits[:, -1:].argmax(-1)
                    clock(None, None)
                    out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        dts, at = np.diff(np.asarray(clock.stamps)), clock.at
        for m in marks:
            rate, ci = _ci_rate(list(dts[max(0, m - 1 - span):m - 1]))
            rss, nbytes = at[m]
            row = dict(op="hf-sink", model="SmolLM2-shaped Llama, 4 layers, random weights", impl="kvsimd", how=how,
                       generated=m, threads=nt, tok_per_s=rate, tok_per_s_ci95=ci, rss_MiB=rss, cache_bytes=nbytes,
                       window=window, n_keep=n_keep)
            rows.append(row)
            if progress:
                progress(row)
    return rows


def run(depths, threads, steps, rounds, sink_tokens, text_path=None, progress=None):
    """The rows of both parts.  Where kvsimd's import set its brief OpenMP spin (GOMP_SPINCOUNT=1000),
    they run in a child process with libgomp's default (300000): torch shares the process's
    libgomp, and a transformers user who imports torch first, as the README's example does, runs
    with the default (see kvsimd.integrations.transformers)."""
    import kvsimd
    if kvsimd._SPIN_SET:
        return _in_child(dict(depths=list(depths), threads=list(threads), steps=steps, rounds=rounds,
                              sink_tokens=sink_tokens, text_path=text_path), progress)
    return _run(depths, threads, steps, rounds, sink_tokens, text_path, progress)


def _in_child(kw, progress):
    import json
    import subprocess
    import sys
    import tempfile
    env = dict(os.environ, GOMP_SPINCOUNT="300000")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        p = subprocess.Popen([sys.executable, "-m", "kvsimd.bench.hf", json.dumps(kw), out], env=env,
                             stdout=subprocess.PIPE, text=True)
        for line in p.stdout:                 # one JSON row per line, as they come
            if progress and line.startswith("{"):
                progress(json.loads(line))
        if p.wait():
            from kvsimd.errors import KVSimdError
            raise KVSimdError("the hf bench's child process failed (exit status %d)" % p.returncode)
        with open(out) as fh:
            return json.load(fh)


def _run(depths, threads, steps, rounds, sink_tokens, text_path=None, progress=None):
    from kvsimd.loaders import registry as models
    path = models.smollm2_path()
    rows = []
    if depths:
        model = load_smollm2(path)
        ids = prompt_ids(path, max(depths) + 1, text_path)
        rows += bench_decode(model, ids, depths, threads, steps, rounds, progress)
        del model
    if sink_tokens:
        rows += bench_sink(sink_tokens, threads, progress=progress)
    return rows


def _child(argv):
    import json
    import sys
    kw, out = json.loads(argv[0]), argv[1]

    def emit(row):
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
    rows = _run(progress=emit, **kw)
    with open(out, "w") as fh:
        json.dump(rows, fh)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_child(sys.argv[1:]))
