"""Run the machine code of kvsimd's own extension module inside an emulated CPU.

This machine has no AVX-512, so the avx512fp16 row cannot run natively.  The PyPI package
``bochscpu-python==0.4.0`` (the Bochs 3.0 CPU core, MIT/LGPL) emulates a Sapphire Rapids CPU
instruction by instruction.  :class:`Guest` maps the *installed* ``kvsimd._kvsimd`` shared
object into guest memory (its PT_LOAD segments, with R_X86_64_RELATIVE relocations applied),
so the very bytes the dispatch table points at are executed -- not a rebuild of the source.
Anything the kernels must not do (call libc through the PLT, touch unmapped memory, use an
instruction the CPU model lacks) surfaces as a guest fault and an :class:`EmuError`.

Two workarounds, both checked at run time:
* the 0.4.0 wheel needs glibc 2.38's ``__isoc23_strtoull``/``__isoc23_sscanf``; on older
  glibc (Debian 12 has 2.36) a two-function shim is compiled with the system C compiler and
  loaded RTLD_GLOBAL before ``import bochscpu``;
* the wheel's API cannot choose a CPU model (its default is a Cannon Lake without FP16): the
  Bochs parameter ``cpu.model`` is set through symbols the .so exports, before the session
  exists.  Bochs allows one session per process: other models run in a child process.
"""
from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time

PAGE = 0x1000
HALT = 0x00300000          # a page of HLT: the return address of every call
IMAGE_BASE = 0x10000000    # where the extension module is mapped
ARENA_BASE = 0x40000000    # data
STACK_TOP = 0x7FF00000
PAGE_TABLES = 0x01000000   # page tables: one 1 MiB range per commit
PAGE_TABLES_STRIDE = 0x00100000
PAGE_TABLES_END = IMAGE_BASE
OBJECT_BASE = 0x20000000   # further objects (Guest.load_object), 16 MiB apart
OBJECT_STRIDE = 0x01000000

# Bochs 3.0 cpudb order (as bundled in bochscpu-python 0.4.0; the list is in
# ../shared/tools/avx512fp16-emu/bochs_runner.py, CPU_MODELS): indices of the models we use.
# corei7_skylake_x: AVX-512 F/CD/BW/DQ/VL without VNNI; tigerlake: + VNNI, no FP16;
# sapphire_rapids: + AVX512-FP16.
CPU_MODEL_INDEX = {"corei7_skylake_x": 26, "tigerlake": 29, "sapphire_rapids": 30}

XCR0_ZMM = 0xE7   # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
XCR0_YMM = 0x07   # an OS that saves no AVX-512 state

_SHIM_SRC = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
/* glibc 2.38 added C23 variants that also accept 0b literals; the emulator never passes any */
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsscanf(s, fmt, ap);
    va_end(ap);
    return n;
}
"""


class EmuError(RuntimeError):
    """A guest fault, a runaway loop, or an emulator that cannot be set up."""


def _load_glibc_shim():
    try:
        ctypes.CDLL(None).__isoc23_strtoull  # noqa: B018  (glibc >= 2.38: nothing to do)
        return None
    except AttributeError:
        pass
    cache = os.path.join(tempfile.gettempdir(), "kvsimd-emu-%d" % os.getuid())
    os.makedirs(cache, exist_ok=True)
    src, lib = os.path.join(cache, "c23_shim.c"), os.path.join(cache, "libc23_shim.so")
    if not os.path.exists(lib):
        with open(src, "w") as fh:
            fh.write(_SHIM_SRC)
        tmp = lib + ".%d" % os.getpid()
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", src, "-o", tmp], check=True)
        os.replace(tmp, lib)
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return lib


def import_bochscpu():
    """Import bochscpu (with the glibc shim where needed); raises ImportError with the reason."""
    _load_glibc_shim()
    import bochscpu  # noqa: F401
    import bochscpu.memory  # noqa: F401
    return bochscpu


def _select_cpu_model(bochscpu, name):
    lib = ctypes.CDLL(bochscpu._bochscpu.__file__)
    lib.sim_get_param_enum.restype = ctypes.c_void_p
    lib.sim_get_param_enum.argtypes = [ctypes.c_char_p]
    set_range = lib._ZN14bx_param_num_c9set_rangeEmm
    set_range.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    enum_set = lib._ZN15bx_param_enum_c3setEl
    enum_set.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    num_get = lib._ZN14bx_param_num_c3getEv
    num_get.restype = ctypes.c_int64
    num_get.argtypes = [ctypes.c_void_p]
    param = lib.sim_get_param_enum(b"cpu.model")
    if not param:
        raise EmuError("bochscpu: no cpu.model parameter")
    idx = CPU_MODEL_INDEX[name]
    set_range(param, 0, max(CPU_MODEL_INDEX.values()) + 1)
    enum_set(param, idx)
    if num_get(param) != idx:
        raise EmuError("bochscpu: could not select CPU model %s" % name)


def _host_load_base(path):
    """Address at which the dynamic loader mapped ``path`` in this process."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and os.path.realpath(parts[5]) == real and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise EmuError("%s is not mapped in this process" % path)


class Guest:
    """One emulated CPU with the extension module mapped at IMAGE_BASE, a data arena and a stack."""

    _made = False

    def __init__(self, so_path, model="sapphire_rapids", arena_size=48 << 20, stack_size=1 << 20):
        if Guest._made:
            raise EmuError("bochscpu allows one emulated CPU per process: use a child process")
        bochscpu = import_bochscpu()
        _select_cpu_model(bochscpu, model)
        self.bochscpu = bochscpu
        self.model = model
        self.sess = bochscpu.Session()
        Guest._made = True
        self.sess.missing_page_handler = self._missing_page
        self.host_base = _host_load_base(so_path)
        self._pages = {}
        self._tables = []
        self.arena_size = arena_size
        self._bump = 0
        self._next_object = OBJECT_BASE
        self._map([(HALT, PAGE), (ARENA_BASE, arena_size), (STACK_TOP - stack_size, stack_size)])
        self._load_elf(so_path, IMAGE_BASE)
        self.write(HALT, b"\xf4" * 16)
        self.last_exception = None

    def _load_elf(self, path, base):
        """Map the PT_LOAD segments of the shared object ``path`` at guest address ``base``, apply
        the relocations that stay inside it, and return its defined functions {name: guest address}."""
        from elftools.elf.elffile import ELFFile
        from elftools.elf.relocation import RelocationSection
        from elftools.elf.sections import SymbolTableSection

        with open(path, "rb") as fh:
            elf = ELFFile(fh)
            segments = [(s["p_vaddr"], s["p_memsz"], s["p_offset"], s["p_filesz"])
                        for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            # Relocations that stay inside the module: RELATIVE, and 64-bit/GOT slots whose
            # symbol the module itself defines.  Everything else (libc, libpython) is left
            # unresolved on purpose: a kernel that used it would fault.
            relative, funcs = [], {}
            for sec in elf.iter_sections():
                if isinstance(sec, SymbolTableSection):
                    for sym in sec.iter_symbols():
                        if sym["st_info"]["type"] == "STT_FUNC" and sym["st_shndx"] != "SHN_UNDEF":
                            funcs[sym.name] = base + sym["st_value"]
                if not isinstance(sec, RelocationSection):
                    continue
                symtab = elf.get_section(sec["sh_link"]) if sec["sh_link"] else None
                for r in sec.iter_relocations():
                    kind = r["r_info_type"]
                    if kind == 8:  # R_X86_64_RELATIVE
                        relative.append((r["r_offset"], r["r_addend"]))
                    elif kind in (1, 6) and symtab is not None:  # R_X86_64_64, R_X86_64_GLOB_DAT
                        sym = symtab.get_symbol(r["r_info_sym"])
                        if sym["st_shndx"] != "SHN_UNDEF" and sym["st_value"]:
                            relative.append((r["r_offset"], sym["st_value"] + (r["r_addend"] if kind == 1 else 0)))
            fh.seek(0)
            blob = fh.read()
        regions = []
        for vaddr, memsz, _, _ in segments:
            lo = (base + vaddr) & ~(PAGE - 1)
            hi = (base + vaddr + memsz + PAGE - 1) & ~(PAGE - 1)
            regions.append((lo, hi - lo))
        self._map(regions)
        for vaddr, _, off, filesz in segments:
            self.write(base + vaddr, blob[off:off + filesz])
        for r_offset, addend in relative:
            self.write(base + r_offset, struct.pack("<Q", base + addend))
        return funcs

    def load_object(self, path):
        """Map another freestanding shared object (e.g. a test probe) into the guest, each at its
        own base (Bochs caches decoded code: addresses are never reused); returns
        {function name: guest address}."""
        base, self._next_object = self._next_object, self._next_object + OBJECT_STRIDE
        if base >= ARENA_BASE:
            raise EmuError("no room for another object")
        return self._load_elf(path, base)

    # ---------------------------------------------------------------- memory
    def _map(self, regions):
        """Back ``regions`` with host pages and commit a page table of every page mapped so far
        (guest virtual == guest physical).  Each commit goes to its own physical range and every
        table object is kept: a table's destructor unmaps its pages."""
        bmem = self.bochscpu.memory
        for base, size in regions:
            for va in range(base, base + size, PAGE):
                if va not in self._pages:
                    hva = bmem.allocate_host_page()
                    self._pages[va] = hva
                    bmem.page_insert(va, hva)
        pt = bmem.PageMapLevel4Table()
        for va in self._pages:
            pt.insert(va, va, 1)        # present, writable
        self.cr3 = PAGE_TABLES + PAGE_TABLES_STRIDE * len(self._tables)
        if self.cr3 + PAGE_TABLES_STRIDE > PAGE_TABLES_END:
            raise EmuError("too many page-table commits")
        tables = pt.commit(self.cr3)
        if len(tables) * PAGE > PAGE_TABLES_STRIDE:
            raise EmuError("page tables overflow their range")
        for hva, gpa in tables:
            bmem.page_insert(gpa, hva)
        self._tables.append(pt)

    def _missing_page(self, gpa):
        raise EmuError("guest touched unmapped address %#x" % gpa)

    def _spans(self, addr, n):
        while n > 0:
            page = addr & ~(PAGE - 1)
            k = min(n, page + PAGE - addr)
            if page not in self._pages:
                raise EmuError("address %#x is not mapped" % addr)
            yield self._pages[page] + (addr - page), k
            addr += k
            n -= k

    def write(self, addr, data):
        data = bytes(data)
        pos = 0
        for hva, k in self._spans(addr, len(data)):
            ctypes.memmove(hva, data[pos:pos + k], k)
            pos += k

    def read(self, addr, n):
        return b"".join(ctypes.string_at(hva, k) for hva, k in self._spans(addr, n))

    def reset_arena(self):
        self._bump = 0

    def alloc(self, nbytes, align=64, offset=0):
        """Bump-allocate arena memory; ``offset`` misaligns the result on purpose."""
        start = (self._bump + align - 1) // align * align + offset
        if start + nbytes > self.arena_size:
            raise EmuError("arena exhausted (%d bytes)" % self.arena_size)
        self._bump = start + nbytes
        return ARENA_BASE + start

    def put(self, data, align=64, offset=0, guard=0):
        """Copy bytes (or an array) into the arena, followed by ``guard`` bytes of 0xA5."""
        data = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
        addr = self.alloc(len(data) + guard, align, offset)
        self.write(addr, data + b"\xa5" * guard)
        return addr

    def guest_address(self, host_fn):
        """Where a function of the extension (a host address in this process) lives in the guest."""
        return IMAGE_BASE + (host_fn - self.host_base)

    # ---------------------------------------------------------------- calls
    def _state(self, rip, args, xcr0):
        b = self.bochscpu
        st = b.State()
        st.cr0 = 0x80050033          # PE MP ET NE WP PG
        st.cr4 = 0x00040620          # PAE OSFXSR OSXMMEXCPT OSXSAVE
        st.efer = 0x00000D01         # SCE LME LMA NXE
        st.xcr0 = xcr0
        st.cr3 = self.cr3
        st.mxcsr = 0x1F80
        st.fpcw = 0x37F
        st.rflags = 0x2
        cs = b.Segment()
        cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x10, 0, 0xFFFFFFFF, 0xA09B
        ds = b.Segment()
        ds.present, ds.selector, ds.base, ds.limit, ds.attr = True, 0x18, 0, 0xFFFFFFFF, 0xC093
        st.cs = cs
        st.ds = st.es = st.ss = st.fs = st.gs = ds
        rsp = ((STACK_TOP - 256) & ~0xF) - 8          # SysV: rsp + 8 is 16-byte aligned at entry
        self.write(rsp, struct.pack("<Q", HALT))
        st.rsp, st.rip = rsp, rip
        if len(args) > 6:
            raise ValueError("only register arguments")
        for reg, val in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args):
            setattr(st, reg, int(val) & 0xFFFFFFFFFFFFFFFF)
        return st

    def call(self, fn, *args, xcr0=XCR0_ZMM, branch_limit=50_000_000, count_instructions=False):
        """Run ``fn(*args)`` (integer/pointer arguments) to its return; returns rax.  With
        ``count_instructions`` (slow: a Python hook per instruction) the number of guest
        instructions executed is left in ``self.last_instructions``."""
        b = self.bochscpu
        self.sess.cpu.state = self._state(fn, args, xcr0)
        done = {"halt": False, "limit": False, "exc": None, "branches": 0}

        def on_hlt(sess, cpu_id):
            done["halt"] = True
            sess.stop()

        def on_exception(sess, cpu_id, vector, error_code):
            done["exc"] = (vector, error_code)
            sess.stop()

        def on_branch(sess, cpu_id, rip, target):
            done["branches"] += 1
            if done["branches"] > branch_limit:
                done["limit"] = True
                sess.stop()

        hook = b.Hook()
        hook.hlt = on_hlt
        hook.exception = on_exception
        hook.cnear_branch_taken = on_branch
        self.last_instructions = None
        if count_instructions:
            executed = [0]

            def on_insn(*_):
                executed[0] += 1

            hook.before_execution = on_insn
        t0 = time.perf_counter()
        self.sess.run([hook])
        self.last_seconds = time.perf_counter() - t0
        if count_instructions:
            self.last_instructions = executed[0]
        st = self.sess.cpu.state
        if done["exc"] is not None:
            vec, err = done["exc"]
            names = {6: "#UD invalid opcode", 13: "#GP", 14: "#PF page fault"}
            raise EmuError("guest exception %d (%s), error %#x, rip after fault %#x"
                           % (vec, names.get(vec, "?"), err, st.rip))
        if done["limit"]:
            raise EmuError("more than %d taken branches: runaway loop at %#x" % (branch_limit, st.rip))
        if not done["halt"] or not HALT <= st.rip <= HALT + 16:
            raise EmuError("stopped at unexpected rip %#x" % st.rip)
        return st.rax


_shared_guest = None


def shared_guest(so_path):
    """The process's one sapphire_rapids Guest over ``so_path`` (created on first use), for every
    test module: pytest.skip with the reason when the emulator cannot be set up, or pytest.fail
    when ``KVSIMD_REQUIRE_EMULATOR=1`` (CI)."""
    global _shared_guest
    import pytest

    if _shared_guest is None:
        try:
            import_bochscpu()
            import elftools  # noqa: F401
        except Exception as e:  # ImportError, or the shim failing to build
            msg = "emulator unavailable (pip install 'bochscpu-python==0.4.0' pyelftools): %s" % e
            if os.environ.get("KVSIMD_REQUIRE_EMULATOR") == "1":
                pytest.fail(msg)
            pytest.skip(msg)
        # room for the largest kernel cases: K and V of [32, 4099, 128] float32, 67 MB each
        _shared_guest = Guest(so_path, arena_size=160 << 20)
    return _shared_guest


def pack_struct(layout, values):
    """Bytes of a C struct from its layout as C reports it (``_kernel_addresses()["structs"][name]``:
    offsets, sizes and struct letters from offsetof/sizeof) and (field name -> value); fields not
    given are zero.  An unknown field name is a KeyError."""
    buf = bytearray(layout["size"])
    for name, val in values.items():
        offset, size, code = layout["fields"][name]
        assert struct.calcsize("<" + code) == size, (name, code, size)
        struct.pack_into("<" + code, buf, offset, val)
    return bytes(buf)


def child_main():
    """``python tests/emulator.py MODEL SO_PATH``: detection, and one conversion kernel of every
    vector row, on another CPU model, printed as ``key=value`` lines (run in a child process: one
    emulated CPU per process): ``features_zmm`` / ``select_zmm`` (and ``_ymm``: an OS that saves
    no ZMM state), ``kernel_<row>=ran`` or the guest fault."""
    model, so_path = sys.argv[1], sys.argv[2]
    # the package that holds SO_PATH, whether installed or built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(so_path))))
    import kvsimd._kvsimd as ext
    info = ext._kernel_addresses()
    g = Guest(so_path, model=model, arena_size=1 << 20)
    for name, xcr0 in (("zmm", XCR0_ZMM), ("ymm", XCR0_YMM)):
        feats = g.call(g.guest_address(info["kv_cpu_features"]), xcr0=xcr0)
        print("features_%s=%d" % (name, feats))
        print("select_%s=%d" % (name, g.call(g.guest_address(info["kv_select_isa"]), feats, xcr0=xcr0)))
    for row in info["rows"]:
        if row == "scalar":
            continue
        try:
            g.call(g.guest_address(info["rows"][row]["f16_to_f32"]), g.alloc(64), g.alloc(64), 16)
            print("kernel_%s=ran" % row)
        except EmuError as e:
            print("kernel_%s=%s" % (row, e))


if __name__ == "__main__":
    child_main()
