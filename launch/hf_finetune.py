"""Fine-tune a Hugging Face Llama with ring attention under torchrun (``pip install ringflash[hf]``).

    torchrun --nproc-per-node=2 launch/hf_finetune.py                     # CPU, gloo, < 1 minute
    torchrun --nproc-per-node=4 launch/hf_finetune.py --seqlen 65536 \\
        --hidden 1024 --layers 4 --heads 16 --kv-heads 4 --batch-size 1 --lr 1e-3   # 4 GPUs, bf16
    torchrun --nproc-per-node=4 launch/hf_finetune.py --sp-size 2         # 2 replicas x rings of 2
    python launch/hf_finetune.py --reference                              # unsharded, one process

A ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (random init: nothing is
downloaded) learns to copy: every sequence is a random first half followed by the same
tokens again, and only the second half is scored, so its loss falls below the chance level
ln(vocab) only through attention half a sequence back, mostly into other ranks' shards.

What sequence parallelism takes, with ringflash.hf:
- ``ringflash.hf.register()`` once, and ``attn_implementation="ring_attn"``;
- ``sp = ringflash.SequenceParallel((mesh, "sp"))``: the ring of ranks holding one set of
  sequences, and the layout they are split by ("auto": zigzag for these unpacked
  sequences; batches whose position_ids pack documents would get the layout computed from
  them);
- every step, ``model(**ringflash.hf.prepare_batch(sp, ids, labels=ids, num_items_in_batch=N))``
  with N the labelled tokens of the WHOLE global batch: each rank's loss is its own token
  losses over N, so the SUM over all ranks of losses and of gradients is the unsharded
  model's (``all_reduce_gradients`` over every rank, dp x sp, with no division);
- the same initial parameters everywhere (the same seed).

The data are a pure function of (--seed, step), so ``--reference`` trains the same model
with transformers' own attention on whole sequences in one process, and its losses and
parameters equal the ring's up to rounding (tests/test_hf.py checks it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ringflash
import ringflash.hf

IGNORE = -100


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlen", type=int, default=256, help="GLOBAL tokens per sequence")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step, all replicas")
    p.add_argument("--sp-size", type=int, default=0, help="ranks per ring; 0: the whole world")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="autocast dtype; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--reference", action="store_true",
                   help="train the unsharded model with transformers' sdpa attention instead")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--metrics-out", default=None, help="write losses and timing as JSON (rank 0)")
    return p.parse_args(argv)


def build_model(args, attn_implementation: str, device):
    """A random-init Llama drawn from --seed: the same parameters on every rank."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=max(args.seqlen, 128), tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(device)


def copy_batch(args, step: int):
    """(input_ids, labels) (batch, seqlen): a random half, then the same half again; only
    the second half is scored."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    half = torch.randint(0, args.vocab, (args.batch_size, args.seqlen // 2), generator=g)
    ids = torch.cat([half, half], dim=1)
    labels = ids.clone()
    labels[:, : args.seqlen // 2 + 1] = IGNORE  # the copy starts predictable one token in
    return ids, labels


def train(args) -> dict:
    """Train for --steps; returns the per-step global losses and the final parameters.
    Runs in a torchrun world (or any initialized process group), or alone."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    world = dist.get_world_size() if dist.is_initialized() and not args.reference else 1
    sp_size = args.sp_size or world
    if world % sp_size or args.batch_size % (world // sp_size):
        raise ValueError(f"--sp-size {sp_size} must divide the world {world}, and the number of "
                         f"replicas {world // sp_size} the batch size {args.batch_size}")
    dp_size = world // sp_size
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
        sp, dp_rank = ringflash.SequenceParallel((mesh, "sp")), mesh.get_local_rank("dp")
    else:
        sp, dp_rank = ringflash.SequenceParallel(), 0

    model = build_model(args, "sdpa" if args.reference else ringflash.hf.register(), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    rows = args.batch_size // dp_size
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels = copy_batch(args, step)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if args.reference:
                loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
            else:
                mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
                batch = ringflash.hf.prepare_batch(
                    sp, ids[mine], labels=labels[mine], device=device,
                    num_items_in_batch=(labels[:, 1:] != IGNORE).sum())  # the GLOBAL batch's
                loss = model(**batch).loss
        loss.backward()
        if world > 1:
            ringflash.all_reduce_gradients(model.parameters())  # SUM over dp x sp
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # the global loss, for the log
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step % args.log_every == 0 or step == args.steps) and (not dist.is_initialized()
                                                                   or dist.get_rank() == 0):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  (chance {math.log(args.vocab):.2f})",
                  flush=True)
    seconds = time.perf_counter() - start
    return {"losses": losses, "seconds": seconds, "world": world, "sp_size": sp_size,
            "tokens_per_s": args.steps * args.batch_size * args.seqlen / seconds,
            "params": {k: v.detach().float().cpu() for k, v in model.state_dict().items()}}


def main(argv=None) -> None:
    args = parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and args.reference and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit("--reference trains the unsharded model in one process: run it with "
                         "python, not under torchrun (every rank would train its own copy)")
    if under_torchrun and not args.reference:
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        kwargs = {"timeout": timedelta(minutes=10)}
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    try:
        result = train(args)
        if args.metrics_out and (not dist.is_initialized() or dist.get_rank() == 0):
            metrics = {k: v for k, v in result.items() if k != "params"}
            with open(args.metrics_out, "w") as f:
                json.dump({**metrics, "args": vars(args)}, f, indent=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
