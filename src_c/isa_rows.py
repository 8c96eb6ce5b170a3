"""Reader of src_c/isa_rows.def, the one table of ISA rows, for setup.py and the tests
(CMakeLists.txt reads the same lines with the same pattern)."""
import os
import re

DEF_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isa_rows.def")
ROW_RE = re.compile(r'^KV_ISA_ROW\((\w+), (\w+), ([\w| ]+), "([^"]*)"\)$')


def read_rows(path=DEF_PATH):
    """[(name, [flags])] in table order."""
    rows = []
    with open(path) as fh:
        for line in fh:
            if line.startswith("KV_ISA_ROW("):
                m = ROW_RE.match(line.strip())
                if not m:
                    raise ValueError("%s: malformed row %r" % (path, line))
                rows.append((m.group(2), m.group(4).split()))
    return rows
