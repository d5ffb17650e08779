"""Hugging Face transformers over the ring (ringflash.hf), on CPU over gloo.

- A random-init LlamaForCausalLM with attn_implementation="ring_attn" on a prepared batch
  equals the same model with transformers' eager attention on the whole batch, at W=2
  and W=4: logits (gathered), loss (summed over ranks), every parameter gradient (summed);
  padded batches labelled the HF way (left, right, mixed; Llama, Qwen2, Phi3), packed
  batches, sliding windows, a moved copy of the batch, inputs_embeds, evaluation.
- Packed position_ids under SequenceParallel's default layout ("auto"): the batch is split
  by the layout computed from its documents (not zigzag) and equals, at W=2 (a document
  cut between two ranks) and W=4 (documents split over every rank), the unsharded model
  run on each document alone: logits, loss, every gradient. A pinned layout is kept; rows
  packing different documents raise naming position_ids.
- launch/hf_finetune.py at W=2 trains exactly like the unsharded model (--reference).
- The whole model with ring attention compiles with fullgraph=True into one graph.
- Generation runs inside ringflash.hf.unsharded (the same greedy tokens).
- Misuse raises instead of running silently wrong: a forward without the prepared
  position_ids or without the prepared batch at all, an attention mask handed to the
  model, ranks given different batches, generate outside unsharded, softcapping, a name
  containing "flash".
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]' or '.[test]')")

import ringflash  # noqa: E402
import ringflash.hf  # noqa: E402
from oracle import rel_err  # noqa: E402
from ringflash.documents import DocumentLayout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # fp32, relative Frobenius error


def tiny_config(**overrides):
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.update(overrides)
    return transformers.LlamaConfig(**config)


def tiny_models(attn="eager", seed=0, config=None, model_cls=None):
    """(reference with ``attn``, ring model): the same random parameters, separate configs
    (the attention implementation lives in the config); a tiny Llama by default. Called in
    spawned workers only: importing a transformers model in pytest's own process has made
    later calls of the kernels' custom ops crash there (torch 2.13, CPU)."""
    torch.manual_seed(seed)
    config = tiny_config() if config is None else config
    model_cls = transformers.LlamaForCausalLM if model_cls is None else model_cls
    reference = model_cls(copy.deepcopy(config))
    reference.set_attn_implementation(attn)
    ring = model_cls(copy.deepcopy(config))
    ring.load_state_dict(reference.state_dict())
    ring.set_attn_implementation(ringflash.hf.register())
    return reference, ring


def ring_errors(reference, model, sp, ids, labels):
    """({what: rel err} of the ring model's logits, loss and summed gradients against the
    reference's on the whole batch, the prepared batch)."""
    want = reference(input_ids=ids, labels=labels)
    want.loss.backward()
    batch = ringflash.hf.prepare_batch(sp, ids, labels=labels)
    got = model(**batch)
    got.loss.backward()
    sp.reduce_gradients(model.parameters())
    errs = {"logits": rel_err(sp.unshard(got.logits.detach()), want.logits),
            "loss": rel_err(sp.reduce_loss(got.loss), want.loss)}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        errs[f"grad {name}"] = rel_err(p.grad, ref_params[name].grad)
    return errs, batch


def _batch(seqlen, batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seqlen), generator=gen)
    labels = ids.clone()
    labels[0, : seqlen // 3] = -100  # unscored tokens, unevenly over the ranks
    return ids, labels


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return f"{type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------- worker side


def matches_unsharded(rank, world, layout):
    """Errors of the ring model against the unsharded one, and what misuse raised."""
    reference, model = tiny_models()
    sp = ringflash.SequenceParallel(layout=layout)
    errs, batch = ring_errors(reference, model, sp, *_batch(seqlen=8 * world))
    misuse = {  # each raises before the ring runs, on every rank alike: no rank waits
        "no position_ids": _raises(lambda: model(input_ids=batch["input_ids"],
                                                 **{ringflash.hf.CONTEXT_KEY: batch[ringflash.hf.CONTEXT_KEY]})),
        "no prepared batch": _raises(lambda: model(input_ids=batch["input_ids"])),
        "mask to the model": _raises(lambda: model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))),
    }
    return errs, misuse


def example_run(rank, world, argv, reference=False):
    """launch/hf_finetune.py's train() in this world (or, reference: the unsharded model)."""
    spec = importlib.util.spec_from_file_location("ringflash_hf_finetune", ROOT / "launch" / "hf_finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    args = module.parse_args([*argv, *(["--reference"] if reference else [])])
    if reference and rank != 0:
        return None
    result = module.train(args)
    return result["losses"], result["params"]


# ----------------------------------------------------------------------------- tests



@pytest.mark.world(2)
def test_example_trains_like_unsharded(worlds):
    """launch/hf_finetune.py, 4 steps at W=2 (zigzag) against --reference (transformers'
    sdpa on whole sequences): the same losses and final parameters."""
    argv = ["--steps", "4", "--seqlen", "32", "--batch-size", "2", "--hidden", "32", "--log-every", "100"]
    world = worlds(2)
    ring = world.run(example_run, argv, timeout=180)
    reference_losses, reference_params = world.run(example_run, argv, reference=True, timeout=180)[0]
    for rank, (losses, params) in enumerate(ring):
        assert len(losses) == 4
        for step, (a, b) in enumerate(zip(losses, reference_losses), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs {b}"
        for name, p in params.items():
            assert rel_err(p, reference_params[name]) <= 1e-5, f"rank {rank}: {name}"


@pytest.mark.parametrize("world_size,layout", [(2, "zigzag"), (4, "zigzag"), (4, "contiguous")],
                         ids=["W2-zigzag", "W4-zigzag", "W4-contiguous"])
def test_llama_matches_unsharded(worlds, world_size, layout):
    per_rank = worlds(world_size).run(matches_unsharded, layout, timeout=180)
    failures = []
    for rank, (errs, misuse) in enumerate(per_rank):
        failures += [f"rank {rank}: {what} rel err {err:.3g}" for what, err in errs.items()
                     if not err <= TOL]
        for case, caught in misuse.items():
            if caught is None:
                failures.append(f"rank {rank}: {case}: nothing raised")
        assert "position_ids" in (misuse["no position_ids"] or ""), misuse["no position_ids"]
        assert "prepare_batch" in (misuse["no prepared batch"] or ""), misuse["no prepared batch"]
        assert "attention_mask" in (misuse["mask to the model"] or ""), misuse["mask to the model"]
    assert not failures, "\n".join(failures)


def padded_or_packed_errors(rank, world):
    """Logit errors of the ring model on a padded and on a packed batch: against the
    unsharded model with the same attention mask, and against the unsharded model run on
    each document alone (the ground truth of packing: transformers itself finds packed
    documents only in some cases)."""
    reference, model = tiny_models()
    sp = ringflash.SequenceParallel()
    ids, labels = _batch(seqlen=16)
    padded = dict(attention_mask=torch.tensor([[1] * 16, [1] * 11 + [0] * 5]))
    packed = dict(position_ids=torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16))
    errors = {}
    for name, case in (("padded", padded), ("packed", packed)):
        got = model(**ringflash.hf.prepare_batch(sp, ids, labels=labels, **case))
        if case is packed:
            want = torch.cat([reference(input_ids=ids[:, :6]).logits,
                              reference(input_ids=ids[:, 6:]).logits], dim=1)
        else:
            want = reference(input_ids=ids, labels=labels, **case).logits
        keep = case.get("attention_mask", torch.ones_like(ids)).bool()
        errors[name] = rel_err(got.logits[keep], want[keep])
    return errors


@pytest.mark.world(1)
def test_padded_or_packed_batch_is_not_ignored(worlds):
    """A padded or packed batch gets its mask (in a spawned process: running the model in
    pytest's own has crashed later eager custom-op calls there, torch 2.13 CPU)."""
    errors = worlds(1).run(padded_or_packed_errors, timeout=180)[0]
    assert all(err <= TOL for err in errors.values()), errors


def test_unpadded_single_sequences_need_no_segments():
    ids, _ = _batch(seqlen=16)
    assert ringflash.hf.segment_ids_of(torch.arange(16).expand(2, 16)) is None
    assert ringflash.hf.segment_ids_of(torch.arange(16).expand(2, 16), torch.ones_like(ids)) is None
    seg = ringflash.hf.segment_ids_of(torch.tensor([[0, 1, 2, 0, 1, 5]]), torch.tensor([[1, 1, 1, 1, 1, 0]]))
    assert seg.tolist() == [[0, 0, 0, 1, 1, -1]]


# Documents packed into every row, by world size: at W=2 the short one is cut between the
# ranks; at W=4 the long ones are split over every rank.
PACKINGS = {2: [5, 14, 13], 4: [5, 30, 29]}


def packed_batch_matches_unsharded(rank, world):
    """Rows that pack the same documents (position_ids restarting at each) prepared with
    SequenceParallel's default layout: (what the batch was split by, {what: rel err} of
    logits, loss and summed gradients against the unsharded model run on each document
    alone, the loss over the whole rows' shifted labels as the model computes it)."""
    reference, model = tiny_models()
    lengths = PACKINGS[world]
    seqlen = sum(lengths)
    ids, labels = _batch(seqlen)
    sp = ringflash.SequenceParallel()
    batch = ringflash.hf.prepare_batch(sp, ids, labels=labels,
                                       position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    split = batch[ringflash.hf.CONTEXT_KEY].sp
    got = model(**batch)
    got.loss.backward()
    sp.reduce_gradients(model.parameters())
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    logits = torch.cat([reference(input_ids=ids[:, a:b]).logits for a, b in zip(bounds, bounds[1:])], dim=1)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    errs = {"logits": rel_err(split.unshard(got.logits.detach()), logits),
            "loss": rel_err(sp.reduce_loss(got.loss), loss)}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        errs[f"grad {name}"] = rel_err(p.grad, ref_params[name].grad)
    layout = split.layout
    facts = {"documents": layout.bounds.tolist() if isinstance(layout, DocumentLayout) else layout,
             "crossing": sorted(getattr(layout, "shared", ())),
             "its tokens": torch.equal(batch["input_ids"], ids[:, split.positions(seqlen)]),
             "zigzag's tokens": torch.equal(batch["input_ids"], ringflash.shard(ids, layout="zigzag"))}
    return facts, errs


@pytest.mark.parametrize("world_size", [2, 4], ids=["W2", "W4"])
def test_packed_batch_takes_the_document_layout_and_matches_unsharded(worlds, world_size):
    per_rank = worlds(world_size).run(packed_batch_matches_unsharded, timeout=180)
    lengths = PACKINGS[world_size]
    failures = []
    for rank, (facts, errs) in enumerate(per_rank):
        assert facts["documents"] == torch.tensor([0, *lengths]).cumsum(0).tolist(), facts
        assert facts["crossing"] and facts["its tokens"], facts
        failures += [f"rank {rank}: {what} rel err {err:.3g}" for what, err in errs.items() if not err <= TOL]
    assert not all(facts["zigzag's tokens"] for facts, _ in per_rank), "split as zigzag"
    assert not failures, "\n".join(failures)


def test_packed_position_ids_choose_the_document_layout_unless_one_is_pinned():
    """Which SequenceParallel a prepared batch is split by (``batch[CONTEXT_KEY].sp``)."""
    ids = torch.zeros(2, 16, dtype=torch.long)
    packed = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)

    def split(sp, position_ids=packed, **kwargs):
        batch = ringflash.hf.prepare_batch(sp, ids, position_ids=position_ids, **kwargs)
        return batch[ringflash.hf.CONTEXT_KEY].sp

    auto = ringflash.SequenceParallel()
    assert isinstance(split(auto).layout, DocumentLayout)
    assert split(auto).layout.bounds.tolist() == [0, 6, 16]
    # Padding that ends every row is the layout's padding; padding of one row only is not.
    ends = torch.tensor([[1] * 12 + [0] * 4, [1] * 14 + [0] * 2])
    assert split(auto, attention_mask=ends).layout.bounds.tolist() == [0, 6, 14]
    pinned = ringflash.SequenceParallel(layout="zigzag")
    assert split(pinned) is pinned
    # No packing: padding alone, or transformers' positions of left padding, keep sp as it is.
    left = torch.tensor([[0] * 4 + [1] * 12, [1] * 16])
    assert split(auto, None, attention_mask=left) is auto
    assert split(auto, (left.cumsum(-1) - 1).masked_fill(left == 0, 1), attention_mask=left) is auto
    # Rows packing different documents: one layout of documents cannot serve them.
    other = torch.stack([packed[0], torch.cat([torch.arange(8), torch.arange(8)])])
    with pytest.raises(ValueError, match=r"position_ids: row 1 starts a document at token 8, inside "
                                         r"a document of row 0: the rows pack different documents"):
        split(auto, other)
    assert split(pinned, other) is pinned


@pytest.mark.parametrize("position_ids", [torch.arange(7), torch.arange(8)[None, None],
                                          torch.arange(8).expand(3, 8), [0] * 8],
                         ids=["short-1d", "3d", "batch-3", "list"])
def test_bad_position_ids_raise_naming_them(position_ids):
    """Checked before anything is expanded or sharded (a short 1-D tensor used to reach
    torch's expand error instead)."""
    with pytest.raises(ValueError, match="position_ids must be"):
        ringflash.hf.prepare_batch(ringflash.SequenceParallel(), torch.zeros(2, 8, dtype=torch.long),
                                   position_ids=position_ids)


def test_flash_in_the_name_is_refused():
    with pytest.raises(ValueError, match="flash"):
        ringflash.hf.register("ring_flash_attn")


def sliding_window_matches_unsharded(rank, world, layout):
    """A Mistral model with a sliding window of 40 keys over ``layout``: errors of logits,
    loss and gradients against transformers' eager model on the whole sequence."""
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=40)
    reference, model = tiny_models(config=config, model_cls=transformers.MistralForCausalLM)
    sp = ringflash.SequenceParallel(layout=layout)
    return ring_errors(reference, model, sp, *_batch(seqlen=128 * world))[0]


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", ["zigzag", "block_stripe"])
def test_sliding_window_layers_match_unsharded(worlds, layout):
    """Sliding-window layers (transformers' key j > i - window) run as window_size
    (window - 1, 0), on block_stripe too, whose shards' blocks of 128 the window crosses."""
    per_rank = worlds(2).run(sliding_window_matches_unsharded, layout, timeout=180)
    failures = [f"rank {rank}: {what} rel err {err:.3g}" for rank, errs in enumerate(per_rank)
                for what, err in errs.items() if not err <= TOL]
    assert not failures, "\n".join(failures)


def compiles_in_one_graph(rank, world):
    """torch.compile(fullgraph=True) of the whole model on a prepared batch: (frames, loss
    error, worst gradient error) against eager."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    _, model = tiny_models()
    ids, labels = _batch(seqlen=16)
    batch = ringflash.hf.prepare_batch(ringflash.SequenceParallel(), ids, labels=labels)
    want = model(**batch).loss
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(model, fullgraph=True, backend=counter)(**batch).loss
    got.backward()
    return (counter.frame_count, rel_err(got, want),
            max(rel_err(p.grad, g) for p, g in zip(model.parameters(), want_grads)))


@pytest.mark.world(1)
def test_llama_with_ring_attention_compiles_in_one_graph(worlds):
    """One graph, the eager loss and gradients, at a world of 1. In a spawned process: in
    pytest's own, compiled state left behind has crashed later eager calls of the kernels'
    custom ops (torch 2.13, CPU), even after torch._dynamo.reset()."""
    frames, loss_err, grad_err = worlds(1).run(compiles_in_one_graph, timeout=180)[0]
    assert frames == 1
    assert loss_err <= 1e-6
    assert grad_err <= 1e-5


# ----------------------------------------------------------------------------- around the numbers


FAMILIES = {  # name: (config class, model class), tiny and with every layer's attention the ring's
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def family_models(family):
    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        pad_token_id=0)
    return tiny_models(config=config, model_cls=model_cls)


PADDINGS = {  # rows of 16 tokens: 1 real, 0 padding
    "left": [[0] * 5 + [1] * 11, [0] * 2 + [1] * 14],
    "right": [[1] * 11 + [0] * 5, [1] * 16],
    "mixed": [[0] * 3 + [1] * 13, [1] * 9 + [0] * 7],
}


def padded_batches_match_unsharded(rank, world, family):
    """Per padding: errors of the ring model (loss, gradients, logits at real tokens)
    against the unsharded eager model given padded_labels(labels, mask), with the labels
    of HF's collators (-100 at padded tokens only)."""
    reference, model = family_models(family)
    sp = ringflash.SequenceParallel()
    ids, _ = _batch(seqlen=16)
    out = {}
    for name, rows in PADDINGS.items():
        mask = torch.tensor(rows)
        labels = ids.masked_fill(mask == 0, -100)  # DataCollatorWithPadding's convention
        reference.zero_grad()
        model.zero_grad()
        want = reference(input_ids=ids, attention_mask=mask,
                         labels=ringflash.hf.padded_labels(labels, mask))
        want.loss.backward()
        got = model(**ringflash.hf.prepare_batch(sp, ids, labels=labels, attention_mask=mask))
        got.loss.backward()
        sp.reduce_gradients(model.parameters())
        keep = mask.bool()
        errs = {"loss": rel_err(sp.reduce_loss(got.loss), want.loss),
                "logits": rel_err(sp.unshard(got.logits.detach())[keep], want.logits[keep])}
        ref_params = dict(reference.named_parameters())
        errs["grads"] = max(rel_err(p.grad, ref_params[n].grad) for n, p in model.named_parameters())
        out[name] = errs
    return out


@pytest.mark.world(2)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batches_labelled_the_hf_way_match_unsharded(worlds, family):
    """Left, right and mixed padding with HF's labels: prepare_batch leaves padded queries
    and targets unscored, so loss and gradients are the unsharded model's with the same
    labels (padded_labels); before, a left-padded row's last padding query was scored."""
    per_rank = worlds(2).run(padded_batches_match_unsharded, family, timeout=180)
    failures = [f"rank {rank} {padding}: {what} rel err {err:.3g}" for rank, errs in enumerate(per_rank)
                for padding, by in errs.items() for what, err in by.items() if not err <= TOL]
    assert not failures, "\n".join(failures)


def test_padded_labels_leave_padded_queries_and_targets_unscored():
    labels = torch.arange(1, 7).expand(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = ringflash.hf.padded_labels(labels, mask)
    # row 0: padding at 0, 1; token 2 follows padding (its query, 1, is padding)
    # row 1: padding at 4, 5 (token 5 also follows padding)
    assert got.tolist() == [[-100, -100, -100, 4, 5, 6], [1, 2, 3, 4, -100, -100]]


def moved_evaluated_and_generated(rank, world):
    """What a framework does with the prepared batch: (errors, what misuse raised)."""
    reference, model = tiny_models()
    sp = ringflash.SequenceParallel()
    ids, labels = _batch(seqlen=8 * world)
    batch = ringflash.hf.prepare_batch(sp, ids, labels=labels)
    # a copy of every tensor, as batch.to(device) or the Trainer's _prepare_inputs make
    moved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    want = reference(input_ids=ids, labels=labels)
    errs = {"moved loss": rel_err(sp.reduce_loss(model(**moved).loss), want.loss)}
    model.eval()
    reference.eval()
    with torch.no_grad():
        errs["eval loss"] = rel_err(sp.reduce_loss(model(**batch).loss), reference(input_ids=ids, labels=labels).loss)
        embeds = model.get_input_embeddings()(ids)
        by_embeds = ringflash.hf.prepare_batch(sp, inputs_embeds=embeds, labels=labels)
        errs["inputs_embeds loss"] = rel_err(sp.reduce_loss(model(**by_embeds).loss), want.loss)
        prompt = ids[:1, :5]
        with ringflash.hf.unsharded(model):
            generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
        errs["generated"] = float((generated != reference.generate(prompt, max_new_tokens=4, do_sample=False)).sum())
    misuse = {
        "generate without unsharded": _raises(lambda: model.generate(prompt, max_new_tokens=2, do_sample=False)),
        "other positions": _raises(lambda: model(**{**moved, "position_ids": moved["position_ids"] + 1})),
        "different batches": _raises(lambda: ringflash.hf.prepare_batch(sp, ids + rank, labels=labels)),
        "different labels": _raises(lambda: ringflash.hf.prepare_batch(sp, ids, labels=labels.roll(rank, 1))),
    }
    return errs, misuse, model.config._attn_implementation


@pytest.mark.world(2)
def test_moved_batch_evaluation_and_generation(worlds):
    """A copied batch trains as the prepared one; model.eval() under no_grad, and
    inputs_embeds, give the unsharded loss; generate runs unsharded inside
    ringflash.hf.unsharded (greedy tokens equal) and is refused naming it outside; other
    positions and ranks fed different batches raise on every rank."""
    per_rank = worlds(2).run(moved_evaluated_and_generated, timeout=180)
    for rank, (errs, misuse, attn) in enumerate(per_rank):
        assert errs.pop("generated") == 0, f"rank {rank}"
        assert all(err <= TOL for err in errs.values()), (rank, errs)
        assert attn == ringflash.hf.ATTN_IMPLEMENTATION
        assert "unsharded" in (misuse["generate without unsharded"] or ""), misuse
        assert "position_ids" in (misuse["other positions"] or ""), misuse
        assert "different input_ids" in (misuse["different batches"] or ""), misuse
        assert "different labels" in (misuse["different labels"] or ""), misuse


def softcapped_model_error(rank, world):
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, max_position_embeddings=128)
    _, model = tiny_models(config=config, model_cls=transformers.Gemma2ForCausalLM)
    ids, _ = _batch(seqlen=16)
    return _raises(lambda: model(**ringflash.hf.prepare_batch(ringflash.SequenceParallel(), ids)))


@pytest.mark.world(1)
def test_softcapping_error_names_the_config_field(worlds):
    error = worlds(1).run(softcapped_model_error, timeout=180)[0]
    assert error is not None and "attn_logit_softcapping" in error, error


def test_reference_refuses_torchrun(monkeypatch):
    """hf_finetune.py --reference under torchrun would train one unsharded copy a rank."""
    spec = importlib.util.spec_from_file_location("ringflash_hf_finetune_main", ROOT / "launch" / "hf_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="not under torchrun"):
        module.main(["--reference"])
