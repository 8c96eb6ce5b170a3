"""What widening fp16 K/V rows costs the FMA rate of a group of query heads, on the avx512 row.

    python bench/fp16_widen_cost.py [--length L]

Compiles bench/fp16_widen_cost.c with the avx512 row's flags (src_c/isa_rows.def) and runs it:
GFLOP/s of attn.inc.h's output tile (2, 4 and 8 query heads, data in L1) with V as fp32 rows, as
fp16 rows widened by VCVTPH2PS, and widened by integer ops, and the fp16 / fp32 ratio: on a core
whose widening shares the FMA pipes (Zen 4), that ratio bounds the fraction of the FMA peak that
fp16 attention of that group size can reach.  Needs gcc and a CPU with AVX-512 F/BW/VL/DQ/VNNI."""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src_c"))
from isa_rows import read_rows  # noqa: E402


def build(exe):
    """Compile fp16_widen_cost.c into exe with the avx512 row's flags."""
    flags = dict(read_rows())["avx512"]
    subprocess.run(["gcc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"] + flags +
                   [os.path.join(HERE, "fp16_widen_cost.c"), "-o", exe], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=float, default=1.0, help="rounds' length, in (0, 100] (1: about 10 s)")
    args = ap.parse_args()
    if not 0 < args.length <= 100:
        ap.error("--length must be in (0, 100]")
    import kvsimd
    if "avx512" not in kvsimd.isa_info()["supported"]:
        sys.exit("this CPU does not run the avx512 row (AVX-512 F/BW/VL/DQ/VNNI)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "fp16_widen_cost")
        build(exe)
        subprocess.run([exe, repr(args.length)], check=True)


if __name__ == "__main__":
    main()
