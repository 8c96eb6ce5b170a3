"""Prompt-lookup decoding on SmolLM2: greedy generate() with lookup=N beside plain greedy, in one
process, alternating run by run, on a repetitive prompt (text to echo) and a non-repetitive one.

    python bench/lookup_speed.py [--lookup 4] [--new 128] [--repeat 3] [--threads 1]

Chat template on, one thread by default.  Printed per prompt: the median decode tok/s of each
(tokens after the first over the time after the first: the prefill is the same for both), their
ratio, the acceptance rate (accepted / drafted tokens), tokens per forward pass, and whether both
produced the same tokens."""
import argparse
import statistics
import time

import kvsimd
from kvsimd.loaders import registry
from kvsimd.observe import Observer, observe

PROMPTS = {
    "repetitive": "Repeat this list exactly, one item per line, then repeat it once more:\n"
                  "apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew melons, kiwis, "
                  "lemons, mangoes, nectarines, oranges, papayas, quinces, raspberries, strawberries",
    "code echo": "Copy this Python function exactly, changing nothing:\n\n"
                 "def moving_average(values, window):\n"
                 "    out = []\n"
                 "    total = 0.0\n"
                 "    for i, v in enumerate(values):\n"
                 "        total += v\n"
                 "        if i >= window:\n"
                 "            total -= values[i - window]\n"
                 "        if i >= window - 1:\n"
                 "            out.append(total / window)\n"
                 "    return out\n",
    "non-repetitive": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


class Count(Observer):
    def __init__(self):
        self.proposed = self.accepted = self.passes = 0

    def positions(self, part, n):
        self.passes += 1

    def drafts(self, proposed, accepted):
        self.proposed += proposed
        self.accepted += accepted


def run(model, ids, new, stop, lookup):
    with observe(model, Count()) as c:
        out, first = [], None
        t0 = time.perf_counter()
        for t in model.generate(ids, max_new_tokens=new, stop_tokens=stop, lookup=lookup):
            if first is None:
                first = time.perf_counter()
            out.append(t)
        end = time.perf_counter()
    return out, (len(out) - 1) / max(end - first, 1e-9), c, first - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lookup", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    kvsimd.set_num_threads(args.threads)
    model = registry.smollm2()
    tok = model.tokenizer
    stop = [] if tok.eos_id is None else [tok.eos_id]
    print("SmolLM2-135M-Instruct (%s), %d thread(s), isa %s, %d new tokens, lookup=%d, median of %d"
          % (model.source.rsplit("/", 1)[-1], args.threads, kvsimd.active_isa(), args.new, args.lookup, args.repeat))
    print("%-15s %7s %11s %11s %7s %10s %11s %5s" % ("prompt", "tokens", "plain tok/s", "lookup tok/s", "ratio",
                                                    "accepted", "tok/pass", "same"))
    for name, text in PROMPTS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        plain, look, ratios = [], [], []
        for _ in range(args.repeat):           # alternating: machine load moves both
            a, ra, _, _ = run(model, ids, args.new, stop, None)
            b, rb, c, _ = run(model, ids, args.new, stop, args.lookup)
            plain.append(ra)
            look.append(rb)
            ratios.append(rb / ra)
        passes = c.passes - 1                  # the prompt's prefill is not a decode pass
        print("%-15s %7d %11.1f %11.1f %6.2fx %4d/%-5d %11.2f %5s"
              % (name, len(b), statistics.median(plain), statistics.median(look), statistics.median(ratios),
                 c.accepted, c.proposed, (len(b) - 1) / max(passes, 1), a == b))


if __name__ == "__main__":
    main()
