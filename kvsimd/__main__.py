"""python -m kvsimd generate [--model smollm2|PATH.gguf] [PROMPT]

Streams generated text to stdout; load time, prefill and decode speed, KV-cache size and the
active ISA go to stderr.  Every error is one ``kvsimd: error:`` line on stderr.  Exit status:
0 ok, 1 runtime error (including a full cache under ``--policy fixed``), 2 usage error,
130 interrupted (Ctrl-C: the text so far, a newline and the statistics are still written)."""
import argparse
import math
import os
import sys
import time

INT_MAX = 2**31 - 1
SLIDING_N_KEEP = 4       # attention sinks kept by the sliding policies unless --n-keep says otherwise


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line naming the flag and the value, no usage block
        self.exit(2, "kvsimd: error: %s\n" % message)


def _integer(lo, hi=INT_MAX):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError("must be an integer in [%d, %d], got %r" % (lo, hi, text)) from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError("must be an integer in [%d, %d], got %r" % (lo, hi, text))
        return v
    return parse


def _number(lo, hi, lo_open=False):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            raise argparse.ArgumentTypeError("must be a number in %s%g, %g], got %r"
                                             % ("(" if lo_open else "[", lo, hi, text))
        return v
    return parse


def parser():
    ap = _Parser(prog="python -m kvsimd", description="kvsimd command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text with a GGUF model (default: SmolLM2-135M-Instruct)")
    g.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    g.add_argument("--model", default="smollm2", help="'smollm2' or a path to a .gguf file (architectures: llama, qwen2, qwen3, phi3, gemma2)")
    g.add_argument("--max-new-tokens", type=_integer(1), default=128)
    g.add_argument("--temperature", type=_number(0, 1e6), default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=_integer(0), default=0, help="0 = no limit")
    g.add_argument("--top-p", type=_number(0, 1, lo_open=True), default=1.0)
    from kvsimd._kvsimd import _I64_MAX     # generate()'s seed rule: an integer in [0, 2**63 - 1]
    g.add_argument("--seed", type=_integer(0, _I64_MAX), default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--threads", type=_integer(1), default=None,
                   help="threads (at most the cores this process may use; more are capped with a warning)")
    g.add_argument("--cache-dtype", choices=["float16", "float32", "int8", "int4", "int8/int4", "int4/int8"],
                   default="float16", help="KV-cache storage (int8/int4: int8 keys, int4 values)")
    g.add_argument("--activations", choices=["int8", "float32"], default="int8",
                   help="how the Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K matrices multiply: int8 rounds each block of 32 "
                        "activations to int8 (as llama.cpp does; about twice the speed), float32 widens the "
                        "weights (the model's own arithmetic; a tiny model's near-tied greedy choices can differ)")
    g.add_argument("--cache-recent", type=_integer(0), default=0, metavar="R",
                   help="with a quantized --cache-dtype: also keep the last R tokens' float16 K/V rows, each "
                        "token reading its last R keys from them (int4 loses most of its perplexity cost with 32)")
    g.add_argument("--policy", choices=["fixed", "reevaluate", "shift", "sink_query", "auto"], default="fixed",
                   help="when the cache is full: stop with an error (fixed), or keep --n-keep sink tokens and slide "
                        "the window (StreamingLLM) by recomputing, shifting the cached keys, or rotating the query")
    g.add_argument("--n-keep", type=_integer(0), default=None,
                   help="attention-sink tokens kept when the window slides (default %d; 0 with --policy fixed)"
                        % SLIDING_N_KEEP)
    g.add_argument("--window", type=_integer(2), default=None,
                   help="tokens the cache holds (default: prompt + new tokens for --policy fixed, 1024 otherwise)")
    from kvsimd.nn.generate import MAX_LOOKUP
    g.add_argument("--lookup", type=_integer(0, MAX_LOOKUP), default=0,
                   help="prompt-lookup decoding: draft up to N tokens per step from earlier text and verify them in "
                        "one pass (greedy only; 0 = off)")
    return ap


class _Usage(Exception):
    """A usage error found after parsing (exit status 2)."""


def _error(msg):
    print("kvsimd: error: %s" % msg, file=sys.stderr)


def _read_prompt(args):
    if args.prompt is not None:   # the OS gives bytes; Python maps bytes that are not UTF-8 to lone surrogates
        data, where = os.fsencode(args.prompt), "argument"
    elif sys.stdin is None or sys.stdin.isatty():
        raise _Usage("no prompt: give it as an argument (python -m kvsimd generate \"PROMPT\") or pipe it on stdin")
    else:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else \
            sys.stdin.read().encode("utf-8", "surrogatepass")     # a text stream put there by a caller
        where = "on stdin"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Usage("the prompt %s is not valid UTF-8 (byte 0x%02x at offset %d)" % (where, data[e.start], e.start)) \
            from None


def _generate(args, stats):
    import kvsimd
    from kvsimd.loaders import registry as models
    from kvsimd.nn import Decoder
    from kvsimd.threads import available_cores

    if args.threads is not None:
        cores = available_cores()
        if args.threads > cores:
            print("kvsimd: warning: --threads %d is more than the %d core%s this process may use; using %d"
                  % (args.threads, cores, "" if cores == 1 else "s", cores), file=sys.stderr)
        kvsimd.set_num_threads(min(args.threads, cores))
    if args.lookup and args.temperature != 0:
        raise _Usage("--lookup %d needs greedy decoding (--temperature 0), got --temperature %g"
                     % (args.lookup, args.temperature))
    prompt = _read_prompt(args)
    if not prompt:
        raise _Usage("empty prompt (give one, or pipe it on stdin)")
    t0 = time.perf_counter()
    model = Decoder.from_gguf(models.resolve(args.model), activations=args.activations)
    tok = model.tokenizer
    stats["load_s"] = time.perf_counter() - t0
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise _Usage("the prompt encodes to no tokens")
    cfg = model.cfg
    if args.policy == "fixed":
        capacity = min(len(ids) + args.max_new_tokens, args.window or cfg.max_positions)
        n_keep = 0 if args.n_keep is None else args.n_keep
    else:  # infinite generation: a window of cached tokens that never fills
        capacity = min(args.window or 1024, cfg.max_positions)
        n_keep = SLIDING_N_KEEP if args.n_keep is None else args.n_keep
    if len(ids) >= capacity:
        raise _Usage("prompt of %d tokens leaves no room in a %d-token cache (see --window; the model's context "
                     "is %d)" % (len(ids), capacity, cfg.max_positions))
    if n_keep >= capacity - 1:
        raise _Usage("--n-keep %d leaves no sliding window in a %d-token cache (see --window)" % (n_keep, capacity))
    D, nb = cfg.head_dim, -(-cfg.head_dim // 32)   # bytes of one cached row: int8 / int4 add a float32 scale per 32 values
    row_bytes = {"float16": 2 * D, "float32": 4 * D, "int8": D + 4 * nb, "int4": 16 * nb + 4 * nb}
    kv_bytes = sum(row_bytes[d] for d in (args.cache_dtype.split("/") * 2)[:2])    # a K row and a V row
    recent_mib = cfg.n_layers * cfg.n_kv_heads * 4 * min(args.cache_recent, capacity) * 2 * 2 * D / 2**20  # 4R float16 K/V rows
    stream = tok.stream()
    out = sys.stdout
    # generate() checks its arguments now and prefills at the first next(): statistics from here on
    gen = model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_tokens=[] if tok.eos_id is None else [tok.eos_id],
                         cache_dtype=args.cache_dtype, capacity=capacity, n_keep=n_keep, policy=args.policy,
                         lookup=args.lookup, cache_recent=args.cache_recent)
    stats.update(prompt=len(ids), cache_mib=cfg.n_layers * cfg.n_kv_heads * capacity * kv_bytes / 2**20 + recent_mib,
                 started=time.perf_counter())
    try:
        for t in gen:
            if stats["n_new"] == 0:
                stats["first"] = time.perf_counter()   # prefill + one sample
            stats["n_new"] += 1
            out.write(stream.step(t))
            out.flush()
    finally:
        gen.close()
        out.write(stream.flush())
        stats["end"] = time.perf_counter()


def _print_stats(args, stats):
    import kvsimd
    if "started" not in stats:
        return
    end = stats.get("end") or time.perf_counter()
    first, n = stats.get("first", end), stats["n_new"]
    print("load %.2f s | prefill %d tokens, %.1f tok/s | decode %d tokens, %.1f tok/s | KV cache %.4g MiB %s | activations %s | isa %s"
          % (stats["load_s"], stats["prompt"], stats["prompt"] / max(first - stats["started"], 1e-9), n,
             max(n - 1, 0) / max(end - first, 1e-9), stats["cache_mib"], args.cache_dtype, args.activations,
             kvsimd.active_isa()),
          file=sys.stderr)


def exit_if_cli(e):
    """For ``kvsimd/__init__.py`` when importing the package fails (a bad KVSIMD_FORCE_ISA or
    KVSIMD_NUM_THREADS): under ``python -m kvsimd`` the package is imported before :func:`main` can
    catch anything, so the one-line error and exit status 2 come from here.  Elsewhere it returns
    and the caller re-raises."""
    argv = getattr(sys, "orig_argv", None) or []
    if sys.argv[:1] == ["-m"] and "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["kvsimd"]:
        msg = str(e)
        _error(msg[len("kvsimd: "):] if msg.startswith("kvsimd: ") else msg)
        raise SystemExit(2)


def main(argv=None):
    args = parser().parse_args(argv)
    if sys.stdout is None:      # started with stdout closed (`... >&-`)
        _error("standard output is closed: nowhere to write the generated text")
        return 1
    stats = {"n_new": 0}
    try:
        try:
            _generate(args, stats)
            rc = 0
        finally:
            if "started" in stats:
                sys.stdout.write("\n")
                sys.stdout.flush()
                _print_stats(args, stats)
    except KeyboardInterrupt:
        print("kvsimd: interrupted", file=sys.stderr)
        return 130
    except _Usage as e:
        _error(e)
        return 2
    except BrokenPipeError:   # stdout closed early (`| head`): stop quietly, also at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # one line, no traceback
        from kvsimd.errors import KVSimdCapacityError
        if isinstance(e, KVSimdCapacityError) and args.policy == "fixed":
            _error("%s: the cache is full (--policy fixed stops there; --window sets its size, --policy "
                   "sink_query/shift/reevaluate keep generating)" % e)
        else:
            _error(e)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
