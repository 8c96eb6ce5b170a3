"""One implementation per process: the workers of the GGUF decode bench (:mod:`.decode`).

``python -m kvsimd.bench.peers IMPL PATH --n-ctx N`` loads GGUF file PATH with IMPL (``kvsimd``:
``Decoder.from_gguf``, float16 KV cache, ``kvsimd-int8`` / ``kvsimd-int4`` / ``kvsimd-int8/int4`` the
same with an int8 / int4 cache / int8 keys with int4 values;
``llama.cpp``: ``llama_cpp.Llama`` on the same file, f16 KV cache, ``llama.cpp-q8_0`` with q8_0
K and V (which llama.cpp runs with flash attention only);
``transformers``: ``AutoModelForCausalLM.from_pretrained(gguf_file=...)``, float32 weights) and
answers JSON commands, one per line on stdin, one reply line each on its stdout:

* first, unasked: the load -- seconds, RSS before and after (``/proc/self/status``), version;
* ``{"cmd": "threads", "n": T}``;
* ``{"cmd": "prefill", "tokens": [...]}`` -- one timed prompt pass on an empty state;
* ``{"cmd": "fill", "tokens": [...]}`` -- the context the decode steps run after (kept; a
  context extending the previous one prefills only the new tokens);
* ``{"cmd": "start", "first": tok}`` -- back to the filled context, ``tok`` fed next;
* ``{"cmd": "steps", "n": k}`` -- k greedy steps, each timed (the forward call; the argmax after
  it is not timed), and the tokens chosen;
* ``{"cmd": "quit"}``.

Anything a library prints goes to stderr: the replies have the process's stdout to themselves.
Each implementation runs in its own process so that none of them shares a thread pool, an
allocator or a page of memory with another, and the ones not being timed are idle (blocked on
their stdin) while one is timed: the parent interleaves them round by round."""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

IMPLS = ("kvsimd", "kvsimd-int8", "kvsimd-int4", "kvsimd-int8/int4", "llama.cpp", "llama.cpp-q8_0", "transformers")


def _impl(name):
    """argparse type of the worker's impl: one of IMPLS, or "kvsimd-KIND" with a KV-cache kind of
    the quality runs (kvsimd.bench.quality.parse_kind: e.g. "kvsimd-int4+32")."""
    if name in IMPLS:
        return name
    if name.startswith("kvsimd-"):
        from kvsimd.bench.quality import _kind_arg
        _kind_arg(name[len("kvsimd-"):])
        return name
    raise argparse.ArgumentTypeError("impl must be one of %s, or kvsimd-KIND (e.g. kvsimd-int4+32), got %r"
                                     % (", ".join(IMPLS), name))


def rss_mib():
    """Resident set of this process in MiB: total, anonymous, file-backed (``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024.0
    return {"rss_MiB": out.get("VmRSS", 0.0), "rss_anon_MiB": out.get("RssAnon", 0.0),
            "rss_file_MiB": out.get("RssFile", 0.0), "rss_peak_MiB": out.get("VmHWM", 0.0)}


class KVSimdRunner:
    def __init__(self, path, n_ctx, fill="prefill", dtype="float16"):
        import kvsimd
        from kvsimd.bench.quality import cache_args
        self.kvsimd = kvsimd
        self.cache_args = cache_args(dtype)     # dtype: a KV-cache kind (e.g. "int4+32")
        self.m = kvsimd.Decoder.from_gguf(path)
        self.n_ctx, self.fill_mode, self.dtype = n_ctx, fill, dtype
        self.cache, self.fill_cache, self.saved, self.context, self.depth, self.next = None, None, None, [], 0, None

    def info(self):
        return {"version": self.kvsimd.__version__, "isa": self.kvsimd.active_isa(), "cache": self.dtype,
                "fill": self.fill_mode}

    def threads(self, n):
        self.kvsimd.set_num_threads(n)

    def prefill(self, tokens):
        cache = self.m.new_cache(capacity=len(tokens) + 8, **self.cache_args)
        t0 = time.perf_counter()
        logits = self.m.prefill(tokens, cache=cache)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "next": int(np.argmax(logits))}

    def fill(self, tokens, chunk=512):
        """The context: the prompt prefilled in chunks into a cache kept for it (a context that
        extends the previous one prefills only the new tokens), or with fill="random" random K/V
        of the same length (decode speed does not depend on the values).  Its K/V are kept (as
        the cache stores them) and put into the decode cache at every ``start``."""
        cfg = self.m.cfg
        tokens = list(tokens)
        if self.fill_mode == "random":
            rng = np.random.default_rng(len(tokens))
            t0 = time.perf_counter()
            self.saved = [tuple((rng.standard_normal((cfg.n_kv_heads, len(tokens), cfg.head_dim), dtype=np.float32)
                                 * 0.5) for _ in range(2)) for _ in range(cfg.n_layers)]
            dt, new = time.perf_counter() - t0, []          # nothing prefilled: not a prefill figure
        else:
            if self.fill_cache is None or not self.context or tokens[:len(self.context)] != self.context:
                self.fill_cache, self.context = self.m.new_cache(capacity=self.n_ctx, **self.cache_args), []
            new = tokens[len(self.context):]
            t0 = time.perf_counter()
            for i in range(0, len(new), chunk):
                self.m.prefill(new[i:i + chunk], cache=self.fill_cache)
            dt = time.perf_counter() - t0
            c = self.fill_cache
            self.saved = [c._saved_rows(layer, 0, 0, len(tokens)) for layer in range(cfg.n_layers)]
        self.context, self.depth = tokens, len(tokens)
        if self.cache is None:
            self.cache = self.m.new_cache(capacity=self.n_ctx, **self.cache_args)
        return {"seconds": dt, "tokens": len(new)}

    def start(self, first):
        c = self.cache
        c.reset()
        # a cache that keeps its last tokens' float rows (recent > 0) gets them by a prefill of
        # those tokens after the others' stored rows: decode then reads as many as it always will
        n0 = self.depth - min(c.recent, self.depth)
        if n0:
            for layer, rows in enumerate(self.saved):
                if self.fill_mode == "random":
                    c.write(layer, *(np.ascontiguousarray(r[:, :n0]) for r in rows))
                else:                               # as stored, bit for bit
                    c._restore_rows(layer, 0, 0, tuple(r[:, :n0] for r in rows))
            if c.recent:
                c.append(0, n0)
            else:
                c.commit(n0)
        if n0 < self.depth:
            self.m.prefill(self.context[n0:], cache=c)
        self.next = int(first)
        return {"length": c.length()}

    def steps(self, n):
        times, toks = [], []
        for _ in range(n):
            tok = [self.next]
            t0 = time.perf_counter()
            logits = self.m.step(tok, cache=self.cache)
            times.append(time.perf_counter() - t0)
            self.next = int(np.argmax(logits[0]))
            toks.append(self.next)
        return {"times": times, "tokens": toks}


class LlamaCppRunner:
    def __init__(self, path, n_ctx, flash_attn=False, kv="f16"):
        import llama_cpp
        self.lc = llama_cpp
        self.kv = kv
        self.flash_attn = bool(flash_attn) or kv != "f16"     # a quantized V needs flash attention
        t = llama_cpp.GGML_TYPE_F16 if kv == "f16" else llama_cpp.GGML_TYPE_Q8_0
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1,
                                   n_threads_batch=1, type_k=t, type_v=t,
                                   flash_attn=self.flash_attn, use_mmap=True, verbose=False)
        self.nv = self.llm.n_vocab()
        self.context, self.depth, self.next = [], 0, None

    def info(self):
        return {"version": self.lc.__version__, "cache": self.kv, "flash_attn": self.flash_attn,
                "n_ctx": self.llm.n_ctx(), "system": self.lc.llama_print_system_info().decode(errors="replace").strip()}

    def threads(self, n):
        self.lc.llama_set_n_threads(self.llm.ctx, n, n)

    def _logits(self):
        return np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.nv,))

    def prefill(self, tokens):
        self.llm.n_tokens = 0            # eval() drops the cache from n_tokens on
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "next": int(np.argmax(self._logits()))}

    def fill(self, tokens):
        tokens = list(tokens)
        keep = len(self.context) if self.context and tokens[:len(self.context)] == self.context else 0
        self.llm.n_tokens = keep          # eval() drops the cells from n_tokens on, then appends
        new = tokens[keep:]
        t0 = time.perf_counter()
        if new:
            self.llm.eval(new)            # in batches of n_batch
        self.context, self.depth = tokens, len(tokens)
        return {"seconds": time.perf_counter() - t0, "tokens": len(new)}

    def start(self, first):
        self.llm.n_tokens = self.depth    # the next eval() removes the cells after the context
        self.next = int(first)
        return {"length": self.depth}

    def steps(self, n):
        times, toks = [], []
        for _ in range(n):
            tok = [self.next]
            t0 = time.perf_counter()
            self.llm.eval(tok)
            times.append(time.perf_counter() - t0)
            self.next = int(np.argmax(self._logits()))
            toks.append(self.next)
        return {"times": times, "tokens": toks}


class TransformersRunner:
    def __init__(self, path, n_ctx):
        import torch
        import transformers as T
        T.logging.set_verbosity_error()
        self.torch, self.T = torch, T
        self.hf = T.AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                         gguf_file=os.path.basename(path),
                                                         dtype=torch.float32).eval()
        self.pkv, self.context, self.depth, self.next = None, [], 0, None

    def info(self):
        return {"version": self.T.__version__, "torch": self.torch.__version__, "cache": "fp32 (DynamicCache)",
                "dtype": "float32 (dequantized)"}

    def threads(self, n):
        self.torch.set_num_threads(n)

    def _run(self, ids, pkv):
        # logits of the last position only, as the other implementations compute (all of an
        # 8192-token prompt would be 1.6 GB for SmolLM2's vocabulary)
        with self.torch.no_grad():
            return self.hf(input_ids=self.torch.tensor([ids]), past_key_values=pkv, use_cache=True,
                           logits_to_keep=1)

    def prefill(self, tokens):
        pkv = self.T.DynamicCache()
        t0 = time.perf_counter()
        out = self._run(tokens, pkv)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "next": int(out.logits[0, -1].argmax())}

    def fill(self, tokens, chunk=512):
        tokens = list(tokens)
        if self.pkv is not None and self.context and tokens[:len(self.context)] == self.context:
            self._crop(len(self.context))
            new = tokens[len(self.context):]
        else:
            self.pkv, new = self.T.DynamicCache(), tokens
        t0 = time.perf_counter()
        for i in range(0, len(new), chunk):
            self._run(new[i:i + chunk], self.pkv)
        self.context, self.depth = tokens, len(tokens)
        return {"seconds": time.perf_counter() - t0, "tokens": len(new)}

    def _crop(self, n):
        extra = self.pkv.get_seq_length() - n
        if extra > 0:
            self.pkv.crop(-extra)          # a negative count removes that many tokens (4.x and 5.x alike)

    def start(self, first):
        self._crop(self.depth)
        self.next = int(first)
        return {"length": self.pkv.get_seq_length()}

    def steps(self, n):
        times, toks = [], []
        for _ in range(n):
            tok = [self.next]
            t0 = time.perf_counter()
            out = self._run(tok, self.pkv)
            times.append(time.perf_counter() - t0)
            self.next = int(out.logits[0, -1].argmax())
            toks.append(self.next)
        return {"times": times, "tokens": toks}


def _import(impl):
    if impl.startswith("kvsimd"):
        import kvsimd  # noqa: F401
        import kvsimd.loaders.gguf  # noqa: F401
        import kvsimd.loaders.tokenizer  # noqa: F401
    elif impl.startswith("llama.cpp"):
        import llama_cpp  # noqa: F401
    else:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401  (the lazy module's real import)


def physical_memory():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def serve(impl, path, n_ctx, fill="prefill", flash_attn=False, limit_memory=True):
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                          # C libraries' prints go to stderr, not into the replies
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()
    if limit_memory and impl != "transformers":
        # a loader that would need more than this machine's memory fails with MemoryError here
        # instead of waking the OOM killer (torch reserves address space freely: not limited)
        lim = physical_memory()
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    try:
        _import(impl)                  # the libraries are not part of the load: RSS before counts them
    except BaseException as e:
        send({"error": "%s: %s" % (type(e).__name__, e)})
        return 1
    before = rss_mib()
    t0 = time.perf_counter()
    try:
        if impl.startswith("kvsimd"):
            runner = KVSimdRunner(path, n_ctx, fill, impl[len("kvsimd-"):] if impl.startswith("kvsimd-") else "float16")
        elif impl.startswith("llama.cpp"):
            runner = LlamaCppRunner(path, n_ctx, flash_attn, "q8_0" if impl == "llama.cpp-q8_0" else "f16")
        else:
            runner = TransformersRunner(path, n_ctx)
    except BaseException as e:         # MemoryError, a file the library refuses, ...
        send({"error": "%s: %s" % (type(e).__name__, e)})
        return 1
    load_s = time.perf_counter() - t0
    after = rss_mib()
    send(dict(runner.info(), load_s=load_s, rss_before_MiB=before["rss_MiB"],
              **{k: v for k, v in after.items()}))
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "quit":
            break
        try:
            if name == "rss":
                reply = rss_mib()
            else:
                reply = getattr(runner, name)(**cmd) or {}
        except Exception as e:
            reply = {"error": "%s: %s" % (type(e).__name__, e)}
        send(reply)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd.bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", type=_impl)
    ap.add_argument("path")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill")
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args(argv)
    return serve(args.impl, args.path, args.n_ctx, args.fill, args.flash_attn)


if __name__ == "__main__":
    sys.exit(main())
