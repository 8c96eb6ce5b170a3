"""End-to-end decode speed: kvsimd against transformers (when installed) on the same weights.

Decode speed depends on the context length, not on what the context says, so both caches are
filled with the same random K/V up to the context and then timed over single-token steps.
"""
import statistics
import time

import numpy as np

import kvsimd
from kvsimd.bench.common import median_ci

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


def bench_smollm2(contexts, threads, steps, progress=None, text_path=None):
    """The real SmolLM2-135M-Instruct GGUF: prefill and decode tok/s, kvsimd vs transformers on
    the same file (both with float32 weights after dequantization)."""
    import os

    import torch
    import transformers as T

    from kvsimd.loaders import registry as models
    T.logging.set_verbosity_error()
    path = models.smollm2_path()
    ours = kvsimd.Decoder.from_gguf(path)
    hf = T.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
    text = ""
    if text_path:        # resolved by the command line (kvsimd.bench.common.text_path); else a filler
        with open(text_path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    ids = ours.tokenizer.encode(text or "All the world's a stage. " * 2000)
    rows = []
    for n_ctx in contexts:
        prompt = ids[:n_ctx]
        for nt in threads:
            kvsimd.set_num_threads(nt)
            torch.set_num_threads(nt)
            cache = ours.new_cache(capacity=n_ctx + steps + 8)
            t0 = time.perf_counter()
            logits = ours.prefill(prompt, cache=cache)
            pre = time.perf_counter() - t0
            tok = [int(np.argmax(logits))]
            dec = _median_step(lambda: ours.step(tok, cache=cache), steps)
            rows.append({"model": "smollm2", "impl": "kvsimd", "context": n_ctx, "threads": nt,
                         "prefill_tok_per_s": n_ctx / pre, "tok_per_s": 1.0 / dec, "isa": kvsimd.active_isa()})
            if progress:
                progress(rows[-1])
            from transformers import DynamicCache
            with torch.no_grad():
                pkv = DynamicCache()
                t0 = time.perf_counter()
                out = hf(input_ids=torch.tensor([prompt]), past_key_values=pkv, use_cache=True)
                pre = time.perf_counter() - t0
                pkv = out.past_key_values
                ids1 = out.logits[:, -1:].argmax(-1)
                dec = _median_step(lambda: hf(input_ids=ids1, past_key_values=pkv, use_cache=True), steps)
            rows.append({"model": "smollm2", "impl": "transformers", "context": n_ctx, "threads": nt,
                         "prefill_tok_per_s": n_ctx / pre, "tok_per_s": 1.0 / dec})
            if progress:
                progress(rows[-1])
    return rows
