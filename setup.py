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
from setuptools.command.build import build as _build
from setuptools.command.build_clib import build_clib as _build_clib
from setuptools.command.build_ext import build_ext as _build_ext

BASE_CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-function", "-fvisibility=hidden",
               # kernels never call libc (no memcpy/memset from loop idioms), so that the same
               # object code also runs in the emulator used by the tests
               "-fno-tree-loop-distribute-patterns", "-fno-stack-protector"]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "src_c"))
from isa_rows import read_rows  # noqa: E402  (src_c/isa_rows.def: the one table of ISA rows)

ISA_ROWS = read_rows()
ISA_FLAGS = dict(ISA_ROWS)


def compiler_accepts(isa):
    """Can the C compiler build this row's vector layer (its intrinsics) with the row's flags?"""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as fh:
            fh.write('#include "vec_%s.h"\nint kv_probe(void) { return KV_W; }\n' % isa)
        inc = ["-I" + os.path.join(HERE, "src_c"), "-I" + os.path.join(HERE, "src_c", "kernels")]
        cmd = cc.split() + inc + ISA_FLAGS[isa] + ["-c", path, "-o", os.path.join(tmp, "probe.o")]
        try:
            return subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            return False


# KVSIMD_SANITIZE=1: AddressSanitizer + UBSan in the kernel libraries and the extension (CI's
# sanitizer step; run Python with libasan/libubsan in LD_PRELOAD).  Never for a normal install.
SANITIZE = os.environ.get("KVSIMD_SANITIZE") == "1"
# -O1 -g0 (after Python's own -g -O2/-O3, so they win): with -O2, or with -g, the instrumented kernel
# rows took 110-300+ s each to compile (gcc's variable tracking through the always-inline kernels), at
# -O1 -g0 about 25 s; the sanitizers' checks do not depend on either (reports name functions, not lines)
SAN_CFLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g0"] if SANITIZE else []
# The kernel rows also without Python's -fwrapv: instrumented, a row took 100-200 s to compile with it
# and about 50 s without (gcc 12, the Xeon), and UBSan then checks the kernels for signed overflow,
# which -fwrapv defines away.  (The extension keeps it: Cython's code compiled slower without.)
SAN_ROW_CFLAGS = SAN_CFLAGS + ["-fno-wrapv"] if SANITIZE else []
SAN_LDFLAGS = ["-fsanitize=address,undefined"] if SANITIZE else []

rows = []
for isa, _flags in ISA_ROWS:
    if isa == "scalar" or compiler_accepts(isa):
        rows.append(isa)
    else:
        print("kvsimd: the C compiler does not accept %s; the %s row is not compiled" % (" ".join(ISA_FLAGS[isa]), isa),
              file=sys.stderr)

libraries = [
    ("kv_" + isa, {
        "sources": ["src_c/kernels/tu_%s.c" % isa],
        "include_dirs": ["src_c", "src_c/kernels"],
        # the row's flags, and the same flags as the text show_runtime prints
        "cflags": BASE_CFLAGS + ["-fPIC"] + ISA_FLAGS[isa] + SAN_ROW_CFLAGS
        + ['-DKV_ROW_CFLAGS="%s"' % " ".join(ISA_FLAGS[isa])],
        "obj_deps": {"": [os.path.join("src_c", f) for f in ("kvsimd.h", "isa_rows.def", "wtypes.def")] +
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
    sources=["kvsimd/_kvsimd.pyx", "src_c/cpu.c", "src_c/dispatch.c", "src_c/ops.c", "src_c/membench.c", "src_c/cache.c",
             "src_c/layout.c"],
    include_dirs=["src_c", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("KV_BUILT_ROWS", " ".join("KV_ROW(%s)" % isa for isa in rows))],
    extra_compile_args=["-O2", "-fvisibility=hidden", "-fopenmp"] + SAN_CFLAGS,
    extra_link_args=["-fopenmp"] + SAN_LDFLAGS,
    libraries=["m"],
)

# Where build_clib leaves the kernel rows' archives and objects unless told otherwise: one place in
# the tree for every way of building (pip install -e, setup.py build_ext --inplace), one per flavour.
# tests/test_c_units.py links the C unit tests against these archives (the extension's own rows)
# instead of compiling the rows a second time.
CLIB_DIR = os.path.join(HERE, "build", "clib-sanitize" if SANITIZE else "clib")


class build_clib(_build_clib):
    """The kernel rows compiled side by side, one compiler per row and at most one per core: each
    row is one translation unit of always-inline kernels that takes a minute or more.  Archives in
    CLIB_DIR and objects under it, not in build's temporary directory (pip's is deleted)."""

    def finalize_options(self):
        if self.build_clib is None:
            self.build_clib = CLIB_DIR
        if self.build_temp is None:
            self.build_temp = os.path.join(CLIB_DIR, "obj")
        super().finalize_options()

    def build_libraries(self, libraries):
        jobs = max(1, min(len(libraries), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 1)))
        if jobs == 1:
            return super().build_libraries(libraries)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(jobs) as pool:   # the compiler runs as a subprocess: threads suffice
            # the widest rows first (the longest compiles), the scalar row last
            for f in [pool.submit(super(build_clib, self).build_libraries, [lib]) for lib in reversed(libraries)]:
                f.result()


class build(_build):
    """build_ext runs build_clib itself, beside its own compile (below)."""
    sub_commands = [c for c in _build.sub_commands if c[0] != "build_clib"]


class build_ext(_build_ext):
    """The kernel rows (build_clib, unless it already ran) compile in a thread beside the extension's
    own sources, and the link waits for them: the extension's 140,000 lines of Cython C took a
    minute or more on one core after the rows, with the other core idle.  The extension is rebuilt
    whenever a kernel row's archive, a kernel source or a shared header is newer than it
    (setuptools alone tracks only the extension's own sources; a row still compiling when that is
    checked has its sources to show for it)."""

    def run(self):
        libdir = self.get_finalized_command("build_clib").build_clib   # finalized here, not in the thread
        deps = [os.path.join(libdir, "libkv_%s.a" % isa) for isa in rows]
        deps += [os.path.join("src_c", f) for f in ("kvsimd.h", "isa_rows.def", "wtypes.def")]
        deps += sorted(os.path.join("src_c", "kernels", f) for f in os.listdir(os.path.join("src_c", "kernels")))
        for e in self.extensions:
            e.depends = list(e.depends or []) + [d for d in deps if d not in (e.depends or [])]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as pool:
            self._rows = pool.submit(self.run_command, "build_clib")
            try:
                super().run()
            finally:
                self._rows.result()      # the rows' own error, if they failed

    def build_extension(self, ext):
        link = self.compiler.link_shared_object

        def link_after_the_rows(*args, **kwargs):
            self._rows.result()
            return link(*args, **kwargs)
        self.compiler.link_shared_object = link_after_the_rows
        try:
            super().build_extension(ext)
        finally:
            self.compiler.link_shared_object = link


setup(
    cmdclass={"build": build, "build_clib": build_clib, "build_ext": build_ext},
    libraries=libraries,
    ext_modules=cythonize([ext], compiler_directives=directives,
                          include_path=["kvsimd"]),
)
