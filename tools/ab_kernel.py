"""A/B timing of ``flash_attn`` on one GPU: forward and forward+backward of nine
configurations (bf16, 16k tokens, 32 heads: full, causal, GQA 32/8, head_dim 64 and 256,
dropout, packed documents, a block mask of density 0.25, a 4k window), ms, the median of
triton.testing.do_bench. One JSON line per configuration, tagged, for two trees timed
alternately on the same GPU (the other tree installed with ``pip install --no-deps
--target SITE``):

    python tools/ab_kernel.py new-1; PYTHONPATH=SITE python tools/ab_kernel.py old-1; ...

It times whichever ringflash Python imports (the line says which file).
"""

import argparse
import json

import torch
import triton

import ringflash
from ringflash.kernels import block_sparse, flash_attn

SEQLEN, HEADS, HEAD_DIM = 16384, 32, 128
CONFIGS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal-gqa8": dict(causal=True, kv_heads=8),
    "causal-d64": dict(causal=True, head_dim=64),
    "causal-d256": dict(causal=True, head_dim=256),
    "causal-dropout": dict(causal=True, dropout_p=0.1, seed=3),
    "causal-docs": dict(causal=True, documents=True),
    "sparse-0.25": dict(density=0.25),
    "causal-window4k": dict(causal=True, window_size=(4096, 0)),
}


def documents(seqlen: int) -> torch.Tensor:
    """(1, seqlen) segment ids of log-normal document lengths (median about 2k)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.exp(torch.randn(64, generator=g) * 0.8 + 7.6).long().clamp(min=16)
    ids = torch.repeat_interleave(torch.arange(64), lengths)[:seqlen]
    ids = torch.cat([ids, torch.full((seqlen - ids.numel(),), 63)])
    return ids[None].to(torch.int32).cuda()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tag", help="the label of this run's lines (e.g. new-1)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg)
        d, kv = cfg.pop("head_dim", HEAD_DIM), cfg.pop("kv_heads", HEADS)
        if cfg.pop("documents", False):
            cfg["segment_ids"] = documents(SEQLEN)
        if (density := cfg.pop("density", None)) is not None:
            cfg["block_mask"] = block_sparse.random_block_mask(SEQLEN, density, heads=HEADS, seed=5, device="cuda")
        q = torch.randn(1, SEQLEN, HEADS, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, SEQLEN, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        dout = torch.randn_like(q)
        with torch.no_grad():
            fwd = triton.testing.do_bench(lambda: flash_attn(q, k, v, **cfg), warmup=50, rep=300)

        def step():
            flash_attn(q, k, v, **cfg).backward(dout)
        fwdbwd = triton.testing.do_bench(step, warmup=50, rep=300, grad_to_none=[q, k, v])
        print(json.dumps(dict(tag=args.tag, config=name, fwd_ms=round(fwd, 4), fwdbwd_ms=round(fwdbwd, 4),
                              device=torch.cuda.get_device_name(), lib=ringflash.__file__)), flush=True)


if __name__ == "__main__":
    main()
