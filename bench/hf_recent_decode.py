"""What recent float rows cost a decode step through the transformers integration: SmolLM2 run by
transformers over KVSimdCache(dtype=..., recent=0) and KVSimdCache(dtype=..., recent=R), side by side.

    python bench/hf_recent_decode.py [--dtype int4] [--recent 32] [--depth 512] [--steps 48]
                                     [--rounds 6] [--threads 2]

transformers loads SmolLM2 from its GGUF (kvsimd.bench.hf.transformers_from_gguf) with
attn_implementation="kvsimd".  Per round and cache, alternated: generate(--steps + 1 tokens)
after a prompt of --depth random tokens, minus generate(1 token) (the prefill), on fresh caches;
prints each cache's tok/s per round and the median, and the median of the paired ratios."""
import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="int4", choices=["int8", "int4", "int8/int4"])
    ap.add_argument("--recent", type=int, default=32, help="float rows of the second cache (default 32)")
    ap.add_argument("--depth", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed (default 48)")
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds (default 6)")
    ap.add_argument("--threads", type=int, default=2, help="torch and kvsimd threads (default 2)")
    args = ap.parse_args()
    if min(args.recent, args.depth, args.steps, args.rounds, args.threads) < 1:
        ap.error("--recent, --depth, --steps, --rounds and --threads must be >= 1")
    import torch

    import kvsimd
    import kvsimd.integrations.transformers as kt
    from kvsimd.bench.hf import transformers_from_gguf
    from kvsimd.loaders import registry
    torch.set_num_threads(args.threads)
    kvsimd.set_num_threads(args.threads)
    m = transformers_from_gguf(registry.smollm2_path())
    kt.enable(m)
    m.generation_config.eos_token_id = None
    ids = torch.randint(1, m.config.vocab_size, (1, args.depth), generator=torch.Generator().manual_seed(0))
    kinds = [("%s" % args.dtype, 0), ("%s + recent %d" % (args.dtype, args.recent), args.recent)]
    res = {name: [] for name, _ in kinds}
    for _ in range(args.rounds):
        for name, R in kinds:
            t = []
            for n in (1, args.steps + 1):
                cache = kt.KVSimdCache(m, dtype=args.dtype, recent=R)
                t0 = time.perf_counter()
                m.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0)
                t.append(time.perf_counter() - t0)
            res[name].append(args.steps / (t[1] - t[0]))
    print("%s, %d thread(s), depth %d, %d steps" % (kvsimd.active_isa(), args.threads, args.depth, args.steps))
    for name, v in res.items():
        print("%-18s tok/s median %.1f   %s" % (name, np.median(v), " ".join("%.1f" % x for x in v)))
    r = np.array(res[kinds[1][0]]) / np.array(res[kinds[0][0]])
    print("ratio %.3f [%.3f, %.3f]" % (np.median(r), r.min(), r.max()))


if __name__ == "__main__":
    main()
