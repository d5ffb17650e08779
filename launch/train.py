"""Long-context language-model training with ring attention; a torchrun entry point.

    torchrun --nproc-per-node=2 launch/train.py                      # CPU, gloo, < 3 minutes
    torchrun --nproc-per-node=4 launch/train.py --seqlen 131072 \\
        --d-model 1024 --layers 4 --heads 16 --kv-heads 4 --batch-size 1 --steps 30   # 4 GPUs
    torchrun --nproc-per-node=4 launch/train.py --curriculum 16x8k:500,4x32k:150,1x128k:400 ...

A small decoder-only transformer (RMSNorm, RingSelfAttention with rotary embeddings
and GQA, GELU MLP, tied embeddings) learns a synthetic key-value recall task generated
on the fly, so nothing is downloaded:

    noise [k0=v] noise [k1=v'] ... [k0=v] noise ... | noise Q(k1) noise ... Q(k0) noise
    <---------------- first half: the facts ------> <--- second half: the queries --->
                                                           ^ label v'      ^ label v

Packed documents: every sequence holds ``--documents`` independent instances of the task
(2 by default), each ``seqlen / documents`` tokens, one after the other, with segment ids
that stop attention at their boundaries (``ring_flash_attn(segment_ids=...)``). The
documents bind the same keys to different values, so a model that attended across a
boundary would be told two answers; the loss never crosses one either (labels are per
document). ``--documents 1`` is one document per sequence.

Every document binds each of ``--num-keys`` keys to one of ``--values-per-key`` values.
A binding is one "fact" token (key k's values are tokens of their own), written
``--fact-copies`` times at random places of the FIRST half. The second half holds
``--queries`` query tokens Q(k) among the noise; the label at a query is the value of k,
and only queries are scored. Answers never appear in the sequence, so every query must
retrieve a fact from the first half, on average half the sequence back (and, once
sharded by zigzag, mostly from another rank): the loss falls below the chance level
ln(values-per-key) only through long-range attention. Accuracy is reported beside it.
``--facts-end`` and ``--queries-start`` move the two regions (fractions of a document,
0.5 both by default): with 0.25 and 0.75 the facts fill the first quarter, the queries
the last, and every answer sits more than half a document before its query.

Length curriculum: ``--curriculum 16x8k:500,4x32k:150,1x128k:400`` trains 500 steps of
16 sequences of 8192 tokens, then 150 of 4 x 32768, then 400 of 1 x 131072, under one
learning-rate schedule; the last stage is the final length (it replaces --seqlen,
--batch-size and --steps). ``--queries`` and ``--fact-copies`` are the counts at the
final length; a shorter stage scales them with its length, so facts and queries are
as dense at every length. ``--eval-steps`` then scores batches of the final length that
no step trained on, and ``--time-budget-s`` ends training early (the evaluation still
runs at the final length) when the job has a wall-clock limit.

Sequence parallelism: the global batch of ``--batch-size`` sequences of ``--seqlen``
tokens is split over dp = world / sp replicas; the sp ranks of a replica each hold
seqlen / sp tokens of every sequence and run the ring over their group. Which tokens is
``--layout``: by default (auto) the layout computed from the documents a sequence packs
(``ringflash.document_layout``: each document whole on one rank where the balance
allows, the ring moving only those that cross ranks; one per --curriculum length),
zigzag for ``--documents 1``; or a named layout at every length. One
``ringflash.SequenceParallel`` per length carries the layout to both the data
(``sp.shard``) and the attention (the layers' ``layout=`` per call), so the two never
differ. Each rank's loss is its own token-loss sum divided by the
number of scored tokens in the WHOLE global batch; the gradients are then SUMMED over
all ranks, which gives every rank the exact gradient of the global mean (see
ringflash/layer.py). Results equal single-process training on full sequences up to
fp32 rounding (tests/test_train.py checks it).

Data are a pure function of (--seed, step, sequence index), so ``--resume`` repeats the
uninterrupted run, even at a different world size. Checkpoints are written by rank 0,
atomically (temporary file, fsync, rename); ``--ckpt-dir`` must be visible to every
rank on resume (a shared file system across nodes). ``--resume`` takes the newest
checkpoint that loads: rank 0 checks them newest first, renames an unreadable one to
``*.corrupt``, says so, and tells every rank which one to load.

Preemption: SIGTERM or SIGUSR1 to any rank (or SIGTERM to torchrun, which forwards it to
every worker and kills them after its --shutdown-timeout, 30 s by default) does not kill
the run. Each rank notes the signal; the ranks agree on it through the all-reduce every
step already does, so all stop after the same step; rank 0 writes a checkpoint of that
step (with --ckpt-dir), every rank waits for it, prints where to resume and exits with
status 0 (torchrun, if it was the one signalled, still reports its own SignalException).

Hangs: the process group is created with ``--dist-timeout`` (10 minutes by default)
rather than torch's 30: a rank that dies or never reaches a collective makes the others
raise after that long instead of waiting half an hour.

Backend and device: NCCL with cuda:LOCAL_RANK and bf16 autocast when CUDA is present,
gloo on CPU in fp32. Run without torchrun it trains in one process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

START = time.monotonic()  # --time-budget-s counts from here, before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ringflash  # noqa: E402
from ringflash.layer import all_reduce_gradients, broadcast_parameters  # noqa: E402

IGNORE = -100
CKPT_PATTERN = re.compile(r"^step_(\d{8})\.pt$")
# Arguments that fix the model, the data or their order: a checkpoint only resumes a run
# that agrees on all of them.
RUN_DEFINING = ("seqlen", "batch_size", "curriculum", "d_model", "layers", "heads", "kv_heads",
                "mlp_ratio", "rope_base", "num_keys", "values_per_key", "queries", "noise_tokens",
                "fact_copies", "facts_end", "queries_start", "documents", "attn_dropout", "seed")
# Arguments a resumed run may change (the run then differs from the uninterrupted one).
SCHEDULE = ("steps", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "layout",
            "sp_size", "dtype")
# Run-defining arguments newer than some checkpoints: the value a checkpoint without them had.
RUN_DEFINING_DEFAULTS = {"curriculum": None, "facts_end": 0.5, "queries_start": 0.5}
# A stage of --curriculum: [BATCHx]SEQLEN[k]:STEPS, e.g. 16x8k:400 (k: 1024 tokens).
STAGE_PATTERN = re.compile(r"^(?:(\d+)x)?(\d+)(k?):(\d+)$")
# Signals that stop the run after a checkpoint instead of killing it (SLURM: --signal).
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


# ----------------------------------------------------------------------------- arguments


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, but no "(default: None)" and no second default where
    the help text already gives one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("sequence parallelism")
    g.add_argument("--seqlen", type=int, default=None,
                   help="GLOBAL tokens per sequence (a multiple of 2 x sp for zigzag, sp for "
                        "stripe and documents, 128 x sp for block_stripe); default 512")
    g.add_argument("--batch-size", type=int, default=None,
                   help="sequences per step, all data-parallel replicas together; default 8 "
                        "(with --curriculum: of the stages that name no batch size)")
    g.add_argument("--curriculum", default=None, metavar="STAGES",
                   help="a length curriculum instead of --seqlen and --steps: stages "
                        "[BATCHx]SEQLEN:STEPS, comma-separated, e.g. 16x8k:400,4x32k:150,1x128k:300 "
                        "(k: 1024 tokens); the last stage is the final length")
    g.add_argument("--layout", default="auto", choices=("auto", "documents", *ringflash.LAYOUTS),
                   help="which tokens each rank of a ring holds. auto (the default): documents "
                        "when --documents packs several a sequence, else zigzag. documents: the "
                        "layout computed from the packed documents (ringflash.document_layout), "
                        "one per --curriculum length: each document whole on one rank where the "
                        "balance allows, so most recall stays on its rank; zigzag for one "
                        "document. A named layout is used at every length (zigzag: every "
                        "document split over the ring, so that the recall crosses ranks)")
    g.add_argument("--sp-size", type=int, default=0,
                   help="ranks in one ring (sequence-parallel group); 0: the whole world. "
                        "The other factor of the world size is data parallelism")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=64, help="model width")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--heads", type=int, default=4, help="query heads")
    g.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA when fewer than --heads)")
    g.add_argument("--mlp-ratio", type=int, default=4, help="MLP hidden width / d_model")
    g.add_argument("--attn-dropout", type=float, default=0.0,
                   help="attention dropout (regenerated from a per-step seed: resume stays exact)")
    g.add_argument("--rope-base", type=float, default=10000.0,
                   help="rotary embedding base; raise it (1e6) for contexts of 100k+ tokens")
    g = p.add_argument_group("task (synthetic key-value recall)")
    g.add_argument("--documents", type=int, default=2,
                   help="documents packed into every sequence, each its own recall instance of "
                        "seqlen/documents tokens; attention is masked at their boundaries, and "
                        "with several the default --layout is the one computed from them")
    g.add_argument("--num-keys", type=int, default=2, help="keys bound to a value in every document")
    g.add_argument("--values-per-key", type=int, default=16,
                   help="values each key can take; chance loss is ln(values-per-key)")
    g.add_argument("--queries", type=int, default=32,
                   help="scored queries per document (with --curriculum: at the final length)")
    g.add_argument("--noise-tokens", type=int, default=32, help="size of the noise vocabulary")
    g.add_argument("--fact-copies", type=int, default=8,
                   help="times each fact is written (with --curriculum: at the final length, "
                        "scaled with the length at other stages, as --queries is)")
    g.add_argument("--facts-end", type=float, default=0.5, metavar="FRACTION",
                   help="facts are written in the first FRACTION of each document")
    g.add_argument("--queries-start", type=float, default=0.5, metavar="FRACTION",
                   help="queries sit after the first FRACTION of each document (at least "
                        "--facts-end)")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=None,
                   help="optimizer steps of the whole run; default 150 (with --curriculum: "
                        "the sum of its stages)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="final learning rate of the cosine, as a fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm; 0 disables")
    g.add_argument("--seed", type=int, default=0, help="seed of the parameters and of the data")
    g.add_argument("--eval-steps", type=int, default=0,
                   help="after training, score this many batches of the final length and batch "
                        "size that no step trained on; final_accuracy is then theirs")
    g.add_argument("--time-budget-s", type=float, default=0.0,
                   help="end training (and go on to --eval-steps) before a step that would end "
                        "past this many seconds since train.py started; 0: no limit")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda:LOCAL_RANK with NCCL if there is a GPU, else the CPU with gloo")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (autocast); auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--ckpt-dir", default=None, help="where to write checkpoints (none if unset)")
    g.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    g.add_argument("--keep-ckpts", type=int, default=2, help="how many recent checkpoints to keep")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --ckpt-dir (fresh start if none)")
    g.add_argument("--metrics-out", default=None, help="write a JSON summary here (rank 0)")
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines without a TTY")
    g.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    g.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a collective waits for a missing rank before raising")
    # Testing aid: die right after step N (its checkpoint, if due, already written).
    g.add_argument("--crash-after-step", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 8
    if args.curriculum is not None:
        if args.seqlen is not None or args.steps is not None:
            p.error("--curriculum replaces --seqlen and --steps: its stages give both")
        try:
            stages = parse_curriculum(args.curriculum, args.batch_size)
        except ValueError as exc:
            p.error(str(exc))
        # The canonical form (a checkpoint compares it); the final stage's shape and the
        # total step count stand in for --seqlen, --batch-size and --steps everywhere else.
        args.curriculum = ",".join(map(str, stages))
        args.seqlen, args.batch_size = stages[-1].seqlen, stages[-1].batch_size
        args.steps = sum(stage.steps for stage in stages)
    args.seqlen = 512 if args.seqlen is None else args.seqlen
    args.steps = 150 if args.steps is None else args.steps
    if args.layout == "auto":  # what the run uses (a checkpoint records it, metrics report it)
        args.layout = "documents" if args.documents > 1 else "zigzag"
    for name in ("seqlen", "batch_size", "d_model", "layers", "heads", "kv_heads", "steps",
                 "ckpt_every", "keep_ckpts", "log_every", "num_keys", "values_per_key", "queries"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.facts_end <= args.queries_start < 1:
        p.error(f"--facts-end {args.facts_end} and --queries-start {args.queries_start} must "
                "satisfy 0 < facts-end <= queries-start < 1")
    if args.eval_steps < 0 or args.time_budget_s < 0:
        p.error("--eval-steps and --time-budget-s must not be negative")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


# ----------------------------------------------------------------------------- the curriculum


@dataclass(frozen=True)
class Stage:
    """``steps`` optimizer steps of ``batch_size`` sequences of ``seqlen`` global tokens."""

    batch_size: int
    seqlen: int
    steps: int

    def __str__(self) -> str:
        return f"{self.batch_size}x{self.seqlen}:{self.steps}"


def parse_curriculum(text: str, batch_size: int = 8) -> list[Stage]:
    """The stages of ``--curriculum`` ("16x8k:400,4x32k:150,1x128k:300"; a stage without
    ``BATCHx`` takes ``batch_size``). ValueError naming --curriculum and the stage if one
    is malformed or has a size below 1."""
    stages = []
    for i, part in enumerate(text.split(","), 1):
        m = STAGE_PATTERN.match(part.strip().lower())
        if m is None:
            raise ValueError(f"--curriculum stage {i} {part.strip()!r}: expected "
                             "[BATCHx]SEQLEN:STEPS, e.g. 16x8k:400 or 4096:100 (k: 1024 tokens)")
        batch, seqlen, kilo, steps = m.groups()
        stage = Stage(int(batch) if batch else batch_size, int(seqlen) * (1024 if kilo else 1),
                      int(steps))
        if min(stage.batch_size, stage.seqlen, stage.steps) < 1:
            raise ValueError(f"--curriculum stage {i} {part.strip()!r}: batch size, sequence "
                             "length and steps must each be at least 1")
        stages.append(stage)
    return stages


def stages_of(args) -> list[Stage]:
    """The run's stages: those of --curriculum, or one of --batch-size x --seqlen, --steps."""
    if args.curriculum:
        return parse_curriculum(args.curriculum, args.batch_size)
    return [Stage(args.batch_size, args.seqlen, args.steps)]


def stage_of_step(stages: list[Stage], step: int) -> int:
    """Index of the stage that step ``step`` (1-based) belongs to."""
    end = 0
    for i, stage in enumerate(stages):
        end += stage.steps
        if step <= end:
            return i
    return len(stages) - 1


def check_stages(args, stages: list[Stage], d) -> tuple[list["Task"], list[ringflash.SequenceParallel]]:
    """Every stage's task and sequence parallelism (``stage_parallel``: its layout for its
    length); ValueError naming the stage's flag unless its task fits its length and its
    length and batch size suit the layout, the ring and data parallelism."""
    tasks, parallels = [], []
    for i, stage in enumerate(stages):
        where = f"--curriculum stage {i + 1} ({stage})" if args.curriculum else f"--seqlen {stage.seqlen}"
        if stage.batch_size % d.dp_size:
            raise ValueError(f"{where}: the batch size {stage.batch_size} must be a multiple of "
                             f"the number of data-parallel replicas {d.dp_size}")
        try:
            task = Task.from_args(args, stage.seqlen)
            sp = stage_parallel(args, task, d.sp_group)
            sp.positions(stage.seqlen)  # the layout splits this length over the ring
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        tasks.append(task)
        parallels.append(sp)
    return tasks, parallels


# ----------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class Task:
    """Key-value recall; the vocabulary is [noise | queries Q(k) | values of key 0 | ...]."""

    seqlen: int
    num_keys: int
    values_per_key: int
    queries: int
    noise_tokens: int
    seed: int
    fact_copies: int = 1
    documents: int = 1
    facts_end: float = 0.5      # facts in [0, facts_end) of a document, as a fraction of it
    queries_start: float = 0.5  # queries in [queries_start, 1)

    @classmethod
    def from_args(cls, args, seqlen: int | None = None) -> "Task":
        """The task of the arguments at ``seqlen`` tokens (default --seqlen, the final
        length): --queries and --fact-copies scale with seqlen / --seqlen (at least 1)."""
        seqlen = args.seqlen if seqlen is None else seqlen
        scale = seqlen / args.seqlen
        queries, copies = (max(1, round(n * scale)) for n in (args.queries, args.fact_copies))
        task = cls(seqlen, args.num_keys, args.values_per_key, queries, args.noise_tokens,
                   args.seed, copies, args.documents, args.facts_end, args.queries_start)
        if task.documents < 1 or task.seqlen % task.documents:
            raise ValueError(f"--documents {task.documents} must divide the sequence length {seqlen}")
        fact_end, query_start = task.regions()
        if task.num_keys * copies > fact_end or queries > task.doc_len - query_start:
            raise ValueError(f"documents of {task.doc_len} tokens are too short: {task.num_keys} "
                             f"keys x {copies} copies must fit in the {fact_end} fact positions "
                             f"of each and {queries} queries in its {task.doc_len - query_start} "
                             "query positions")
        return task

    @property
    def doc_len(self) -> int:
        return self.seqlen // self.documents

    def regions(self) -> tuple[int, int]:
        """(fact_end, query_start) in tokens of a document: facts sit in [0, fact_end),
        queries in [query_start, doc_len)."""
        return int(self.doc_len * self.facts_end), int(self.doc_len * self.queries_start)

    @property
    def min_answer_distance(self) -> int:
        """The fewest tokens between a query and any copy of its fact."""
        fact_end, query_start = self.regions()
        return query_start - fact_end + 1

    @property
    def query_base(self) -> int:
        return self.noise_tokens

    @property
    def value_base(self) -> int:
        return self.noise_tokens + self.num_keys

    @property
    def vocab_size(self) -> int:
        return self.value_base + self.num_keys * self.values_per_key

    @property
    def chance_loss(self) -> float:
        """Cross-entropy of a model that knows the format but not the facts."""
        return math.log(self.values_per_key)

    def generator(self, step: int, index: int) -> torch.Generator:
        digest = hashlib.blake2b(f"{self.seed}/{step}/{index}".encode(), digest_size=7).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little"))

    def sequence(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and labels (seqlen,) int64 of sequence ``index`` of step ``step``: its
        documents one after the other."""
        g = self.generator(step, index)
        parts = [self._document(g) for _ in range(self.documents)]
        return torch.cat([t for t, _ in parts]), torch.cat([l for _, l in parts])

    def cu_seqlens(self) -> torch.Tensor:
        """(documents + 1,) int64 bounds of the documents every sequence packs (flash_attn's
        varlen format): document d holds tokens [cu[d], cu[d + 1])."""
        return torch.arange(self.documents + 1) * self.doc_len

    def segment_ids(self) -> torch.Tensor | None:
        """(seqlen,) int32 document ids of every sequence, or None for one document."""
        if self.documents == 1:
            return None
        return torch.arange(self.documents, dtype=torch.int32).repeat_interleave(self.doc_len)

    def _document(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.doc_len
        fact_end, query_start = self.regions()
        seq = torch.randint(0, self.noise_tokens, (n,), generator=g)
        bound = (self.value_base + torch.arange(self.num_keys) * self.values_per_key
                 + torch.randint(0, self.values_per_key, (self.num_keys,), generator=g))
        facts = torch.randperm(fact_end, generator=g)[: self.num_keys * self.fact_copies]
        seq[facts] = bound.repeat(self.fact_copies)
        keys = torch.randint(0, self.num_keys, (self.queries,), generator=g)
        at = query_start + torch.randperm(n - query_start, generator=g)[: self.queries]
        seq[at] = self.query_base + keys
        labels = torch.full((n,), IGNORE, dtype=torch.int64)
        labels[at] = bound[keys]
        return seq, labels

    def batch(self, step: int, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), each (len(indices), seqlen): a deterministic function of
        (seed, step, index), whoever computes it. Training steps count from 1; the
        evaluation draws its batches at steps -1, -2, ..., which no training step sees."""
        pairs = [self.sequence(step, i) for i in indices]
        return torch.stack([t for t, _ in pairs]), torch.stack([l for _, l in pairs])

    def scored_per_sequence(self) -> int:
        return self.queries * self.documents


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, args, sp: ringflash.SequenceParallel):
        super().__init__()
        d = args.d_model
        self.norm1 = nn.RMSNorm(d)
        self.attn = sp.self_attention(d, args.heads, args.kv_heads, causal=True,
                                      rope_base=args.rope_base, dropout_p=args.attn_dropout)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, args.mlp_ratio * d, bias=False), nn.GELU(),
                                 nn.Linear(args.mlp_ratio * d, d, bias=False))

    def forward(self, x, segment_ids=None, dropout_seed=None, layout=None):
        x = x + self.attn(self.norm1(x), segment_ids=segment_ids, dropout_seed=dropout_seed,
                          layout=layout)
        return x + self.mlp(self.norm2(x))


class RingLM(nn.Module):
    """Decoder-only LM on this rank's tokens (batch, seqlen_local) -> logits (.., vocab)."""

    def __init__(self, args, vocab_size: int, sp: ringflash.SequenceParallel | None = None):
        super().__init__()
        sp = ringflash.SequenceParallel() if sp is None else sp
        self.embed = nn.Embedding(vocab_size, args.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(args, sp) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.d_model)
        self.head = nn.Linear(args.d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens, segment_ids=None, dropout_seed=None, layout=None):
        """dropout_seed: an int; layer i's attention dropout uses dropout_seed + i. layout:
        the layout ``tokens`` were sharded with (``sp.layout`` of the SequenceParallel that
        sharded them; default: that of the model's construction, the final length's)."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, segment_ids, None if dropout_seed is None else dropout_seed + i, layout)
        return self.head(self.norm(x))


def stage_parallel(args, task: Task, group=None) -> ringflash.SequenceParallel:
    """The sequence parallelism of sequences of ``task.seqlen`` tokens: the ring of
    ``group`` and the layout of --layout, for "documents" (or "auto") the layout computed
    from the documents every sequence packs (``SequenceParallel.for_documents``; zigzag
    for one document). It shards the batches of that length (``local_batch``) and gives
    the model's attention their layout (``RingLM.forward``'s ``layout``)."""
    follows_documents = args.layout in ("auto", "documents")
    sp = ringflash.SequenceParallel(group, layout="auto" if follows_documents else args.layout)
    return sp.for_documents(task.cu_seqlens(), task.seqlen)


def layout_label(layout) -> str:
    """A layout in words, for logs and metrics: its name, or "documents"."""
    return layout if isinstance(layout, str) else "documents"


def build_model(args, task: Task, sp: ringflash.SequenceParallel | None = None) -> RingLM:
    """The model with parameters drawn from --seed (the same on every rank); its attention
    layers run over ``sp``'s group, by default with ``sp``'s layout (None: one process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        return RingLM(args, task.vocab_size, sp)


def make_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=args.weight_decay)


def lr_at(step: int, args) -> float:
    """Learning rate of step ``step`` (1-based): linear warm-up, then cosine to min-lr-ratio."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * ratio


# ----------------------------------------------------------------------------- distributed setup


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    sp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"
    sp_group: object = None  # None: the world (or no process group at all)


def setup_distributed(args) -> Dist:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    d = Dist(local_rank=local_rank, device=device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun (or srun + env)
        d.backend = "nccl" if use_cuda else "gloo"
        kwargs = dict(backend=d.backend, timeout=timedelta(seconds=args.dist_timeout))
        if use_cuda:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        d.rank, d.world = dist.get_rank(), dist.get_world_size()
    d.sp_size = args.sp_size or d.world
    if d.world % d.sp_size:
        raise ValueError(f"--sp-size {d.sp_size} must divide the world size {d.world}")
    d.dp_size, d.dp_rank = d.world // d.sp_size, d.rank // d.sp_size
    if args.batch_size % d.dp_size and not args.curriculum:  # check_stages names the stage
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"data-parallel replicas {d.dp_size}")
    if d.sp_size < d.world:
        # Consecutive ranks share a ring: with sp <= GPUs per node it stays on NVLink. With
        # --sp-size 1 each rank is a ring of one (pure data parallelism), not the world.
        d.sp_group, _ = dist.new_subgroups(group_size=d.sp_size)
    return d


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}.pt")


def checkpoints_newest_first(ckpt_dir: str) -> list[str]:
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    steps = sorted((int(m.group(1)) for m in map(CKPT_PATTERN.match, os.listdir(ckpt_dir)) if m),
                   reverse=True)
    return [checkpoint_path(ckpt_dir, step) for step in steps]


def latest_checkpoint(ckpt_dir: str) -> str | None:
    paths = checkpoints_newest_first(ckpt_dir)
    return paths[0] if paths else None


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read (truncated, corrupted), or none that can."""


CHECKPOINT_KEYS = ("step", "model", "optimizer", "history", "args")


def read_checkpoint(path: str, device) -> dict:
    """The state saved in ``path``; CheckpointError if it does not load."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle, I/O error: all "unreadable"
        raise CheckpointError(f"{path}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}") from exc
    if not isinstance(state, dict) or any(key not in state for key in CHECKPOINT_KEYS):
        raise CheckpointError(f"{path}: not a checkpoint of launch/train.py")
    return state


def newest_intact_checkpoint(ckpt_dir: str, device, say=print) -> tuple[str | None, dict | None]:
    """(path, state) of the newest checkpoint in ``ckpt_dir`` that loads; (None, None) if
    there is none at all. Each newer one that does not load is renamed to ``<name>.corrupt``
    (kept for inspection, no longer counted) and reported through ``say``. Raises
    CheckpointError when there are checkpoints and none of them loads."""
    paths = checkpoints_newest_first(ckpt_dir)
    problems = []
    for path in paths:
        try:
            state = read_checkpoint(path, device)
        except CheckpointError as exc:
            problems.append(str(exc))
            aside = path + ".corrupt"
            try:
                os.replace(path, aside)
            except OSError:
                aside = None
            say(f"checkpoint {os.path.basename(path)} does not load ({exc}); "
                + (f"moved aside to {os.path.basename(aside)}; " if aside else "")
                + "trying the previous one")
            continue
        if problems:
            say(f"resuming from {os.path.basename(path)}, the newest checkpoint that loads")
        return path, state
    if problems:
        raise CheckpointError(f"no checkpoint in {ckpt_dir} loads: " + "; ".join(problems))
    return None, None


def agree(ok: bool, d) -> bool:
    """True on every rank iff ``ok`` is True on every rank (one all-reduce)."""
    if d.world == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=d.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def resume_state(args, d) -> tuple[str | None, dict | None]:
    """The checkpoint every rank resumes from, and its state: rank 0 picks the newest one
    that loads and broadcasts its path; the others load that file. Raises on every rank
    if rank 0 found only unreadable checkpoints or any rank cannot load the chosen one."""
    decision = [None, None]  # path, error
    if d.rank == 0:
        try:
            path, state = newest_intact_checkpoint(args.ckpt_dir, d.device,
                                                   say=lambda msg: print(msg, flush=True))
            decision = [path, None]
        except CheckpointError as exc:
            decision = [None, str(exc)]
    if d.world > 1:
        dist.broadcast_object_list(decision, src=0)
    path, error = decision
    if error is not None:
        raise CheckpointError(error)
    if path is None:
        return None, None
    problem = None
    if d.rank != 0:
        try:
            state = read_checkpoint(path, d.device)
        except CheckpointError as exc:
            state, problem = None, exc
    if not agree(problem is None, d):
        raise CheckpointError(f"rank {d.rank}: " + (str(problem) if problem else
                              f"another rank could not load {path}, which rank 0 chose "
                              "(is --ckpt-dir on a file system every rank sees?)"))
    return path, state


def _atomic_write(path: str, write) -> None:
    """write(file) into a temporary file beside ``path``, fsync, then rename over ``path``:
    a reader sees the old file or the complete new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def save_checkpoint(args, step: int, model, optimizer, history: list) -> str:
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "history": history, "args": vars(args)}
    path = checkpoint_path(args.ckpt_dir, step)
    _atomic_write(path, lambda f: torch.save(state, f))
    kept = sorted(int(m.group(1)) for m in map(CKPT_PATTERN.match, os.listdir(args.ckpt_dir)) if m)
    for old in kept[: -args.keep_ckpts]:
        try:
            os.remove(checkpoint_path(args.ckpt_dir, old))
        except FileNotFoundError:
            pass
    return path


def load_checkpoint(path: str, args, model, optimizer, device, state: dict | None = None
                    ) -> tuple[int, list, dict]:
    """Restore model and optimizer from ``path`` (or its already loaded ``state``); returns
    (step, history, {changed argument: (old, new)})."""
    if state is None:
        state = read_checkpoint(path, device)
    saved = {**RUN_DEFINING_DEFAULTS, **state["args"]}
    wrong = {k: (saved.get(k), getattr(args, k)) for k in RUN_DEFINING if saved.get(k) != getattr(args, k)}
    if wrong:
        raise ValueError(f"{path} belongs to a different run; (checkpoint, now): {wrong}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    changed = {k: (saved.get(k), getattr(args, k)) for k in SCHEDULE if saved.get(k) != getattr(args, k)}
    return state["step"], state["history"], changed


# ----------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar on a terminal, a log line every --log-every steps otherwise (rank 0)."""

    def __init__(self, args, start: int, enabled: bool):
        self.enabled, self.every, self.total = enabled, args.log_every, args.steps
        self.bar = None
        if enabled and not args.no_progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, acc: float, tokens_per_s: float, lr: float,
               note: str = ""):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.2f}", lr=f"{lr:.1e}",
                                 tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total or step == 1:
            print(f"step {step:>6}/{self.total}  loss {loss:.4f}  acc {acc:.3f}  lr {lr:.2e}  "
                  f"{tokens_per_s:,.0f} tok/s{note}", flush=True)

    def write(self, msg: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- training


class StopSignals:
    """While active, SIGTERM and SIGUSR1 are noted instead of killing the process: the
    training loop stops at the next step boundary, after a checkpoint. Installed only in
    the main thread (where Python delivers signals); the previous handlers come back on
    exit."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def _note(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def dropout_seed(args, step: int) -> int | None:
    """The attention-dropout seed of a step: a function of (--seed, step), the same on every
    rank and after a resume."""
    if args.attn_dropout == 0:
        return None
    digest = hashlib.blake2b(f"dropout/{args.seed}/{step}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def local_batch(task: Task, sp: ringflash.SequenceParallel, step: int, batch_size: int, d: Dist):
    """This rank's shard (``sp.shard``) of the global batch of ``step`` (``batch_size``
    sequences of task.seqlen tokens): tokens, labels and segment ids (None for one document)."""
    per_replica = batch_size // d.dp_size
    first = d.dp_rank * per_replica
    tokens, labels = task.batch(step, range(first, first + per_replica))
    tokens, labels = sp.shard(tokens.to(d.device)), sp.shard(labels.to(d.device))
    segments = task.segment_ids()
    if segments is not None:  # every row packs the same documents
        segments = sp.shard(segments.expand(tokens.shape[0], -1).to(d.device))
    return tokens, labels, segments


def train_step(model, optimizer, task: Task, sp: ringflash.SequenceParallel, batch_size: int,
               step: int, args, d: Dist, autocast_dtype, signals: StopSignals | None = None,
               out_of_time: bool = False):
    """One optimizer step on the global batch of ``step``, split by ``sp`` (the stage's
    ``stage_parallel``: data and attention alike); returns the loss, accuracy and
    gradient norm (before clipping) of the global batch, whether any rank has received a
    stop signal (``signals``) and whether any rank is ``out_of_time``: all identical on
    every rank. The two flags ride on the all-reduce of the statistics, so agreeing on
    them costs nothing."""
    tokens, labels, segments = local_batch(task, sp, step, batch_size, d)
    scored = batch_size * task.scored_per_sequence()  # in the WHOLE global batch

    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        logits = model(tokens, segments, dropout_seed(args, step), layout=sp.layout)
    logits = logits.float().flatten(0, 1)
    labels = labels.flatten()
    loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    (loss_sum / scored).backward()
    all_reduce_gradients(model.parameters(), group=None)  # SUM over sp and dp: exact
    # The norm of the full gradient (identical on every rank); clipping only if asked.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               args.grad_clip if args.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
        asked = signals is not None and signals.received is not None
        flags = torch.tensor([float(asked), float(out_of_time)], device=loss_sum.device)
        stats = torch.cat([torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype)]), flags])
    if d.world > 1:
        dist.all_reduce(stats)
    loss, hits, stops, late = stats.tolist()
    return loss / scored, hits / scored, grad_norm.item(), stops > 0, late > 0


@torch.no_grad()
def evaluate(model, task: Task, sp: ringflash.SequenceParallel, batch_size: int, args, d: Dist,
             autocast_dtype) -> tuple[float, float]:
    """Loss and accuracy over --eval-steps batches of ``task`` that no training step draws
    (steps -1, -2, ...), split by ``sp``, forward only; identical on every rank."""
    model.eval()
    totals = torch.zeros(2, device=d.device)
    for i in range(1, args.eval_steps + 1):
        tokens, labels, segments = local_batch(task, sp, -i, batch_size, d)
        with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(tokens, segments, layout=sp.layout)
        logits, labels = logits.float().flatten(0, 1), labels.flatten()
        totals[0] += F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        totals[1] += ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    model.train()
    if d.world > 1:
        dist.all_reduce(totals)
    scored = args.eval_steps * batch_size * task.scored_per_sequence()
    loss, hits = totals.tolist()
    return loss / scored, hits / scored


def run(args) -> dict | None:
    with StopSignals() as signals:
        d = setup_distributed(args)
        try:
            return _train(args, d, signals)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def describe_stage(index: int, stages: list[Stage], task: Task, sp: ringflash.SequenceParallel) -> str:
    first = sum(stage.steps for stage in stages[:index]) + 1
    stage = stages[index]
    return (f"stage {index + 1}/{len(stages)}: {stage.batch_size} x {stage.seqlen} tokens/step, "
            f"steps {first}-{first + stage.steps - 1}; per document {task.queries} queries, "
            f"each fact {task.fact_copies}x, answers >= {task.min_answer_distance} "
            f"tokens back ({stage.seqlen // sp.world} tokens of a sequence per rank, "
            f"layout {layout_label(sp.layout)})")


def window_means(entries: list[dict]) -> tuple[float | None, float | None, int]:
    """Mean loss and accuracy of the last min(10, n/10) (at least 1) of ``entries``."""
    if not entries:
        return None, None, 0
    window = max(1, min(10, len(entries) // 10))
    last = entries[-window:]
    return (sum(h["loss"] for h in last) / window, sum(h["acc"] for h in last) / window, window)


def stage_summaries(stages: list[Stage], tasks: list[Task], parallels: list, history: list,
                    start: int) -> list[dict]:
    """Per stage: its shape, layout and task, the steps run, the mean loss and accuracy of its
    last steps, and global tokens/s over the steps this invocation ran (start excluded: those
    came from a checkpoint), the first of the stage and of the invocation left out (JIT,
    caches, allocator growth) unless nothing else is left."""
    out = []
    for i, (stage, task, sp) in enumerate(zip(stages, tasks, parallels)):
        entries = [h for h in history if stage_of_step(stages, h["step"]) == i]
        ran = [h for h in entries if h["step"] > start and "seconds" in h]
        timed = [h for h in ran if not h.get("first")] or ran
        seconds = sum(h["seconds"] for h in timed)
        loss, acc, window = window_means(entries)
        out.append({
            "batch_size": stage.batch_size, "seqlen": stage.seqlen, "steps": stage.steps,
            "layout": layout_label(sp.layout),
            "first_step": sum(s.steps for s in stages[:i]) + 1, "steps_run": len(entries),
            "queries": task.queries, "fact_copies": task.fact_copies,
            "min_answer_distance": task.min_answer_distance,
            "final_loss": loss, "final_accuracy": acc, "final_window": window,
            "timed_steps": len(timed), "timed_s": seconds,
            "tokens_per_s": stage.batch_size * stage.seqlen * len(timed) / seconds if timed else None,
        })
    return out


def _train(args, d: Dist, signals: StopSignals | None = None) -> dict | None:
    is_main = d.rank == 0
    stages = stages_of(args)
    # ValueError naming the stage before anything runs; one SequenceParallel per stage.
    tasks, parallels = check_stages(args, stages, d)
    task = tasks[-1]  # the final length (every stage has the same vocabulary)
    autocast_dtype = {"auto": torch.bfloat16 if d.device.type == "cuda" else None,
                      "float32": None, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args, task, parallels[-1]).to(d.device)
    broadcast_parameters(model)  # same seed everywhere already; this makes it a guarantee
    optimizer = make_optimizer(model, args)

    start, history, changed = 0, [], {}
    if args.resume:
        path, state = resume_state(args, d)
        if path is not None:
            start, history, changed = load_checkpoint(path, args, model, optimizer, d.device, state)
            del state
    n_params = sum(p.numel() for p in model.parameters())
    progress = Progress(args, start, enabled=is_main)
    shape = (f"{args.batch_size} x {args.seqlen} tokens/step, {args.seqlen // d.sp_size} per rank "
             f"({args.layout})")
    progress.write(
        f"ringflash train: world {d.world} (dp {d.dp_size} x sp {d.sp_size}), {d.backend} on "
        f"{d.device.type}, {'bf16 autocast' if autocast_dtype else 'fp32'}; "
        + (f"curriculum {args.curriculum}, final {shape}" if args.curriculum else shape)
        + f"; {n_params / 1e6:.2f}M params; task chance loss {task.chance_loss:.3f}"
        + (f"; resumed at step {start}" if start else ""))
    if changed:
        progress.write(f"note: resuming with changed arguments (checkpoint, now): {changed}")

    stopped_by, out_of_time, estimate = None, False, 0.0
    timed_steps, timed_s, index = 0, 0.0, None
    for step in range(start + 1, args.steps + 1):
        first = stage_of_step(stages, step) != index  # the first step of a stage here
        if first:
            index = stage_of_step(stages, step)
            timed_steps, timed_s = 0, 0.0
            if len(stages) > 1:
                progress.write(describe_stage(index, stages, tasks[index], parallels[index]))
        stage = stages[index]
        # Out of time if the step after this one would end past the budget, both estimated
        # to take as long as the last step that was not a stage's first (those compile);
        # any rank's verdict stops all of them after this step.
        late = bool(args.time_budget_s) and time.monotonic() - START + 2 * estimate >= args.time_budget_s
        t0 = time.perf_counter()
        loss, acc, grad_norm, stop, out_of_time = train_step(
            model, optimizer, tasks[index], parallels[index], stage.batch_size, step, args, d,
            autocast_dtype, signals, late)
        step_s = time.perf_counter() - t0  # stats.tolist() synchronized the device
        if not first:
            estimate = step_s
        if not first or step == args.steps:  # a stage's first step warms up (JIT, caches)
            timed_steps, timed_s = timed_steps + 1, timed_s + step_s
        tokens_per_s = stage.batch_size * stage.seqlen * (
            timed_steps / timed_s if timed_steps else 1 / step_s)
        lr = lr_at(step, args)
        history.append({"step": step, "loss": loss, "acc": acc, "lr": lr, "grad_norm": grad_norm,
                        "seqlen": stage.seqlen, "seconds": step_s, "first": first})
        progress.update(step, loss, acc, tokens_per_s, lr,
                        f"  len {stage.seqlen}  {time.monotonic() - START:.0f} s" if args.curriculum else "")
        due = step % args.ckpt_every == 0 or step == args.steps
        if args.ckpt_dir and (due or stop or out_of_time) and is_main:
            save_checkpoint(args, step, model, optimizer, history)
        if stop:
            # Every rank saw the same flag; none leaves before rank 0's checkpoint is on disk.
            stopped_by = (signals.received if signals else None) or "a signal to another rank"
            if d.world > 1:
                dist.barrier()
            where = (f"checkpoint {checkpoint_path(args.ckpt_dir, step)} written; continue with --resume"
                     if args.ckpt_dir else "no --ckpt-dir, so nothing was saved")
            progress.write(f"stopped after step {step} by {stopped_by}: {where}")
            break
        if out_of_time:
            progress.write(f"time budget of {args.time_budget_s:g} s reached after step {step} "
                           f"({time.monotonic() - START:.0f} s since start): {args.steps - step} "
                           "steps left out")
            break
        if args.crash_after_step == step:
            progress.write(f"simulated crash after step {step}")
            os._exit(3)
    progress.close()

    if not history:
        return None
    evaluation = None
    if args.eval_steps and stopped_by is None:  # a preempted job leaves at once
        t0 = time.perf_counter()
        loss, acc = evaluate(model, task, parallels[-1], args.batch_size, args, d, autocast_dtype)
        evaluation = {"seqlen": args.seqlen, "batch_size": args.batch_size, "steps": args.eval_steps,
                      "scored": args.eval_steps * args.batch_size * task.scored_per_sequence(),
                      "loss": loss, "accuracy": acc, "seconds": time.perf_counter() - t0}
        progress.write(f"eval: {args.eval_steps} x {args.batch_size} sequences of {args.seqlen} "
                       f"tokens never trained on, {evaluation['scored']:,} queries: loss {loss:.4f}  "
                       f"acc {acc:.3f}")
    summaries = stage_summaries(stages, tasks, parallels, history, start)
    last = summaries[-1]  # the final length
    losses = [h["loss"] for h in history]
    metrics = {
        "world_size": d.world, "dp_size": d.dp_size, "sp_size": d.sp_size,
        "steps": history[-1]["step"],
        "initial_loss": losses[0],
        # Means over the last steps of the final stage (None if it never ran).
        "final_loss": last["final_loss"], "final_loss_window": last["final_window"],
        # The evaluation's accuracy if there was one, else the training steps' above.
        "final_accuracy": evaluation["accuracy"] if evaluation else last["final_accuracy"],
        "chance_loss": task.chance_loss,
        # Global tokens per second over this invocation's steps at the final stage, its
        # first step excluded (None when it ran none); each stage's own in "stages".
        "tokens_per_s": last["tokens_per_s"],
        "timed_steps": last["timed_steps"], "timed_s": last["timed_s"],
        "resumed_from_step": start,
        "stopped_by_signal": stopped_by,
        "stopped_by_time_budget": out_of_time,
        "elapsed_s": time.monotonic() - START,  # since train.py started, startup included
        "seqlen": args.seqlen, "batch_size": args.batch_size, "layout": args.layout,
        "tokens_per_rank": args.seqlen // d.sp_size,
        "min_answer_distance": task.min_answer_distance,
        "curriculum": args.curriculum, "stages": summaries, "eval": evaluation,
        "device": (torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"),
        "backend": d.backend, "dtype": "bfloat16" if autocast_dtype else "float32",
        "params": n_params, "torch": torch.__version__,
        "losses": losses, "accuracies": [h["acc"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "seqlens": [h.get("seqlen", args.seqlen) for h in history],
        "step_seconds": [h.get("seconds") for h in history],
        "args": vars(args),
    }
    if is_main:
        num = lambda x: float("nan") if x is None else x  # noqa: E731 - nan: no step ran
        if len(stages) > 1:
            for i, summary in enumerate(summaries):
                progress.write(f"stage {i + 1} ({stages[i]}): " + (
                    "not reached" if not summary["steps_run"] else
                    f"{summary['steps_run']} steps, loss {summary['final_loss']:.4f}  acc "
                    f"{summary['final_accuracy']:.3f}  {num(summary['tokens_per_s']):,.0f} tok/s"))
        progress.write(
            f"{'done' if stopped_by is None else 'stopped'}: loss {metrics['initial_loss']:.4f} -> "
            f"{num(metrics['final_loss']):.4f} (chance {task.chance_loss:.3f}), accuracy "
            f"{num(metrics['final_accuracy']):.3f}{' (eval)' if evaluation else ''}, "
            f"{num(metrics['tokens_per_s']):,.0f} tok/s")
        if args.metrics_out:
            text = json.dumps(metrics, indent=2)
            _atomic_write(args.metrics_out, lambda f: f.write(text.encode()))
    if d.world > 1:  # no rank tears the group down while another still uses it
        dist.barrier()
    return metrics


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        main()
    else:
        # A gloo worker thread may still be freeing the last collective's work (the final
        # barrier, or the all-reduce before an error) when the interpreter finalizes;
        # freeing its tensor takes the GIL, which a finalizing interpreter no longer gives
        # out, and the thread's exit ends in std::terminate (SIGABRT after "done"; 4 of 20
        # runs on a loaded 2-core machine, pytorch/pytorch#179291 has the same trace).
        # destroy_process_group does not stop gloo's threads while anything still holds
        # the group (the model's layers do, and after an error its traceback). Everything
        # this job writes is closed and fsynced by now, and the process group is
        # destroyed: leave without finalizing, after an error too (its traceback first).
        code = 0
        try:
            main()
        except Exception:  # noqa: BLE001 - reported as Python would, with its exit status
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
