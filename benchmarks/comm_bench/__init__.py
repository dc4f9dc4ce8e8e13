"""The communication benchmark's sections (``benchmarks/bench_comm.py`` is the entry point): ``bytes``,
``tokens``, ``graph``, ``tune``, ``moe``, each a module with one ``<section>_rows(run)`` function, and
``common`` (settings, the run, the layouts) and ``table`` (what is printed last)."""
