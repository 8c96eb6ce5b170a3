"""Integer dot products for the scores over an int8 K cache, measured beside what the kernel does.

    python bench/int8_dot_speed.py [--heads G ...]

Compiles bench/int8_dot_speed.c with the avx512 row's flags (src_c/isa_rows.def) and runs it for
groups of G = 3, 4, 8 and 32 query heads per KV head: ns per block of 16 keys (D = 128) for the
kernel's fp32 widening (A), integer products with an int16 query (B: VPDPWSSD, keys on the lanes)
and with an int8 query (C: VPDPBUSD), and each one's largest score error against float64 math.
Needs gcc and a CPU with AVX-512 F/BW/VL/DQ/VNNI (the avx512 row)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import avx512_c  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, action="append", help="query heads per KV head (default 3, 4, 8, 32)")
    args = ap.parse_args()
    avx512_c.run("int8_dot_speed", [[str(g)] for g in args.heads or [3, 4, 8, 32]], werror=False)


if __name__ == "__main__":
    main()
