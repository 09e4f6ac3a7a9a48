"""bench.py's benchmarks of the train step and of decoding on synthetic batches.

    peak      datasheet and measured peak FLOP/s, MFU (`utilization`), device peak memory
    timing    synthetic batches, the runners of our step and decoding, one timed benchmark
    sweeps    a benchmark over device counts, lengths or batch sizes, and its plot
    paired    ours against flax examples/wmt, alternately, in one process or fresh ones
    flax_wmt  google/flax examples/wmt loaded from its directory as the baseline
    report    printed records and tables, JSON files

bench.py parses the flags and passes their values in (`timing.Options`); nothing here reads them.
"""
