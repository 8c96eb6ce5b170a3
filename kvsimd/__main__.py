"""python -m kvsimd generate [--model smollm2|PATH.gguf] [PROMPT]

Streams generated text to stdout; load time, prefill and decode speed, KV-cache size and the
active ISA go to stderr.  Exit status: 0 ok, 2 usage error, 1 runtime error."""
import argparse
import sys
import time


def _generate(args):
    import numpy as np

    import kvsimd
    from kvsimd import models
    from kvsimd.decoder import Decoder, sample

    if args.threads:
        kvsimd.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise kvsimd.KVSimdValueError("empty prompt (give one, or pipe it on stdin)")
    t0 = time.perf_counter()
    model = Decoder.from_gguf(models.resolve(args.model))
    tok = model.tokenizer
    load_s = time.perf_counter() - t0
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise kvsimd.KVSimdValueError("the prompt encodes to no tokens")
    if args.policy == "fixed":
        capacity = min(len(ids) + args.max_new_tokens, args.window or model.cfg.max_positions)
    else:  # infinite generation: a window of cached tokens that never fills
        capacity = min(args.window or 1024, model.cfg.max_positions)
    if len(ids) >= capacity:
        raise kvsimd.KVSimdValueError("prompt of %d tokens leaves no room in a %d-token cache (see --window)"
                                      % (len(ids), capacity))
    cache = model.new_cache(capacity=capacity, dtype=args.cache_dtype, n_keep=args.n_keep, policy=args.policy)
    rng = np.random.default_rng(args.seed)
    stream = tok.stream()
    t1 = time.perf_counter()
    logits = model.prefill(ids, cache=cache)
    prefill_s = time.perf_counter() - t1
    stop = {tok.eos_id} if tok.eos_id is not None else set()
    n_new, t2 = 0, time.perf_counter()
    out = sys.stdout
    while n_new < args.max_new_tokens:
        t = sample(logits, rng, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        n_new += 1
        if t in stop:
            break
        out.write(stream.step(t))
        out.flush()
        if args.policy == "fixed" and cache.length() >= capacity:
            break
        logits = model.step([t], cache=cache)[0]
    decode_s = time.perf_counter() - t2
    out.write("\n")
    print("load %.2f s | prefill %d tokens, %.1f tok/s | decode %d tokens, %.1f tok/s | KV cache %.1f MiB %s | isa %s"
          % (load_s, len(ids), len(ids) / max(prefill_s, 1e-9), n_new, n_new / max(decode_s, 1e-9),
             cache.nbytes / 2**20, args.cache_dtype, kvsimd.active_isa()), file=sys.stderr)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsimd", description="kvsimd command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text with a GGUF model (default: SmolLM2-135M-Instruct)")
    g.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    g.add_argument("--model", default="smollm2", help="'smollm2' or a path to a Llama-architecture .gguf file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--cache-dtype", choices=["float16", "float32"], default="float16")
    g.add_argument("--policy", choices=["fixed", "reevaluate", "shift", "sink_query", "auto"], default="fixed",
                   help="what to do when the cache is full: stop (fixed), or keep --n-keep sink tokens and slide "
                        "the window (StreamingLLM) by recomputing, shifting the cached keys, or rotating the query")
    g.add_argument("--n-keep", type=int, default=4, help="attention-sink tokens kept when the window slides")
    g.add_argument("--window", type=int, default=None, help="tokens the cache holds (default: prompt + new tokens "
                   "for --policy fixed, 1024 otherwise)")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or \
            (args.threads is not None and args.threads < 1) or args.n_keep < 0 or \
            (args.window is not None and args.window < 2):
        ap.error("--max-new-tokens and --threads must be >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1")
    try:
        return _generate(args)
    except KeyboardInterrupt:
        return 1
    except Exception as e:  # one line, no traceback
        print("kvsimd: error: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
