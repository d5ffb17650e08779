"""What the benchmark scripts share, one module per role:

- ``cli``: how a script starts: size and name lists on the command line, the flags the
  scripts have in common, the device and the process group (NCCL on GPUs, gloo on the CPU);
- ``timing``: FLOPs and TFLOP/s, the timer (CUDA events with the L2 flushed, or the host
  ahead of the GPU; max over ranks of the per-rank medians), forward and forward+backward
  of one implementation, peak memory;
- ``checks``: correctness before timing (relative errors, also of sharded tensors);
- ``results``: where a run's JSON goes and what its meta says (device, GPU count,
  versions, git commit), the rule that a smoke run never writes into benchmarks/results,
  and text tables;
- ``plots``: the PNG beside a results file;
- ``traces``: ``--profile``: one traced call and where its GPU time went.

The scripts in benchmarks/ import it as ``from harness import timing, ...`` (their folder is
on sys.path when they run); research scripts and tools put benchmarks/ on sys.path first.
Nothing here imports ringflash; matplotlib is imported only when a plot is drawn.
"""
