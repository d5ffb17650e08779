"""The ring's backward steps replayed on one Hopper GPU: what the last, partly filled wave
of each step's Gluon backward launch costs, and what running consecutive steps' launches on
two streams (so that one step's CTAs fill the SMs the step before leaves idle) or writing a
remote step's partial dK/dV instead of zeroing and adding into it would give back
(docs/notes/gluon-backward.md, "The steps' last waves"):

    python benchmarks/research/step_tails.py [--world 4] [--seqlen 131072] [--kv-heads 32 8]

bf16, batch 1, 32 heads, head_dim 128, no mask. One rank's backward of the fused rotation
(ringflash/ring/rotate.py) without the transfers: the own step's first half of key rows,
W - 1 remote steps over the whole shard (the first writing its fp32 dK/dV sums, the others
into a zeroed buffer then added into the running sums), the own step's second half; dQ is
TMA-reduce-added into one fp32 sum throughout. Variants: ``one stream`` (as the ring runs),
``written`` (the later remote steps write their partial sums: no zeroing), ``two streams``
(the launches alternate between two streams, each add waiting for its launch), and
``one launch`` (all W shards' keys in one launch: no tail but the last). Prints one JSON
line per configuration: the median milliseconds of each variant over ``--reps`` runs, each
launch alone, and the waves of each launch (CTAs / SMs).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ringflash.kernels.gluon import attn_bwd_sm90

HEADS, DIM = 32, 128


def timed(run, reps: int) -> float:
    """Median ms of ``run()`` over ``reps`` runs after two warm-ups (CUDA events)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def one(world: int, seqlen: int, kv_heads: int, reps: int) -> dict:
    n = seqlen // world
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(rows, heads):
        return torch.randn(1, rows, heads, DIM, generator=gen, device="cuda").to(torch.bfloat16)

    q, dout = randn(n, HEADS), randn(n, HEADS)
    kvs = [(randn(n, kv_heads), randn(n, kv_heads)) for _ in range(world)]
    lse = torch.randn(1, HEADS, n, device="cuda").abs() + 8.0
    delta = torch.randn(1, HEADS, n, device="cuda")
    dq = torch.zeros(q.shape, device="cuda")
    sums = [torch.zeros((2, 1, n, kv_heads, DIM), device="cuda") for _ in range(3)]
    fresh = [torch.zeros((2, 1, n, kv_heads, DIM), device="cuda") for _ in range(2)]
    half = n // 2
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def launch(kv, dest, rows=slice(None), accumulate=True):
        attn_bwd_sm90(dout, q, kv[0][:, rows], kv[1][:, rows], lse, delta, dq, dest[0][:, rows], dest[1][:, rows],
                      DIM ** -0.5, accumulate=accumulate)

    def steps():
        """(kv, dest, rows, accumulate, add_into) of each launch, in the ring's order."""
        out = [(kvs[0], sums[2], slice(0, half), False, None), (kvs[1], sums[0], slice(None), False, None)]
        out += [(kvs[s], fresh[s % 2], slice(None), True, sums[s % 2]) for s in range(2, world)]
        return out + [(kvs[0], sums[2], slice(half, n), False, None)]

    def ring(written=False):
        for kv, dest, rows, acc, add_into in steps():
            if add_into is not None and not written:
                dest.zero_()
            launch(kv, dest, rows, acc and not written)
            if add_into is not None:
                add_into.add_(dest)

    def ring_two():
        """The launches alternate between two streams; a launch waits for the add that last
        read its buffer (two steps before), an add for its launch and the one before (whose
        running sum it adds into, as the trip of that sum would)."""
        main, launched, added = torch.cuda.current_stream(), [], [None, None]
        for stream in streams:
            stream.wait_stream(main)
        for i, (kv, dest, rows, acc, add_into) in enumerate(steps()):
            stream = streams[i % 2]
            if added[i % 2] is not None:
                stream.wait_event(added[i % 2])
            with torch.cuda.stream(stream):
                launch(kv, dest, rows, False if add_into is not None else acc)
                launched.append(torch.cuda.Event())
                launched[-1].record(stream)
            if add_into is not None:
                for event in launched[-2:]:
                    main.wait_event(event)
                add_into.add_(dest)
                added[i % 2] = torch.cuda.Event()
                added[i % 2].record(main)
        for event in launched:
            main.wait_event(event)

    k_all = torch.cat([kv[0] for kv in kvs], 1), torch.cat([kv[1] for kv in kvs], 1)
    d_all = torch.zeros((2, 1, seqlen, kv_heads, DIM), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ms = {"one stream": timed(ring, reps), "written": timed(lambda: ring(written=True), reps),
          "two streams": timed(ring_two, reps),
          "one launch": timed(lambda: launch(k_all, d_all, accumulate=False), reps),
          "remote step alone": timed(lambda: launch(kvs[1], sums[0], accumulate=False), reps),
          "own half alone": timed(lambda: launch(kvs[0], sums[2], slice(0, half), False), reps),
          "zero + add": timed(lambda: (fresh[0].zero_(), sums[0].add_(fresh[0])), reps)}
    flops = 2.5 * 4 * HEADS * n * seqlen * DIM
    return dict(world=world, seqlen=seqlen, local=n, heads=HEADS, kv_heads=kv_heads, sms=sms,
                waves={"remote step": n // 128 * kv_heads / sms, "own half": half // 128 * kv_heads / sms},
                ms={k: round(v, 3) for k, v in ms.items()},
                bwd_tflops={k: round(flops / ms[k] / 1e9, 1) for k in ("one stream", "written", "two streams",
                                                                       "one launch")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[4])
    p.add_argument("--seqlen", type=int, nargs="+", default=[131072])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for world in args.world:
        for seqlen in args.seqlen:
            for kv_heads in args.kv_heads:
                print(json.dumps(one(world, seqlen, kv_heads, args.reps)), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
