"""What the query-on-lanes path's register tiles wait for on the avx512 row: 512-bit loads per cycle.

    python bench/lane_tile_loads.py [--length L]

Compiles bench/lane_tile_loads.c with the avx512 row's flags (src_c/isa_rows.def) and runs it: per
TSC cycle, the rate of 512-bit loads (VMOVAPS zmm, VBROADCASTSS zmm) beside 256-bit broadcasts, of
FMAs alone, and of attn.inc.h's two lanes tiles (2 x 8 with one head-dim element per lane, 4 x 6
in the pair layout) over L1-resident data; quartiles over rounds.  Needs gcc and a CPU with
AVX-512 F/BW/VL/DQ/VNNI."""
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
    """Compile lane_tile_loads.c into exe with the avx512 row's flags."""
    flags = dict(read_rows())["avx512"]
    subprocess.run(["gcc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"] + flags +
                   [os.path.join(HERE, "lane_tile_loads.c"), "-o", exe], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=float, default=1.0, help="rounds' length, in (0, 100] (1: about 5 s)")
    args = ap.parse_args()
    if not 0 < args.length <= 100:
        ap.error("--length must be in (0, 100]")
    import kvsimd
    if "avx512" not in kvsimd.isa_info()["supported"]:
        sys.exit("this CPU does not run the avx512 row (AVX-512 F/BW/VL/DQ/VNNI)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "lane_tile_loads")
        build(exe)
        subprocess.run([exe, repr(args.length)], check=True)


if __name__ == "__main__":
    main()
