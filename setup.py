"""Build kvsimd: one static kernel library per ISA (each compiled once, with its own flags)
linked into a single Cython extension module that holds the dispatch table."""
import os
import subprocess
import sys
import sysconfig
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

BASE_CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-function", "-fvisibility=hidden",
               # kernels never call libc (no memcpy/memset from loop idioms), so that the same
               # object code also runs in the emulator used by the tests
               "-fno-tree-loop-distribute-patterns", "-fno-stack-protector"]
ISA_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512fp16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512fp16"],
}


def compiler_accepts(flags):
    """Can the C compiler build AVX512-FP16 code with these flags?"""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    src = "#include <immintrin.h>\n__m512h f(__m512h a, __m512h b) { return _mm512_fmul_pch(a, b); }\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as fh:
            fh.write(src)
        cmd = cc.split() + flags + ["-c", path, "-o", os.path.join(tmp, "probe.o")]
        try:
            return subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            return False


# KVSIMD_SANITIZE=1: AddressSanitizer + UBSan in the kernel libraries and the extension (CI's
# sanitizer step; run Python with libasan/libubsan in LD_PRELOAD).  Never for a normal install.
SANITIZE = os.environ.get("KVSIMD_SANITIZE") == "1"
SAN_CFLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"] if SANITIZE else []
SAN_LDFLAGS = ["-fsanitize=address,undefined"] if SANITIZE else []

rows = ["scalar", "avx2"]
if compiler_accepts(ISA_FLAGS["avx512fp16"]):
    rows.append("avx512fp16")
else:
    print("kvsimd: the C compiler does not accept -mavx512fp16; the avx512fp16 row is not compiled",
          file=sys.stderr)

libraries = [
    ("kv_" + isa, {
        "sources": ["src_c/kernels/tu_%s.c" % isa],
        "include_dirs": ["src_c", "src_c/kernels"],
        "cflags": BASE_CFLAGS + ["-fPIC"] + ISA_FLAGS[isa] + SAN_CFLAGS,
        "obj_deps": {"": [os.path.join("src_c", "kvsimd.h")] +
                     [os.path.join("src_c", "kernels", f) for f in os.listdir("src_c/kernels")]},
    })
    for isa in rows
]

debug = os.environ.get("KVSIMD_DEBUG_CYTHON") == "1"
directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": not debug,
    "embedsignature": True,
}

ext = Extension(
    "kvsimd._kvsimd",
    sources=["kvsimd/_kvsimd.pyx", "src_c/cpu.c", "src_c/dispatch.c", "src_c/ops.c", "src_c/membench.c", "src_c/cache.c"],
    include_dirs=["src_c", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    + ([("KV_HAVE_AVX512FP16", "1")] if "avx512fp16" in rows else []),
    extra_compile_args=["-O2", "-fvisibility=hidden", "-fopenmp"] + SAN_CFLAGS,
    extra_link_args=["-fopenmp"] + SAN_LDFLAGS,
    libraries=["m"],
)

setup(
    libraries=libraries,
    ext_modules=cythonize([ext], compiler_directives=directives,
                          include_path=["kvsimd"]),
)
