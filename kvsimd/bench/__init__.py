"""``python -m kvsimd.bench``: microbenchmarks of kvsimd's kernels against the machine's own
memory roofline (measured in the same run).  Standard library + NumPy only.

Subcommands: ``roofline``, ``attention``, ``rope``.  See ``python -m kvsimd.bench --help``."""
