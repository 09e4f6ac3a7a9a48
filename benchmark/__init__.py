"""bench.py's benchmarks of the train step and of decoding on synthetic batches.

    options      what to time, as bench.py's flags say, and the combinations refused
    timing       one benchmark: its config checked, its runner built and timed, its record
    records      timing of a runner's calls, the record fields, the profiler trace
    decoding     fixed-length decoding runners: ours, flax's, CTranslate2's
    peak         datasheet and measured peak FLOP/s, MFU (`utilization`), device peak memory
    sweeps       a benchmark over device counts, lengths or batch sizes, and its plot
    paired       ours against its peers, alternately, in one process (or, flax's, fresh ones)
    flax_wmt     google/flax examples/wmt loaded from its directory as the baseline
    ctranslate2  CTranslate2 decoding our model's own weights, at one or more compute types
    report       printed records and tables, JSON files

bench.py parses the flags and passes their values in (`options.Options`); nothing here reads them.
"""
