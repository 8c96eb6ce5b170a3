"""End-to-end decode speed.

* :func:`run` -- random models of SmolLM2/BART shape, float32 weights, kvsimd against
  transformers (when installed) on the same weights and against the weight-streaming floor.
  Decode speed depends on the context length, not on what the context says, so both caches are
  filled with the same random K/V up to the context and then timed over single-token steps.
* :func:`bench_gguf` -- GGUF files as stored (SmolLM2 Q4_1 and its Q8_0/F16 variants from
  :mod:`kvsimd.bench.models`, or any file): load time and RSS, prefill, and decode at context
  depths, kvsimd beside llama.cpp (llama-cpp-python, same file) and transformers (same file,
  dequantized to float32), each implementation in its own process (:mod:`kvsimd.bench.peers`).
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvsimd
from kvsimd.bench.common import median_ci
from kvsimd.errors import KVSimdError

SHAPES = {
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 KV heads, head_dim 64, FFN 1536, vocab 49152
    "smollm2-shaped": dict(kind="llama", vocab=49152, d=576, layers=30, heads=9, kv_heads=3, ffn=1536),
    # BART-base-like: d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 32000; 256 source tokens
    "bart-shaped": dict(kind="bart", vocab=32000, d=512, layers=6, heads=8, kv_heads=8, ffn=2048, src=256),
}


def _hf_model(spec, seed=0):
    import torch
    import transformers as T
    T.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if spec["kind"] == "llama":
        cfg = T.LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["d"], intermediate_size=spec["ffn"],
                            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                            num_key_value_heads=spec["kv_heads"], max_position_embeddings=1 << 15,
                            rope_theta=1e5, tie_word_embeddings=True)
        return T.LlamaForCausalLM(cfg).eval()
    cfg = T.BartConfig(vocab_size=spec["vocab"], d_model=spec["d"], encoder_layers=spec["layers"],
                       decoder_layers=spec["layers"], encoder_attention_heads=spec["heads"],
                       decoder_attention_heads=spec["heads"], encoder_ffn_dim=spec["ffn"], decoder_ffn_dim=spec["ffn"],
                       max_position_embeddings=1024)
    return T.BartForConditionalGeneration(cfg).eval()


def _median_step(fn, steps, warmup=2):
    return _median_steps({"f": fn}, steps, warmup)["f"]


def _round_robin(fns, steps, warmup=2):
    """Seconds of every call of each function, timed in turn step by step (round robin, the
    order rotated every round), so that drift of a shared machine hits every implementation alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    order = list(fns)
    for i in range(steps):
        for name in order[i % len(order):] + order[:i % len(order)]:   # rotate who goes first
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _median_steps(fns, steps, warmup=2):
    """Median seconds per call of each function (see _round_robin)."""
    return {name: statistics.median(t) for name, t in _round_robin(fns, steps, warmup).items()}


def _paired_ratio(num, den):
    """Median over rounds of num[i] / den[i] (times of the same round), with a 95% bootstrap interval."""
    return median_ci([a / b for a, b in zip(num, den)])


def step_matrices(stack):
    """The weight matrices one decode step multiplies by, in order (the bytes it must stream)."""
    mats = []
    for lw in stack.layers:
        mats += [lw.attn.wqkv, lw.attn.wo]
        if lw.cross is not None:
            mats += [lw.cross.wq, lw.cross.wo]
        mats += [lw.ffn.w13 if lw.ffn.w13 is not None else lw.ffn.w1, lw.ffn.w2]
    return mats + [stack.lm_head]


def weight_floor_fn(stack):
    """The matrix-vector products of one step alone (same BLAS, same order, nothing else): with
    float32 weights beyond the LLC, the memory-bandwidth floor of any decode step that reads
    those weights, kvsimd's and transformers' alike.  Returns (fn, bytes streamed)."""
    mats = step_matrices(stack)
    xs = {m.shape[0]: np.ones((1, m.shape[0]), np.float32) for m in mats}

    def run():
        with kvsimd.threads.blas_scope():     # the BLAS threads of a kvsimd step
            for m in mats:
                np.matmul(xs[m.shape[0]], m)
    return run, sum(m.nbytes for m in mats)


def _rows(model, context, nt, all_times, nbytes, progress):
    """Rows of one configuration.  ``speedup`` on a peer's row: how many times kvsimd's step is
    faster, the median of per-round ratios (drift between rounds cancels), with its interval."""
    times = {impl: statistics.median(t) for impl, t in all_times.items()}
    extra = {"kvsimd": {"isa": kvsimd.active_isa(), "cache": "float16"},
             "weights floor": {"weight_bytes": nbytes, "GBps": nbytes / times.get("weights floor", 1) / 1e9},
             "transformers": {"cache": "fp32 (DynamicCache)"}}
    rows = []
    for impl, t in times.items():
        row = dict({"model": model, "impl": impl, "context": context, "threads": nt, "tok_per_s": 1.0 / t},
                   **extra[impl])
        if impl != "kvsimd" and "kvsimd" in all_times:
            med, lo, hi = _paired_ratio(all_times[impl], all_times["kvsimd"])
            row.update(speedup=med, speedup_ci95=[lo, hi])
        rows.append(row)
        if progress:
            progress(rows[-1])
    return rows


def bench_decoder_only(spec, contexts, threads, steps, with_hf=True, progress=None):
    import torch
    hf = _hf_model(spec)
    dec = kvsimd.Decoder.from_transformers(hf)
    floor, nbytes = weight_floor_fn(dec)
    cfg = dec.cfg
    rows = []
    rng = np.random.default_rng(0)
    for n_ctx in contexts:
        kv = [(rng.standard_normal((cfg.n_kv_heads, n_ctx, cfg.head_dim)).astype(np.float32) * 0.5,
               rng.standard_normal((cfg.n_kv_heads, n_ctx, cfg.head_dim)).astype(np.float32) * 0.5)
              for _ in range(cfg.n_layers)]
        for nt in threads:
            kvsimd.set_num_threads(nt)
            torch.set_num_threads(nt)
            cache = dec.new_cache(capacity=n_ctx + 2 * steps + 8, dtype="float16")
            for layer, (k, v) in enumerate(kv):
                cache.write(layer, k, v)
            cache.commit(n_ctx)
            tok = [1]
            fns = {"kvsimd": lambda: dec.step(tok, cache=cache), "weights floor": floor}
            if with_hf:
                from transformers import DynamicCache
                pkv = DynamicCache()
                for layer, (k, v) in enumerate(kv):
                    pkv.update(torch.from_numpy(k[None]), torch.from_numpy(v[None]), layer)
                ids = torch.tensor([[1]])

                def hf_step():
                    with torch.no_grad():
                        hf(input_ids=ids, past_key_values=pkv, use_cache=True)
                fns["transformers"] = hf_step
            rows += _rows(spec["name"], n_ctx, nt, _round_robin(fns, steps), nbytes, progress)
    return rows


def bench_encoder_decoder(spec, threads, steps, with_hf=True, progress=None):
    import torch
    hf = _hf_model(spec)
    ed = kvsimd.EncoderDecoder.from_transformers(hf)
    floor, nbytes = weight_floor_fn(ed)
    rng = np.random.default_rng(0)
    src = list(rng.integers(3, spec["vocab"], spec["src"]))
    start = hf.config.decoder_start_token_id
    rows = []
    for nt in threads:
        kvsimd.set_num_threads(nt)
        torch.set_num_threads(nt)
        cross = ed.cross_for([src])
        cache = ed.new_cache(capacity=2 * steps + 16)
        ed.prefill([start], cache=cache, cross=cross)
        fns = {"kvsimd": lambda: ed.step([5], cache=cache, cross=cross), "weights floor": floor}
        if with_hf:
            from transformers import DynamicCache, EncoderDecoderCache
            with torch.no_grad():
                enc = hf.get_encoder()(input_ids=torch.tensor([src]))
                pkv = EncoderDecoderCache(DynamicCache(), DynamicCache())
                out = hf(encoder_outputs=enc, decoder_input_ids=torch.tensor([[start]]), past_key_values=pkv,
                         use_cache=True)
            pkv = out.past_key_values
            ids = torch.tensor([[5]])

            def hf_step():
                with torch.no_grad():
                    hf(encoder_outputs=enc, decoder_input_ids=ids, past_key_values=pkv, use_cache=True)
            fns["transformers"] = hf_step
        rows += _rows(spec["name"], spec["src"], nt, _round_robin(fns, steps), nbytes, progress)
    return rows


def run(contexts, threads, steps, progress=None, models=None):
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        with_hf = True
    except ImportError:
        with_hf = False
    if not with_hf:
        raise SystemExit("decode: the benchmark builds its models with transformers; pip install "
                         "'transformers' 'torch==2.13.0'")
    rows = []
    for name, spec in SHAPES.items():
        if models is not None and name not in models:
            continue
        spec = dict(spec, name=name)
        if spec["kind"] == "llama":
            rows += bench_decoder_only(spec, contexts, threads, steps, with_hf, progress)
        else:
            rows += bench_encoder_decoder(spec, threads, steps, with_hf, progress)
    return rows


# ------------------------------------------------------------------------------ GGUF files, beside llama.cpp
GGUF_PEERS = ("llama.cpp", "transformers")
KV_INT8_PEERS = ("kvsimd-int8", "llama.cpp-q8_0")    # --kv-int8: the quantized caches beside the float16 ones
KV_INT4_PEERS = ("kvsimd-int4", "kvsimd-int8/int4")   # --kv-int4: kvsimd's int4 caches as well
_LLAMA_HINT = ('pip install -e ".[peers]" (built natively: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install '
               '--no-binary llama-cpp-python llama-cpp-python)')
PEER_HINTS = {"llama.cpp": _LLAMA_HINT, "llama.cpp-q8_0": _LLAMA_HINT,
              "transformers": "pip install transformers 'torch==2.13.0'"}


class WorkerError(KVSimdError, RuntimeError):
    """A worker process of the GGUF bench failed (its message and the tail of its stderr)."""


def _exit_text(rc):
    """A worker's return code as words: a signal by name (a natively built llama.cpp has died of
    SIGILL in its AMX matrix product on a Xeon)."""
    if rc is not None and rc < 0:
        try:
            return "killed by %s" % signal.Signals(-rc).name
        except ValueError:
            return "killed by signal %d" % -rc
    return "exited with status %s" % rc


class Worker:
    """One implementation in its own process (:mod:`kvsimd.bench.peers`), driven line by line."""

    def __init__(self, impl, path, n_ctx, fill="prefill", flash_attn=False):
        self.impl = impl
        self.log = tempfile.TemporaryFile(mode="w+")
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvsimd.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p]))
        if impl != "kvsimd" and kvsimd._SPIN_SET:
            # a peer runs with libgomp's own default spin (llama.cpp and torch use OpenMP too),
            # not the brief spin kvsimd's import sets for its own process
            env["GOMP_SPINCOUNT"] = "300000"
        self.p = subprocess.Popen([sys.executable, "-m", "kvsimd.bench.peers", impl, path, "--n-ctx", str(n_ctx),
                                   "--fill", fill] + (["--flash-attn"] if flash_attn else []),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        try:
            self.load = self._read()
        except BaseException:
            self.close()
            raise

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait()
            self.log.seek(0)
            tail = self.log.read().strip().splitlines()[-3:]
            raise WorkerError("%s worker %s%s" % (self.impl, _exit_text(rc), ": " + " | ".join(tail) if tail else ""))
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError("%s: %s" % (self.impl, reply["error"]))
        return reply

    def call(self, cmd, **kw):
        self.p.stdin.write(json.dumps(dict(cmd=cmd, **kw)) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"cmd": "quit"}\n')
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except Exception:
                self.p.kill()
                self.p.wait()
        self.log.close()


def gguf_summary(path):
    """(dominant weight type by bytes, number of weights, file size) of a GGUF file, from its directory."""
    from kvsimd.loaders.gguf import open_gguf
    gf = open_gguf(path)
    try:
        by = {}
        n = 0
        for t in gf.tensors.values():
            by[t.qtype.name] = by.get(t.qtype.name, 0) + t.nbytes
            n += int(np.prod(t.shape))
        return max(by, key=by.get), n, gf.size
    finally:
        gf.close()


def warm_page_cache(path):
    """Read the whole file once (and throw it away), so that every load after it is a warm one."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(16 << 20)
        while fh.readinto(buf):
            pass


def prompt_ids(path, n, text_path=None):
    """``n`` token ids of the text (``text_path``, else a filler), by the file's own tokenizer, the
    text repeated when it is shorter."""
    from kvsimd.loaders.tokenizer import Tokenizer
    text = ""
    if text_path:
        with open(text_path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    ids = Tokenizer.from_gguf(path).encode(text or "All the world's a stage. " * 2000)
    if not ids:
        raise KVSimdError("%s: the prompt text gives no tokens" % path)
    while len(ids) < n:
        ids = ids + ids
    return [int(i) for i in ids[:n]]


def available_peers(path, n_params, peers):
    """impl -> None (runs) or why it does not: "not installed", or skipped for memory."""
    out = {}
    for impl in peers:
        try:
            if impl.startswith("kvsimd"):
                pass
            elif impl.startswith("llama.cpp"):
                import llama_cpp  # noqa: F401
            else:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            out[impl] = None
        except ImportError:
            out[impl] = "not installed"
            continue
        if impl == "transformers":   # float32 weights: more than a quarter of the memory is not run
            need = 4 * n_params
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            if need > avail / 4:
                out[impl] = "skipped: its float32 weights would take %.1f GB (%.1f GB available)" % (
                    need / 1e9, avail / 1e9)
    return out


def _ci_rate(times):
    med, lo, hi = median_ci(times)
    return 1.0 / med, [1.0 / hi, 1.0 / lo]


def _peer_ratios(rows, paired):
    """Add to each peer's row the median over rounds of (peer time / kvsimd time) of the same round."""
    for r in rows:
        if r["impl"] != "kvsimd" and "kvsimd" in paired and r["impl"] in paired:
            med, lo, hi = _paired_ratio(paired[r["impl"]], paired["kvsimd"])
            r.update(speedup=med, speedup_ci95=[lo, hi])
    return rows


def _rotated(names, i):
    return names[i % len(names):] + names[:i % len(names)] if names else []


def _prefill_repeats(n, repeat):
    """Timed repeats of an ``n``-token prompt: ``repeat`` up to 1024 tokens, at most 3 beyond (an
    8192-token prefill takes tens of seconds per implementation and thread count)."""
    return repeat if n <= 1024 else min(repeat, 3)


def bench_gguf(models, depths, threads, steps, rounds, progress=None, text_path=None, prefill_tokens=(512,),
               prefill_repeat=5, load_repeat=3, peers=GGUF_PEERS, fill="prefill", flash_attn=False, warmup=2):
    """Load time and RSS, prefill of prompts of each length in ``prefill_tokens``, and decode at each context depth,
    of kvsimd and its peers on each GGUF file of ``models`` (a list of (label, path)), every
    implementation in its own process (:mod:`kvsimd.bench.peers`).

    Decode: each implementation fills its context with the same prompt tokens, ``depth`` of them
    (depth 0: one, a step needs a prompt; ``fill="random"``: kvsimd takes random K/V of the same
    length instead), then from the same next token runs
    ``warmup`` + ``rounds`` x ``steps`` greedy steps; rounds go round robin over the processes (the
    order rotated each round), and before each thread count every implementation is put back to the
    filled context, so all of them time the same positions.  Depths go in increasing order, each
    context prefilling only the tokens it adds to the one before; these prefills (with the largest
    thread count) are reported too ("fill" rows: ``tokens`` after ``start`` cached ones).  Prefill rows: one
    prompt of the text's first ``n`` tokens on an empty state, for each ``n`` in ``prefill_tokens`` (empty:
    none), the implementations taking turns within each repeat.  Peers' rows carry ``speedup``: the
    median over rounds of their step time over kvsimd's, with a 95% bootstrap interval, and
    ``same_tokens``: for how many of the ``greedy_tokens`` steps they chose kvsimd's tokens.  A peer
    that fails (its process dies, or it replies with an error) gets an "op": "peer" row saying how,
    and the run goes on without it."""
    rows = []

    def emit(row):
        rows.append(row)
        if progress:
            progress(row)
    prefill_tokens = sorted({int(n) for n in prefill_tokens if n})
    n_ctx = max(max(depths) + warmup + rounds * steps + 16, max(prefill_tokens, default=0) + 16)
    for label, path in models:
        weights, n_params, size = gguf_summary(path)
        base = {"model": label, "weights": weights, "file": os.path.basename(path)}
        ids = prompt_ids(path, max(max(depths) + 2, max(prefill_tokens, default=0)), text_path)
        warm_page_cache(path)
        status = available_peers(path, n_params, peers)
        for impl, why in status.items():
            if why:
                emit(dict(base, op="peer", impl=impl, status=why,
                          **({"hint": PEER_HINTS[impl]} if why == "not installed" else {})))
        impls = ["kvsimd"] + [i for i in peers if status[i] is None]
        # load: fresh processes, warm page cache; llama.cpp with a small context (its KV cache is
        # allocated at load and counted in its RSS)
        for impl in list(impls):
            loads = []
            try:
                for _ in range(load_repeat):
                    w = Worker(impl, path, 512, fill, flash_attn)
                    w.close()
                    loads.append(w.load)
            except WorkerError as e:
                emit(dict(base, op="peer", impl=impl, status="failed: %s" % e))
                impls.remove(impl)
                continue
            last = loads[-1]
            info = {k: v for k, v in last.items() if k in ("version", "isa", "flash_attn", "torch")}
            emit(dict(base, op="load", impl=impl, load_s=statistics.median(x["load_s"] for x in loads),
                      load_s_runs=[x["load_s"] for x in loads], rss_before_MiB=last["rss_before_MiB"],
                      rss_after_MiB=last["rss_MiB"], rss_anon_MiB=last["rss_anon_MiB"],
                      rss_file_MiB=last["rss_file_MiB"], rss_delta_MiB=last["rss_MiB"] - last["rss_before_MiB"],
                      file_MiB=size / 2**20, **info))
        workers = {}

        def call(impl, cmd, **kw):
            """``impl``'s reply to ``cmd``, or None when it is a peer that failed (a crash, an error
            reply): that peer is reported (an "op": "peer" row) and dropped from the rest of this
            model's run, whose other implementations go on.  A failure of kvsimd's own (any of its
            caches) ends the run."""
            try:
                return workers[impl].call(cmd, **kw)
            except WorkerError as e:
                if impl.startswith("kvsimd"):
                    raise
                emit(dict(base, op="peer", impl=impl, status="failed: %s" % e))
                workers.pop(impl).close()
                return None
        try:
            for impl in list(impls):
                try:
                    workers[impl] = Worker(impl, path, n_ctx, fill, flash_attn)
                except WorkerError as e:
                    emit(dict(base, op="peer", impl=impl, status="failed: %s" % e))
                    impls.remove(impl)
            infos = {impl: {k: v for k, v in w.load.items() if k in ("isa", "cache", "version", "flash_attn",
                                                                     "fill", "dtype")}
                     for impl, w in workers.items()}
            # prefill of one prompt of each length, each repeat on an empty state
            for n, nt in ((n, nt) for n in prefill_tokens for nt in threads):
                prompt = ids[:n]
                for impl in list(workers):
                    call(impl, "threads", n=nt)
                times = {impl: [] for impl in workers}
                repeat = _prefill_repeats(n, prefill_repeat)
                warm = 1 if repeat >= 3 and n <= 1024 else 0      # a round that warms up, untimed
                for i in range(warm + repeat):
                    for impl in _rotated(list(workers), i):
                        r = call(impl, "prefill", tokens=prompt)
                        if r is not None and i >= warm:
                            times[impl].append(r["seconds"])
                times = {impl: t for impl, t in times.items() if impl in workers}
                out = []
                for impl, t in times.items():
                    rate, ci = _ci_rate([x / len(prompt) for x in t])
                    out.append(dict(base, op="prefill", impl=impl, tokens=len(prompt), threads=nt, tok_per_s=rate,
                                    tok_per_s_ci95=ci, repeat=repeat, **infos[impl]))
                for r in _peer_ratios(out, times):
                    emit(r)
            # decode at each depth
            for depth in sorted(depths):               # each context extends the one before
                context = ids[:max(depth, 1)]         # depth 0: a one-token prompt (a step needs one)
                for impl in list(workers):
                    f = call(impl, "threads", n=max(threads))
                    f = None if f is None else call(impl, "fill", tokens=context)
                    if f is not None and f["tokens"] > 1:      # the context's prefill, in chunks of 512: a prefill figure too
                        # (0 tokens: kvsimd with fill="random" prefilled nothing)
                        emit(dict(base, op="fill", impl=impl, tokens=f["tokens"], start=len(context) - f["tokens"],
                                  threads=max(threads), seconds=f["seconds"], tok_per_s=f["tokens"] / f["seconds"],
                                  **infos[impl]))
                for nt in threads:
                    chosen = {}
                    for impl in list(workers):
                        if call(impl, "threads", n=nt) is None or call(impl, "start", first=ids[len(context)]) is None:
                            continue
                        r = call(impl, "steps", n=warmup) if warmup else {"tokens": []}
                        if r is not None:
                            chosen[impl] = list(r["tokens"])
                    every = {impl: [] for impl in workers}
                    per_round = {impl: [] for impl in workers}
                    for i in range(rounds):
                        for impl in _rotated(list(workers), i):
                            r = call(impl, "steps", n=steps)
                            if r is None:
                                continue
                            every[impl] += r["times"]
                            chosen[impl] += r["tokens"]
                            per_round[impl].append(statistics.median(r["times"]))
                    out = []
                    for impl, t in every.items():
                        if impl not in workers:
                            continue
                        rate, ci = _ci_rate(t)
                        out.append(dict(base, impl=impl, context=depth, context_tokens=len(context), threads=nt,
                                        tok_per_s=rate, tok_per_s_ci95=ci, steps=len(t), rounds=rounds,
                                        **infos[impl]))
                        if impl != "kvsimd" and "kvsimd" in chosen:   # how long both chose the same tokens
                            same = next((j for j, (a, b) in enumerate(zip(chosen[impl], chosen["kvsimd"])) if a != b),
                                        len(chosen[impl]))
                            out[-1].update(same_tokens=same, greedy_tokens=len(chosen[impl]))
                    for r in _peer_ratios(out, {impl: t for impl, t in per_round.items() if impl in workers}):
                        emit(r)
            for impl in list(workers):
                r = call(impl, "rss")
                if r is not None:
                    emit(dict(base, op="memory", impl=impl, **r))
        finally:
            for w in workers.values():
                w.close()
    return rows
