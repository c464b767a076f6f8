"Proofs for workbench.packing: properties over random inputs, packed == padded on a real model, trainer interop."
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from workbench.core import IGNORE_INDEX, check_packed_batch
from workbench.samples import load_sample, load_tokenizer
from workbench.tiny_models import tiny_model
from workbench.packing import (FlatteningCollator, NaiveConcatCollator, PackedStream, PaddingCollator,
                               TokenBudgetSampler, packing_report, per_example_logits, plan_bins)

# ---------------------------------------------------------------- properties of the collator

examples = st.lists(st.integers(1, 40), min_size=1, max_size=12).flatmap(
    lambda lens: st.tuples(*[st.tuples(st.lists(st.integers(1, 999), min_size=n, max_size=n),
                                       st.lists(st.integers(0, 1), min_size=n, max_size=n),
                                       st.booleans()) for n in lens]))


@settings(max_examples=150, deadline=None)
@given(examples, st.sampled_from([None, 1, 2, 8, 64]), st.integers(0, 2), st.booleans())
def test_flattening_properties(exs, multiple, start, with_labels):
    feats = []
    for ids, mask, use_mask in exs:
        f = {"input_ids": ids}
        if with_labels: f["labels"] = [i + 1000 for i in ids]
        if use_mask: f["completion_mask"] = mask
        feats.append(f)
    if len({"completion_mask" in f for f in feats}) > 1:  # a batch has one schema
        for f, (ids, mask, _) in zip(feats, exs): f["completion_mask"] = mask
    b = FlatteningCollator(pad_to_multiple_of=multiple, position_ids_start=start, return_seq_idx=True,
                           train_all_tokens=True)(feats)
    lens = [len(f["input_ids"]) for f in feats]
    total, T = sum(lens), b["input_ids"].shape[1]
    # every token of every example exactly once, in order; padding only after them
    assert b["input_ids"][0, :total].tolist() == [t for f in feats for t in f["input_ids"]]
    if multiple: assert T % multiple == 0 and T - total < multiple
    else: assert T == total
    cu = b["cu_seq_lens_q"].tolist()
    assert cu[: len(lens) + 1] == np.cumsum([0, *lens]).tolist() and cu[-1] == T
    assert b["max_length_q"] == max(np.diff(cu))
    pos, labels = b["position_ids"][0].tolist(), b["labels"][0].tolist()
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        assert pos[lo:hi] == list(range(start, start + hi - lo))  # restart per example
        assert labels[lo] == IGNORE_INDEX                          # no cross-example target
        assert b["seq_idx"][0, lo:hi].tolist() == [i] * (hi - lo)
        if i < len(feats):
            f = feats[i]
            want = f.get("labels", f["input_ids"])
            for j in range(1, hi - lo):
                masked = "completion_mask" in f and f["completion_mask"][j] == 0
                assert labels[lo + j] == (IGNORE_INDEX if masked else want[j])
        else:
            assert set(labels[lo:hi]) == {IGNORE_INDEX}  # the dummy padding example trains nothing
    assert "attention_mask" not in b


def test_bad_input_names_example_and_fix():
    c = FlatteningCollator(max_tokens=16)
    cases = [([], "empty feature list"),
             ([{"input_ids": [1, 2]}, {"input_ids": []}], "example 1 is empty"),
             ([{"input_ids": [1, 2]}, {"input_ids": [1.0, 2.5]}], "example 1: input_ids must hold integers"),
             ([{"input_ids": ["a", "b"]}], "example 0: input_ids must hold integers"),
             ([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}],
              "example 1: labels has 1"),
             ([{"input_ids": [1]}, {"input_ids": [1] * 20}], "example 1 has 20 tokens, over the budget"),
             ([{"input_ids": [1] * 10}, {"input_ids": [1] * 10}], "TokenBudgetSampler"),
             ([{"input_ids": [1]}, {"text": "hi"}], "example 1 has no 'input_ids'")]
    for feats, msg in cases:
        with pytest.raises(ValueError, match=msg): c(feats)


def test_arguments_and_ids_are_named_with_their_fix():
    "Issue 47: each of these failed deep inside numpy, or succeeded wrongly, before (the old outcome is beside it)."
    ids = lambda *a: [{"input_ids": np.array(x, dtype=d)} for x, d in a]
    collate = FlatteningCollator(train_all_tokens=True)
    big = np.array([1, 2**63], dtype=np.uint64)
    cases = {  # name: (the call, words of its error)
        "pad -4": (lambda: FlatteningCollator(pad_to_multiple_of=-4),  # negative dimensions are not allowed
                   "pad_to_multiple_of must be a positive integer, got -4"),
        "pad 2.5": (lambda: FlatteningCollator(pad_to_multiple_of=2.5), "got 2.5"),  # expected a sequence of integers
        "padding pad -2": (lambda: PaddingCollator(pad_to_multiple_of=-2),  # boolean index cannot assign 3 values to 2
                           "got -2: the row's length is rounded up"),
        "pad past max_tokens": (lambda: FlatteningCollator(pad_to_multiple_of=4, max_tokens=3),  # a 4-token row
                                "max_tokens=3 is not a multiple of pad_to_multiple_of=4"),
        "a generator": (lambda: collate(f for f in [{"input_ids": [1, 2]}]),  # object of type 'generator' has no len()
                        "got a generator: pass list(...)"),
        "uint64 past int64": (lambda: collate(ids(([1, 2**63 + 5], np.uint64))),  # wrapped to -9223372036854775803
                              "example 0: input_ids holds 9223372036854775813"),
        "int past int64 in a list": (lambda: collate([{"input_ids": [1, 2]}, {"input_ids": [3, 2**64]}]),
                                     "example 1: input_ids holds 18446744073709551616"),
        "labels past int64": (lambda: collate([{"input_ids": [1, 2], "labels": big}]), "example 0: labels holds"),
        "capacity 8.5": (lambda: plan_bins([2, 3], 8.5), "capacity must be a positive integer, got 8.5"),  # slice index
        "capacity '8'": (lambda: plan_bins([2, 3], "8"), "got '8'"),  # '<' not supported between 'str' and 'int'
        "float lengths": (lambda: plan_bins([2.7, 3], 8), "example 0 has 2.7: pass whole numbers"),  # has shape []
        "batch_size 0": (lambda: packing_report([3, 4, 5], batch_size=0),  # integer division or modulo by zero
                         "batch_size must be a positive integer, got 0"),
        "batch_size -1": (lambda: packing_report([3, 4, 5], batch_size=-1), "got -1"),  # only one unknown dimension
    }
    for name, (call, words) in cases.items():
        with pytest.raises((ValueError, TypeError)) as e: call()
        assert words in str(e.value), (name, str(e.value))
    mixed = collate(ids(([1, 2], np.int64), ([3, 2**63 - 1], np.uint64)))  # before: TypeError: not all integers
    assert mixed["input_ids"].tolist() == [[1, 2, 3, 2**63 - 1]]
    padded = FlatteningCollator(pad_to_multiple_of=4, max_tokens=8, train_all_tokens=True)(ids(([1] * 5, np.int64)))
    assert padded["input_ids"].shape == (1, 8)


def test_no_silent_drop_of_columns():
    with pytest.warns(UserWarning, match="source"):
        b = FlatteningCollator(train_all_tokens=True)([{"input_ids": [1, 2], "source": "x"},
                                                       {"input_ids": [3], "source": "y"}])
    assert b["input_ids"].tolist() == [[1, 2, 3]]

# ---------------------------------------------------------------- properties of the planner and sampler


def reference_bfd(lengths, capacity):
    """One item at a time: the textbook best-fit decreasing; returns the
    sorted bin totals (invariant to tie-breaking among equal rooms)."""
    rooms, contents = [], []
    for L in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(rooms) if r >= L]
        if fits:
            i = min(fits, key=lambda i: rooms[i]); rooms[i] -= L; contents[i].append(L)
        else:
            rooms.append(capacity - L); contents.append([L])
    return sorted(sum(c) for c in contents)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=200), st.integers(1, 64),
       st.sampled_from(["truncate", "split", "drop"]), st.integers(0, 3))
def test_plan_properties(lengths, capacity, overlong, seed):
    plan = plan_bins(lengths, capacity, overlong=overlong, seed=seed)
    lengths = np.array(lengths)
    over = lengths > capacity
    assert all(plan.length[b].sum() <= capacity for b in plan.bins)
    pieces = np.concatenate(plan.bins) if plan.bins else np.array([], dtype=int)
    assert sorted(pieces.tolist()) == list(range(len(plan.length)))  # every piece in exactly one bin
    kept = set(plan.example.tolist())
    assert kept == set(np.flatnonzero(~over).tolist()) | (set(np.flatnonzero(over).tolist()) if overlong != "drop"
                                                          else set())
    if overlong == "drop": assert plan.dropped == over.sum() and plan.lost_tokens == lengths[over].sum()
    if overlong == "truncate":
        assert plan.truncated == over.sum() and plan.lost_tokens == (lengths[over] - capacity).sum()
    if overlong == "split":
        assert plan.split == over.sum()
        for e in np.flatnonzero(over):  # the pieces of a split example tile it exactly
            p = np.flatnonzero(plan.example == e)
            assert (plan.offset[p].tolist() == list(range(0, lengths[e], capacity))
                    and plan.length[p].sum() == lengths[e])
    assert reference_bfd(plan.length.tolist(), capacity) == sorted(plan.bin_tokens.tolist())
    assert plan_bins(lengths, capacity, overlong=overlong, seed=seed).bins.__len__() == len(plan.bins)


def test_plan_deterministic_and_errors():
    lengths = np.random.default_rng(0).integers(1, 300, 5000)
    a, b = plan_bins(lengths, 1024, seed=7), plan_bins(lengths, 1024, seed=7)
    assert all((x == y).all() for x, y in zip(a.bins, b.bins))
    with pytest.raises(ValueError, match="example 2 has length 0"): plan_bins([3, 4, 0], 8)
    with pytest.raises(ValueError, match="overlong='truncate'"): plan_bins([3, 9], 8)
    with pytest.raises(ValueError, match="overlong must be one of"): plan_bins([3], 8, overlong="wrap")


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_sampler_covers_balances_and_resumes(replicas):
    lengths = np.random.default_rng(1).integers(1, 500, 3000)
    plan = plan_bins(lengths, 2048)
    samplers = [TokenBudgetSampler(plan, seed=5, num_replicas=replicas, rank=r) for r in range(replicas)]
    for epoch in (0, 1):
        per_rank = [list(s) for s in samplers]
        assert len({len(p) for p in per_rank}) == 1  # same number of steps everywhere
        served = [i for p in per_rank for batch in p for i in batch]
        # repeats counted, nothing lost
        assert len(served) == sum(len(plan.bins[b]) for b in samplers[0].steps.reshape(-1))
        assert samplers[0].steps.size == len(plan.bins) + samplers[0].repeated
        assert set(served) == set(range(len(plan.length)))
        assert all(plan.length[b].sum() <= 2048 for p in per_rank for b in p)
    s = samplers[0]; s.set_epoch(3)
    it = iter(s); [next(it) for _ in range(4)]
    state = s.state_dict()
    rest = list(it)
    r = TokenBudgetSampler(plan, seed=5, num_replicas=replicas, rank=0); r.load_state_dict(state)
    assert list(r) == rest
    e3 = TokenBudgetSampler(plan, seed=5, num_replicas=replicas); e3.set_epoch(3)
    e4 = TokenBudgetSampler(plan, seed=5, num_replicas=replicas); e4.set_epoch(4)
    assert list(e3) != list(e4)  # a new order every epoch

# ---------------------------------------------------------------- no step trains nothing


@pytest.fixture(scope="module")
def flan_all():
    "The whole shipped FLAN-like sample, tokenized (4,000 examples, prompts masked by completion_mask)."
    return load_sample("flan_like", load_tokenizer())


def _served_targets(plan, feats) -> list[list[tuple[int, int]]]:
    """Per bin, the (example, position) of every target the packed row trains, read from what the collator and the
    loss see (labels shifted by one, -100 ignored), not from the planner's own counts."""
    pieces, collate, out = plan.dataset(feats), FlatteningCollator(), []
    for b in plan.bins:
        row = collate([pieces[int(i)] for i in b])
        trained = np.flatnonzero(row["labels"][0, 1:].numpy() != IGNORE_INDEX) + 1  # a target: a label the shift keeps
        # row position -> token
        where = np.concatenate([int(plan.offset[i]) + np.arange(int(plan.length[i])) for i in b])
        whose = np.repeat(plan.example[b], plan.length[b])
        out.append(list(zip(whose[trained].tolist(), where[trained].tolist())))
    return out


def _check_every_step_trains(plan, feats, capacity):
    "Every bin trains a target, and the targets trained over the plan are those of the data, each exactly once."
    from collections import Counter
    served = _served_targets(plan, feats)
    idle = [i for i, t in enumerate(served) if not t]
    assert not idle, f"{len(idle)} of {len(plan.bins)} bins train nothing (e.g. bin {idle[0]})"
    # the data's targets: completion tokens but each example's first; a split example's piece starts at multiples of
    # the capacity have no token before them in their piece, so no piece can train them (the cost of splitting)
    data = Counter((e, p) for e, f in enumerate(feats)
                   for p in np.flatnonzero(np.asarray(f["completion_mask"])).tolist()
                   if p > 0 and (len(f["input_ids"]) <= capacity or p % capacity))
    assert Counter(t for ts in served for t in ts) == data


def test_flan_like_every_step_trains_and_every_target_once(flan_all):
    "At --max-tokens 256 on the shipped FLAN-like data every bin (a step's row) trains, and every trained token once."
    plan = plan_bins(flan_all, 256, overlong="split")
    _check_every_step_trains(plan, flan_all, 256)
    old = plan_bins(flan_all, 256, overlong="split", untrained="keep")  # the old behaviour: prompt-only pieces kept
    with pytest.raises(AssertionError, match=r"453 of 2631 bins train nothing"):
        _check_every_step_trains(old, flan_all, 256)
    assert len(plan.bins) < len(old.bins) and (plan.fill, old.fill) > (0.99, 0.99)


def test_untrained_pieces_are_counted(flan_all):
    """The plan counts the pieces it left out and their tokens:
    exactly the pieces that train no target, found independently."""
    old = plan_bins(flan_all, 256, overlong="split", untrained="keep")
    pieces, collate = old.dataset(flan_all), FlatteningCollator()
    idle = [i for i in range(len(old.length)) if not (collate([pieces[i]])["labels"][0, 1:] != IGNORE_INDEX).any()]
    plan = plan_bins(flan_all, 256, overlong="split")
    assert (plan.untrained, plan.untrained_tokens) == (len(idle), int(old.length[idle].sum())) and len(idle) > 0
    assert (len(plan.length) == len(old.length) - len(idle)
            and plan.length.sum() == old.length.sum() - plan.untrained_tokens)
    assert (plan.split, plan.lost_tokens, old.untrained) == (old.split, 0, 0)
    assert f"untrained pieces dropped {len(idle)} ({old.length[idle].sum()} tokens)" in repr(plan)
    assert "bins training none 0)" in repr(plan) and ("bins training none "
                                                      f"{int((old.bin_trained == 0).sum())})") in repr(old)
    assert plan.trained.sum() == old.trained.sum() and plan.bin_trained.min() >= 1
    stream = PackedStream(flan_all, 256, buffer_size=500, overlong="split")  # the stream leaves out the same pieces
    bins = list(stream)
    assert (stream.report.untrained, stream.report.untrained_tokens) == (plan.untrained, plan.untrained_tokens)
    row = lambda b: FlatteningCollator()(b)["labels"][0, 1:]
    assert all((row(b) != IGNORE_INDEX).any() for b in bins)
    assert "untrained pieces dropped" in repr(stream.report)


def test_untrained_policy_small_cases():
    "A piece's first token is no one's target; labels, masks and documents say the rest; bare lengths cannot tell."
    feats = [{"input_ids": list(range(10)), "completion_mask": [0] * 8 + [1, 1]}, {"input_ids": [7, 8, 9]}]
    plan = plan_bins(feats, 4, overlong="split")  # pieces [0, 4) and [4, 8) are prompt; [8, 10) trains token 9 only
    assert (plan.example.tolist(), plan.offset.tolist(), plan.trained.tolist()) == ([0, 1], [8, 0], [1, 2])
    assert (plan.untrained, plan.untrained_tokens) == (2, 8)
    assert [plan.dataset(feats)[i]["input_ids"] for i in range(2)] == [[8, 9], [7, 8, 9]]
    kept = plan_bins(feats, 4, overlong="split", untrained="keep")
    assert (kept.trained.tolist(), kept.untrained) == ([0, 0, 1, 2], 0)
    one = plan_bins([{"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 0, 0, 1]}], 4, overlong="split")
    assert (len(one.bins), one.untrained, one.untrained_tokens) == (0, 2, 5)  # token 4 starts its piece: nothing trains
    labels = plan_bins([{"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, -100]}], 2, overlong="split")
    # label 3 starts its piece
    assert (labels.offset.tolist(), labels.trained.tolist(), labels.untrained) == ([0], [1], 1)
    docs = plan_bins([{"input_ids": [1, 2, 3, 4], "seq_lengths": [2, 1, 1]}], 4)  # TRL rows: documents start at 0, 2, 3
    assert docs.trained.tolist() == [1]
    with pytest.raises(ValueError, match=r"example 1: seq_lengths \[2, 2\] must be "
                                         r"positive document lengths summing to its 3"):
        plan_bins([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}], 4)
    bare = plan_bins([10, 3], 4, overlong="split")  # lengths carry no labels: every piece kept, the counts unknown
    assert (len(bare.length), bare.untrained, bare.trained, bare.bin_trained) == (4, 0, None, None)
    assert "trained targets unknown: planned from bare lengths" in repr(bare)
    with pytest.raises(ValueError, match=r"untrained must be one of \('drop', 'keep'\)"):
        plan_bins([3], 8, untrained="skip")
    with pytest.raises(ValueError, match="untrained must be one of"): PackedStream(feats, 4, untrained=True)
    with pytest.raises(ValueError, match="does none of it train"): TokenBudgetSampler(one)
    s = PackedStream(feats, 4, overlong="split"); it = iter(s); next(it)
    # a state saved before the policy: every piece kept
    old = {k: v for k, v in s.state_dict().items() if k != "untrained"}
    with pytest.raises(ValueError, match="state was saved with untrained='keep' but this stream has untrained='drop'"):
        PackedStream(feats, 4, overlong="split").load_state_dict(old)
    PackedStream(feats, 4, overlong="split", untrained="keep").load_state_dict(old)


# ---------------------------------------------------------------- packed == padded on a real model


@pytest.fixture(scope="module")
def flan():
    return load_sample("flan_like", load_tokenizer(), limit=64)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded_logits_loss_grads(flan, attn):
    model = tiny_model("llama", attn_implementation=attn).train()  # train mode: dropout is 0 in the tiny config
    ex = flan[:8]
    lens = [len(f["input_ids"]) for f in ex]

    def run(collator):
        model.zero_grad()
        batch = collator(ex)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        logits = per_example_logits(model, batch, lens)
        return out.loss.detach(), [l.detach() for l in logits], {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_pad, log_pad, g_pad = run(PaddingCollator())
    loss_pack, log_pack, g_pack = run(FlatteningCollator())
    loss_naive, log_naive, _ = run(NaiveConcatCollator())
    assert max((a - b).abs().max().item() for a, b in zip(log_pack, log_pad)) <= 1e-5
    assert abs(loss_pack - loss_pad) <= 1e-6
    for n in g_pad:
        assert torch.allclose(g_pack[n], g_pad[n], atol=1e-6, rtol=1e-4), n
    assert max((a - b).abs().max().item() for a, b in zip(log_naive, log_pad)) > 1e-2  # the contaminated way differs
    assert abs(loss_naive - loss_pad) > 1e-4


def test_cache_trap_is_real(flan):
    """With use_cache left at its default, transformers builds a cache
    and ignores packed boundaries: the reason for use_cache=False."""
    model = tiny_model("llama", attn_implementation="sdpa")
    ex = flan[:4]
    batch = {k: v for k, v in FlatteningCollator()(ex).items() if k != "labels"}
    good = model(**batch, use_cache=False).logits
    trap = model(**batch).logits
    assert (good - trap).abs().max() > 1e-2

# ---------------------------------------------------------------- interop: HF Trainer and TRL SFTTrainer


def _dataset(flan):
    from datasets import Dataset
    return Dataset.from_list([{"input_ids": f["input_ids"], "completion_mask": f["completion_mask"]}
                              for f in flan[:24]])


def test_trl_sft_trainer_three_steps(flan, tmp_path):
    from trl import SFTConfig, SFTTrainer
    model = tiny_model("llama", attn_implementation="sdpa").train()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, report_to=[],
                     logging_steps=1,
                     save_strategy="no", use_cpu=True, completion_only_loss=True)  # padding-free via our collator
    trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(flan), processing_class=load_tokenizer(),
                         data_collator=FlatteningCollator())
    batch = next(iter(trainer.get_train_dataloader()))
    check_packed_batch(batch)
    masks = {tuple(f["input_ids"]): f["completion_mask"] for f in flan[:24]}
    cu, ids, labels = batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    # TRL folded completion_mask into labels; our collator kept them and the boundaries
    for lo, hi in zip(cu[:-1], cu[1:]):
        mask = masks[tuple(ids[lo:hi])]
        assert labels[lo:hi] == [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(ids[lo + 1:hi], mask[1:])]
    out = trainer.train()
    assert out.global_step == 3


# ---------------------------------------------------------------- the fast path equals the general path (issue 31)

from unittest import mock

import workbench.packing as packing_mod

_OPTIONS = st.fixed_dictionaries({"pad_to_multiple_of": st.sampled_from([None, 1, 8, 64]),
                                  "position_ids_start": st.integers(0, 2),
                                  "return_seq_idx": st.booleans(), "return_flash_attn_kwargs": st.booleans(),
                                  "separator_id": st.sampled_from([IGNORE_INDEX, 0]),
                                  "return_tensors": st.sampled_from(["pt", "np"])})
_COLUMNS = st.sets(st.sampled_from(["labels", "completion_mask", "assistant_masks", "attention_mask",
                                    "token_type_ids"]))


def _column(key, ids, draw):
    if key == "labels": return [draw(st.sampled_from([i, IGNORE_INDEX])) for i in ids]
    if key == "attention_mask": return [1] * len(ids)
    return draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))


@st.composite
def list_batches(draw):
    """Batches of dicts of flat lists; `uniform` says whether every
    example carries the same columns (the fast path's batch)."""
    lens = draw(st.lists(st.integers(1, 30), min_size=1, max_size=10))
    columns, uniform = draw(_COLUMNS), draw(st.booleans())
    feats = []
    for n in lens:
        ids = draw(st.lists(st.integers(1, 999), min_size=n, max_size=n))
        f = {"input_ids": ids}
        for key in sorted(columns):
            if uniform or key == "token_type_ids" or draw(st.booleans()): f[key] = _column(key, ids, draw)
        feats.append(f)
    return feats


def _collate(feats, options, fast: bool):
    "The collator's batch with the fast path on, or forced off (the general path alone)."
    collate = FlatteningCollator(train_all_tokens=True, **options)
    if fast: return collate([dict(f) for f in feats])
    with mock.patch.object(packing_mod, "_flatten_lists", lambda *a, **k: None):
        return collate([dict(f) for f in feats])


def _same_batch(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert type(x) is type(y), k
        if isinstance(x, (torch.Tensor, np.ndarray)):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), k
        else: assert x == y, k


@settings(max_examples=200, deadline=None)
@given(list_batches(), _OPTIONS)
def test_fast_path_equals_general_path(feats, options):
    taken = packing_mod._flatten_lists(feats) is not None
    uniform = all(f.keys() == feats[0].keys() for f in feats)
    assert taken == uniform  # every list batch with one set of columns is the fast path's, no other
    _same_batch(_collate(feats, options, fast=True), _collate(feats, options, fast=False))


def test_fast_path_taken_and_refused():
    """The comparison above is not vacuous: the fast path answers a
    Dataset-like batch and leaves every other to the general path."""
    same = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "completion_mask": [0, 1, 1]},
            {"input_ids": [8, 9], "labels": [8, -100], "completion_mask": [1, 1]}]
    assert packing_mod._flatten_lists(same) is not None
    b = FlatteningCollator(pad_to_multiple_of=4)(same)
    assert b["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, -100, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    _same_batch(b, _collate(same, {"pad_to_multiple_of": 4}, fast=False))
    refused = [[{"input_ids": torch.tensor([[5, 6, 7]])}, {"input_ids": [8, 9]}],
               [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9]}],
               [{"input_ids": [5, 6, 7, 8], "seq_lengths": [2, 2]}],
               [{"input_ids": [5, 6], "attention_mask": [1, 0]}]]
    for feats in refused: assert packing_mod._flatten_lists(feats) is None
    for feats in refused[:3]: _same_batch(FlatteningCollator(train_all_tokens=True)(feats),
                                          _collate(feats, {}, fast=False))
    with pytest.raises(ValueError, match="attention_mask has zeros"):
        FlatteningCollator(train_all_tokens=True)(refused[3])
    with pytest.raises(ValueError, match="must hold integers"):
        FlatteningCollator(train_all_tokens=True)([{"input_ids": [5, 6.0]}])
