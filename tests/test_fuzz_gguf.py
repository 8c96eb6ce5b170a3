"""Fuzzing the GGUF loader: mutated headers, counts, offsets, dims, types, strings, tensor data and
truncations of small valid GGUF files.  Every case must end in a clean GGUFError/KVSimdError (or a
model that loads and runs a step): no other exception, no signal, no hang, bounded memory.

The cases run in a child process (this file run as a script) under a timeout and an RLIMIT_AS
memory limit, so a crash, a hang or a huge allocation fails this test instead of the test run or
the machine; the child writes the case it is about to run first, so a crash names it.  Cases are
drawn from a seeded generator: KVSIMD_FUZZ_CASES (default 1200 per seed file, 3 files) and KVSIMD_FUZZ_SEED
reproduce or widen a run."""
import json
import os
import resource
import subprocess
import sys
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_LIMIT = 1 << 30          # address space of the child (it needs ~200 MB)
TIMEOUT_S = 240


# ------------------------------------------------------------------------------ the child
def slots(path):
    """Byte ranges of every header item of a valid GGUF file, from gguf's own reader:
    ("int", offset, size) for counts, lengths, types, dims and offsets; ("bytes", offset, size)
    for string payloads; plus where tensor data starts."""
    import gguf
    r = gguf.GGUFReader(path)
    base = r.data.ctypes.data
    out = []
    parts = [p for f in r.fields.values() for p in f.parts] + [p for t in r.tensors for p in t.field.parts]
    for p in parts:
        off = p.ctypes.data - base
        if p.dtype == np.uint8 and p.size != 1:
            out.append(("bytes", off, p.nbytes))
        elif p.dtype.kind in "uib":
            out += [("int", off + i * p.itemsize, p.itemsize) for i in range(p.size)]
        elif p.dtype.kind == "f":
            out.append(("float", off, p.nbytes))
    out += [("int", 8, 8), ("int", 16, 8), ("int", 4, 4)]    # tensor count, metadata count, version
    return out, int(r.data_offset)


INTERESTING = [0, 1, 2, 3, 7, 31, 32, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**62,
               2**63 - 1, 2**63, 2**64 - 1]


def mutate(data, slot_list, data_offset, rng):
    """One to three random mutations of ``data`` (a bytearray); returns their descriptions."""
    done = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["int", "int", "int", "float", "bytes", "flip", "truncate", "nan", "extend"])
        if kind == "int":
            _, off, size = [s for s in slot_list if s[0] == "int"][int(rng.integers(0, sum(s[0] == "int" for s in slot_list)))]
            old = int.from_bytes(data[off:off + size], "little")
            choices = INTERESTING + [old + 1, old - 1, old * 2, old // 2, len(data), len(data) - data_offset,
                                     int(rng.integers(0, 2**32))]
            v = int(choices[int(rng.integers(0, len(choices)))]) % (1 << (8 * size))
            data[off:off + size] = v.to_bytes(size, "little")
            done.append("int@%d/%d: %d -> %d" % (off, size, old, v))
        elif kind == "float":
            floats = [s for s in slot_list if s[0] == "float"]
            _, off, size = floats[int(rng.integers(0, len(floats)))]
            v = float(rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e-45, 1e38]))
            data[off:off + size] = np.array([v], dtype="<f%d" % size).tobytes()
            done.append("float@%d/%d -> %r" % (off, size, v))
        elif kind == "bytes":
            strings = [s for s in slot_list if s[0] == "bytes" and s[2] > 0]
            _, off, size = strings[int(rng.integers(0, len(strings)))]
            i = off + int(rng.integers(0, size))
            b = int(rng.choice([0x00, 0x20, 0x80, 0xC3, 0xE6, 0xFF, int(rng.integers(0, 256))]))
            data[i] = b
            done.append("byte@%d -> %#x (string)" % (i, b))
        elif kind == "flip":
            i = int(rng.integers(0, data_offset))
            bit = int(rng.integers(0, 8))
            data[i] ^= 1 << bit
            done.append("flip@%d bit %d" % (i, bit))
        elif kind == "truncate":
            n = int(rng.integers(0, len(data)) if rng.random() < 0.3 else rng.integers(0, data_offset + 64))
            del data[n:]
            done.append("truncate to %d" % n)
            break                                   # offsets past the cut no longer exist
        elif kind == "nan":
            if len(data) > data_offset + 4:
                i = data_offset + 4 * int(rng.integers(0, (len(data) - data_offset) // 4))
                v = bytes(rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff",
                                      b"\xff\xff\xff\xff", b"\x00\x7c\x00\x7c"]))
                data[i:i + 4] = v
                done.append("data@%d = %s" % (i, v.hex()))
        else:
            n = int(rng.integers(1, 64))
            data += bytes(rng.integers(0, 256, size=n, dtype=np.uint8))
            done.append("extend by %d" % n)
            break
    return done


def child(seed_paths, n_cases, seed, workdir, progress):
    import kvsimd
    from kvsimd import Decoder
    rng = np.random.default_rng(seed)
    bad, counts = [], {"loaded": 0, "refused": 0}
    case_path = os.path.join(workdir, "case.gguf")
    for src in seed_paths:
        slot_list, data_offset = slots(src)
        original = open(src, "rb").read()
        for k in range(n_cases):
            data = bytearray(original)
            desc = mutate(data, slot_list, data_offset, rng)
            with open(case_path, "wb") as fh:
                fh.write(data)
            with open(progress, "w") as fh:        # named if this case kills the process
                fh.write("%s case %d: %s" % (os.path.basename(src), k, "; ".join(desc)))
            try:
                m = Decoder.from_gguf(case_path)
                logits = m.prefill([0, 1], cache=m.new_cache(capacity=4))
                assert logits.shape == (m.cfg.vocab_size,)
                counts["loaded"] += 1
            except kvsimd.KVSimdError:
                counts["refused"] += 1
            except Exception:
                bad.append(("%s case %d: %s" % (os.path.basename(src), k, "; ".join(desc)),
                            traceback.format_exc(limit=4)))
    print(json.dumps({"cases": n_cases * len(seed_paths), "bad": bad, **counts}))


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    # Under AddressSanitizer (preloaded) the shadow memory alone exceeds any such limit: ASan's own
    # allocation checks (ASAN_OPTIONS, e.g. max_allocation_size_mb) bound memory there instead.
    if "asan" not in os.environ.get("LD_PRELOAD", "") and "ASAN_OPTIONS" not in os.environ:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    child(**args)
    sys.exit(0)


# ------------------------------------------------------------------------------ the test
def test_fuzz_gguf_loader(tmp_path):
    from test_gguf import write_llama_gguf
    seeds = []
    for qtype, extra in (("F32", {}), ("Q8_0", {}),     # and 2 layers, biases, an untied output, Q4_1
                         ("Q4_1", dict(layers=2, shapes={"output.weight": (40, 32), "blk.1.attn_q.bias": (32,),
                                                         "blk.1.attn_k.bias": (16,)}))):
        p = str(tmp_path / ("seed-%s.gguf" % qtype))
        write_llama_gguf(p, qtype, **extra)
        seeds.append(p)
    n = int(os.environ.get("KVSIMD_FUZZ_CASES", "1200"))
    seed = int(os.environ.get("KVSIMD_FUZZ_SEED", "20261123"))
    progress = str(tmp_path / "progress.txt")
    args = json.dumps(dict(seed_paths=seeds, n_cases=n, seed=seed, workdir=str(tmp_path), progress=progress))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",   # the kvsimd pytest imports
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__import__("kvsimd").__file__))]
                                          + os.environ.get("PYTHONPATH", "").split(os.pathsep)).rstrip(os.pathsep))
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), args], capture_output=True, text=True,
                           timeout=TIMEOUT_S, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("fuzz child hung for %d s in %s" % (TIMEOUT_S, open(progress).read())) from None
    last = open(progress).read() if os.path.exists(progress) else "(before the first case)"
    assert r.returncode == 0, "fuzz child died (status %d) in %s\n%s" % (r.returncode, last, r.stderr[-3000:])
    report = json.loads(r.stdout.strip().splitlines()[-1])
    print("GGUF fuzz: %d cases (seed %d): %d refused with a KVSimdError, %d loaded and ran a step, %d bad"
          % (report["cases"], seed, report["refused"], report["loaded"], len(report["bad"])))
    total = len(seeds) * n
    assert report["cases"] == total and report["refused"] + report["loaded"] + len(report["bad"]) == total
    assert not report["bad"], "\n\n".join("%s\n%s" % b for b in report["bad"][:5])
