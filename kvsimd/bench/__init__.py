"""``python -m kvsimd.bench``: the benchmarks people run to decide whether kvsimd suits their
machine.  Every kernel figure is reported against the machine's own roofline, measured in the
same run, and beside its peers (NumPy; PyTorch and transformers when installed).

One module per concern, sharing the case lists in :mod:`kvsimd.bench.cases` with the
pytest-benchmark suites in ``bench/``:

* ``roofline`` (:mod:`.common`): read/write/copy bandwidth, 1 thread and all, DRAM and LLC;
  fp32 multiply-add peak per ISA path;
* ``attention`` / ``rope`` (:mod:`.kernels`): attend and the K-cache shift per ISA, shape,
  dtype and context, with NumPy and torch peers;
* ``decode`` (:mod:`.decode`): tokens/s against transformers and the weight-streaming floor;
  with ``--model smollm2|llama3-8b|PATH``, GGUF files as stored beside llama.cpp and transformers,
  each in its own process (:mod:`.peers`), on files :mod:`.models` builds into the model cache
  (SmolLM2 requantized to Q8_0/F16, a random Llama-3-8B-shaped Q4_0 file);
* ``complexity`` (:mod:`.complexity`): seed 003's no-cache / encoder-hoisted / cached regimes,
  the token positions counted by an observer the bench attaches (:mod:`kvsimd.observe`);
* ``streaming`` (:mod:`.streaming`) and ``quality`` (:mod:`.quality`): infinite generation
  (``quality`` reads a text: ``--text PATH``, else ``$KVSIMD_BENCH_TEXT``, else
  ``$KVSIMD_SHARED_DIR/data/hamlet_gut.txt``).

``--json`` output follows :mod:`.schema`; ``--plot`` charts come from :mod:`.plots`;
:mod:`.report` turns a JSON run into the README's Performance section.  Both load only when
used: ``import kvsimd`` and ``import kvsimd.bench`` import neither, nor matplotlib.  ``bench/ab_compare.py`` in the source
checkout times two trees against each other (decode and attention, interleaved rounds)."""
