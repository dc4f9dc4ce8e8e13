"""The tools built on the library: the demo and its random-weight layer stack, the MoE benchmark, the sweep,
its plots and the timeline tracer. They import the library; the library never imports them.

    demo       ``python -m moe_wave demo``: a V4 layer stack over EP ranks, serial vs overlapped (``stack``)
    bench      one benchmark point of a WaveMoE: serial, pipelined, comm-only, compute-only
    sweep      ``python -m moe_wave sweep``: a grid of benchmark points to CSV, JSON and markdown
    sweep_csv  the sweep's CSV: durable appends, checked rows, resume after a crash
    sweep_report  the sweep's JSON sidecar, markdown summary and printed table; the benchmarks' run metadata
    plots      PNGs from a sweep's rows
    trace      one chrome trace per rank (torch.profiler) of chosen iterations
    flags      the command-line parser, value types and flags that demo and sweep share
"""
