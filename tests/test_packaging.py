"""What a wheel of kvsimd holds: every package of the source tree is declared in pyproject.toml
(an undeclared one is missing from a regular, non-editable install while an editable install
still finds it)."""
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_packages():
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "kvsimd")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    return found


def test_every_package_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        declared = set(tomllib.load(fh)["tool"]["setuptools"]["packages"])
    found = source_packages()
    assert "kvsimd.integrations" in found
    assert declared == found, "undeclared: %s, declared but absent: %s" % (sorted(found - declared),
                                                                           sorted(declared - found))
