"""Proofs for issue 13's packing rules: every example read, TRL's
packed rows, exact sampler state under workers, plan size."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader

from workbench.core import IGNORE_INDEX, check_packed_batch
from workbench.samples import load_sample, load_tokenizer
from workbench.tiny_models import tiny_model
from workbench.packing import (FlatteningCollator, NaiveConcatCollator, PaddingCollator, ResumableLoader,
                               TokenBudgetSampler, flatten_features, per_example_logits, plan_bins)

# ---------------------------------------------------------------- every example read, whatever its types

FORMS = ("list", "nested", "numpy", "tensor", "tensor1T")


def as_form(values, form, dtype=torch.int64):
    "One example's column in one of the forms users hand over: list, [[...]], numpy [T], tensor [T] or [1, T]."
    if form == "list": return list(values)
    if form == "nested": return [list(values)]
    if form == "numpy": return np.array(values, dtype=np.int64)
    t = torch.tensor(values, dtype=dtype)
    return t[None] if form == "tensor1T" else t


def values(n: int, seed: int, labels: bool, mask: bool) -> dict:
    """One example's `n` ids, and its labels and mask where it has them, from `seed`: Hypothesis draws the structure,
    numpy the values (a Hypothesis draw per token made this the slowest test of the suite)."""
    rng = np.random.default_rng(seed)
    return dict(ids=rng.integers(0, 1000, n).tolist(),
                labels=rng.choice([IGNORE_INDEX, 7, 8, 9], n).tolist() if labels else None,
                mask=rng.integers(0, 2, n).tolist() if mask else None)


example = st.builds(lambda drawn, rest: {**drawn, **rest},
                    st.builds(values, st.integers(1, 30), st.integers(0, 2**32 - 1), st.booleans(), st.booleans()),
                    st.fixed_dictionaries({
    "mask_key": st.sampled_from(["completion_mask", "assistant_masks"]),
    "mask_none": st.booleans(),  # a datasets.Dataset gives None where a row lacks the column
    "docs": st.one_of(st.none(), st.lists(st.integers(1, 6), min_size=1, max_size=5)),  # TRL's seq_lengths
    "form": st.sampled_from(FORMS), "label_form": st.sampled_from(FORMS), "mask_form": st.sampled_from(FORMS)}))


def build(ex):
    "The feature dict of one drawn example, and the document lengths it must come out as."
    n = len(ex["ids"])
    f = {"input_ids": as_form(ex["ids"], ex["form"])}
    if ex["labels"] is not None: f["labels"] = as_form(ex["labels"], ex["label_form"])
    if ex["mask"] is not None: f[ex["mask_key"]] = as_form(ex["mask"], ex["mask_form"], torch.bool)
    elif ex["mask_none"]: f["completion_mask"] = None
    docs = [n]
    if ex["docs"] is not None:  # cut the row into documents as TRL's pack_dataset does
        cuts = sorted({min(c, n) for c in np.cumsum(ex["docs"])} - {n})
        docs = np.diff([0, *cuts, n]).tolist()
        f["seq_lengths"] = docs
    return f, docs


@settings(max_examples=1500, deadline=None)
@given(st.lists(example, min_size=1, max_size=8), st.sampled_from([None, 1, 8]))
def test_collators_read_every_example(exs, multiple):
    feats, docs = zip(*map(build, exs))
    b = FlatteningCollator(pad_to_multiple_of=multiple, return_seq_idx=True, train_all_tokens=True)(list(feats))
    lens = [d for ds in docs for d in ds]
    total = sum(lens)
    assert b["input_ids"][0, :total].tolist() == [t for ex in exs for t in ex["ids"]]  # every token once, in order
    cu = b["cu_seq_lens_q"].tolist()
    assert cu[:len(lens) + 1] == np.cumsum([0, *lens]).tolist()  # documents, then the dummy padding example
    labels, pos = b["labels"][0].tolist(), b["position_ids"][0].tolist()
    want, masks = [], {k: [] for k in ("completion_mask", "assistant_masks") if k in b}
    for ex, ds in zip(exs, docs):  # the rule, per example: its own labels (or ids), -100 where its own mask is 0
        own = ex["labels"] if ex["labels"] is not None else ex["ids"]
        keep = ex["mask"] if ex["mask"] is not None else [1] * len(ex["ids"])
        starts = set(np.cumsum([0, *ds[:-1]]).tolist())  # and at every document's first token
        want += [IGNORE_INDEX if j in starts or not m else t for j, (t, m) in enumerate(zip(own, keep))]
        for k in masks: masks[k] += keep if ex["mask"] is not None and ex["mask_key"] == k else [1] * len(keep)
    assert labels[:total] == want and set(labels[total:]) <= {IGNORE_INDEX}
    for k, m in masks.items(): assert b[k][0, :total].tolist() == m  # the carried mask: ones where an example had none
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        assert pos[lo:hi] == list(range(hi - lo)) and b["seq_idx"][0, lo:hi].tolist() == [i] * (hi - lo)
    check_packed_batch(b)
    p = PaddingCollator()(list(feats))  # the baselines read the same documents
    assert p["input_ids"].shape[0] == len(lens) and p["attention_mask"].sum(1).tolist() == lens
    flat = flatten_features(list(feats))
    assert p["labels"][p["attention_mask"].bool()].tolist() == flat.labels.tolist()
    assert NaiveConcatCollator()(list(feats))["input_ids"][0].tolist() == b["input_ids"][0, :total].tolist()


@pytest.mark.parametrize("feats, msg", [
    ([{"input_ids": torch.ones(2, 3, dtype=torch.long)}], r"example 0: input_ids has shape \[2, 3\]"),
    ([{"input_ids": [1]}, {"input_ids": torch.tensor(3)}], r"example 1: input_ids has shape \[\]"),
    ([{"input_ids": torch.tensor([1.0, 2.0])}], "example 0: input_ids must hold integers, got a torch.float32"),
    ([{"input_ids": np.array([1.5, 2.0])}], "example 0: input_ids must hold integers"),
    ([{"input_ids": torch.tensor([1, 2])}, {"input_ids": [3, 4.5]}], "example 1: input_ids must hold integers"),
    ([{"input_ids": [1, 2], "labels": np.array([1, 2])}, {"input_ids": [3, 4], "labels": [3, 4.5]}],
     "example 1: labels must hold integers"),
    ([{"input_ids": [1, 2]}, {"input_ids": [1, 2], "completion_mask": torch.tensor([[1]])}],
     "example 1: completion_mask has 1 entries"),
    ([{"input_ids": [1, 2], "labels": torch.tensor(5)}], r"example 0: labels has shape \[\]"),
    ([{"input_ids": [1, 2], "token_type_ids": [0, 0]}, {"input_ids": [3]}], "example 1 lacks 'token_type_ids'"),
    ([{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [3, 4], "attention_mask": [1, 0]}],
     "example 1: attention_mask has zeros"),
    ([{"input_ids": [1, 2], "seq_lengths": [3]}], r"example 0: seq_lengths \[3\] must be "
                                                  r"positive document lengths summing to its 2"),
    ([{"input_ids": [1, 2], "seq_lengths": [2, 0]}], "must be positive"),
    ([{"input_ids": [1, 2, 3], "position_ids": [0, 1, 0], "seq_lengths": [1, 2]}], "disagree with the documents"),
    ([{"input_ids": [[1, 2], [3]]}], "example 0: input_ids is ragged"),
    ([[1, 2, 3]], "example 0 is a list, not a dict"),
])
def test_bad_input_names_example_column_and_shape(feats, msg):
    with pytest.raises(ValueError, match=msg): FlatteningCollator()(feats)


def test_position_ids_restarts_are_documents():
    "Rows carrying restarting position_ids (what some packers emit instead of seq_lengths) are unpacked the same way."
    a = FlatteningCollator(train_all_tokens=True)([{"input_ids": [5, 6, 7, 8], "position_ids": [0, 1, 0, 1]}])
    b = FlatteningCollator(train_all_tokens=True)([{"input_ids": [5, 6, 7, 8], "seq_lengths": [2, 2]}])
    assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"))
    assert a["labels"].tolist() == [[IGNORE_INDEX, 6, IGNORE_INDEX, 8]]

# ---------------------------------------------------------------- TRL's pack_dataset output


@pytest.fixture(scope="module")
def flan():
    return load_sample("flan_like", load_tokenizer(), limit=48)


def test_trl_pack_dataset_rows_equal_their_documents(flan):
    from datasets import Dataset
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # not exported at the top level
    capacity = max(len(f["input_ids"]) for f in flan)  # nothing truncated: every packed document is an original
    packed = pack_dataset(Dataset.from_list(flan), capacity, strategy="bfd")
    assert set(packed.column_names) == {"input_ids", "completion_mask", "seq_lengths"}  # TRL 1.x emits no position_ids
    rows, originals = packed.to_list(), {tuple(f["input_ids"]): f for f in flan}
    assert len(rows) < len(flan) and any(len(r["seq_lengths"]) > 1 for r in rows)
    model, collate = tiny_model("llama", attn_implementation="sdpa"), FlatteningCollator()
    trl = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    for batch_rows in (rows[:1], rows[1:4]):
        docs = []
        for r in batch_rows:
            cu = np.cumsum([0, *r["seq_lengths"]])
            docs += [originals[tuple(r["input_ids"][lo:hi])] for lo, hi in zip(cu[:-1], cu[1:])]  # each an original
        ours, direct = collate(batch_rows), collate(docs)
        assert sorted(ours) == sorted(direct)
        for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "completion_mask"):
            assert torch.equal(ours[k], direct[k]), k
        assert (direct["labels"] == IGNORE_INDEX).sum() > len(docs)  # the prompts are masked, not only the starts
        theirs = trl(batch_rows)  # TRL's own padding-free collator agrees on tokens and boundaries
        for k in ("input_ids", "position_ids", "cu_seq_lens_q"): assert torch.equal(ours[k], theirs[k]), k
        with torch.no_grad():
            lens = [len(d["input_ids"]) for d in docs]
            a, b = per_example_logits(model, ours, lens), per_example_logits(model, direct, lens)
            pad = per_example_logits(model, PaddingCollator()(batch_rows), lens)  # padded per document
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert max((x - y).abs().max().item() for x, y in zip(a, pad)) < 1e-5


def test_trl_rows_of_one_token_documents():
    "Every document of length 1: seq_lengths has as many entries as tokens and must still be read as boundaries."
    b = FlatteningCollator(train_all_tokens=True)([{"input_ids": [4, 5, 6], "seq_lengths": [1, 1, 1]}])
    assert b["position_ids"].tolist() == [[0, 0, 0]] and b["labels"].tolist() == [[IGNORE_INDEX] * 3]
    assert b["cu_seq_lens_q"].tolist() == [0, 1, 2, 3] and "seq_lengths" not in b


def test_planned_trl_rows_split_their_documents():
    "A packed row split by the planner keeps the documents of each piece."
    feats = [{"input_ids": list(range(10)), "seq_lengths": [3, 5, 2]}]
    plan = plan_bins([10], 4, overlong="split")
    pieces = plan.dataset(feats)
    assert [pieces[i]["seq_lengths"] for i in range(len(pieces))] == [[3, 1], [4], [2]]
    assert FlatteningCollator(train_all_tokens=True)([pieces[1]])["position_ids"].tolist() == [[0, 1, 2, 3]]


def test_planned_features_refuse_other_lengths():
    plan = plan_bins([3, 4], 8)
    with pytest.raises(ValueError, match="piece 1 is tokens \\[0, 4\\) of example 1, which has 2"):
        plan.dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2]}])[1]
    with pytest.raises(ValueError, match="the plan was made from other lengths"):
        plan.dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [1] * 6}])[1]
    one_t = plan.dataset([{"input_ids": torch.tensor([[1, 2, 3]])}, {"input_ids": torch.tensor([[4, 5, 6, 7]])}])
    assert one_t[1]["input_ids"].shape == (1, 4)  # [1, T] tensors count T tokens

# ---------------------------------------------------------------- the sampler's state is what the consumer received


def _loader(plan, feats, workers, replicas, rank):
    sampler = TokenBudgetSampler(plan, seed=3, num_replicas=replicas, rank=rank)
    return sampler, ResumableLoader(plan.dataset(feats), sampler, collate_fn=FlatteningCollator(train_all_tokens=True),
                                    num_workers=workers)


def _bin_of(batch) -> tuple:
    "The bin a packed batch came from: its example ids (each example's tokens all equal its id)."
    cu = batch["cu_seq_lens_q"].tolist()
    return tuple(sorted(int(batch["input_ids"][0, lo]) for lo in cu[:-1]))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("replicas", [1, 3])
def test_resume_under_workers_serves_each_bin_once(workers, replicas):
    rng = np.random.default_rng(workers * 10 + replicas)
    lengths = rng.integers(1, 60, 120)
    feats = [{"input_ids": [e] * int(n)} for e, n in enumerate(lengths)]
    plan = plan_bins(lengths, 128)
    for rank in range(replicas):
        sampler, loader = _loader(plan, feats, workers, replicas, rank)
        whole = [[_bin_of(b) for b in loader] for _ in range(2)]  # two uninterrupted epochs
        assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["consumed"] == 0
        sampler, loader = _loader(plan, feats, workers, replicas, rank)
        for epoch in range(2):
            stop = int(rng.integers(0, len(loader) + 1))  # stop consuming at a random point (0 and all steps included)
            got = []
            for b in loader if stop else ():
                got.append(_bin_of(b))
                if len(got) == stop: break
            state = sampler.state_dict()  # what the consumer received, though workers fetched ahead
            assert (state["epoch"], state["consumed"]) == ((epoch, stop) if stop < len(loader) else (epoch + 1, 0))
            del loader, sampler  # the kill: a new sampler and loader continue from the saved state
            sampler, loader = _loader(plan, feats, workers, replicas, rank)
            sampler.load_state_dict(state)
            sampler.set_epoch(state["epoch"])  # what a training loop calls at each epoch: it does not replay
            if stop < len(loader): got += [_bin_of(b) for b in loader]
            assert got == whole[epoch]  # the union equals one uninterrupted epoch, in order, no bin twice
            if replicas == 1: assert len(set(got)) == len(got) == len(plan.bins)
    served = {b for r in range(replicas) for b in [_bin_of(x) for x in _loader(plan, feats, 0, replicas, r)[1]]}
    assert len(served) == len(plan.bins)  # the ranks together serve every bin


def test_plain_dataloader_with_workers_runs_ahead_resumable_does_not():
    """Why ResumableLoader exists: a plain DataLoader's workers take steps before the consumer does (its count is
    refused)."""
    lengths = np.full(40, 10)
    feats = [{"input_ids": [e] * 10} for e in range(40)]
    plan = plan_bins(lengths, 20)
    s = TokenBudgetSampler(plan, seed=0)
    it = iter(DataLoader(plan.dataset(feats), batch_sampler=s, collate_fn=FlatteningCollator(train_all_tokens=True),
                         num_workers=2))
    next(it)
    assert s.consumed > 1  # prefetched: what the workers took, not what the consumer received
    with pytest.raises(RuntimeError, match=r"num_workers=2 .* ResumableLoader\(dataset, sampler, num_workers=2"):
        s.state_dict()  # before: the count the workers fetched, as if received
    del it
    s = TokenBudgetSampler(plan, seed=0)
    it = iter(ResumableLoader(plan.dataset(feats), s, collate_fn=FlatteningCollator(train_all_tokens=True),
                              num_workers=2))
    next(it)
    assert s.state_dict()["consumed"] == 1
    del it


def test_break_and_continue_with_persistent_workers():
    "One loader, persistent workers: a loop that breaks mid-epoch and iterates again continues where it broke."
    lengths = np.random.default_rng(0).integers(1, 50, 100)
    feats = [{"input_ids": [e] * int(n)} for e, n in enumerate(lengths)]
    plan = plan_bins(lengths, 100)
    make = lambda **kw: ResumableLoader(plan.dataset(feats), TokenBudgetSampler(plan, seed=1),
                                        collate_fn=FlatteningCollator(train_all_tokens=True), **kw)
    ref = make()
    epochs = [[_bin_of(b) for b in ref] for _ in range(2)]
    loader = make(num_workers=2, persistent_workers=True)
    first = []
    for b in loader:
        first.append(_bin_of(b))
        if len(first) == 5: break
    assert loader.state_dict()["consumed"] == 5
    assert first + [_bin_of(b) for b in loader] == epochs[0]
    assert [_bin_of(b) for b in loader] == epochs[1] and loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("bins, replicas", [(2, 5), (1, 4), (3, 7), (5, 5)])
def test_any_number_of_replicas(bins, replicas):
    plan = plan_bins([10] * bins, 10)
    per_rank = [list(TokenBudgetSampler(plan, seed=1, num_replicas=replicas, rank=r)) for r in range(replicas)]
    assert {len(p) for p in per_rank} == {-(-bins // replicas)}  # the same steps on every rank
    assert {i for p in per_rank for b in p for i in b} == set(range(bins))  # every bin served, some repeated
    assert TokenBudgetSampler(plan, num_replicas=replicas).repeated == len(per_rank[0]) * replicas - bins


def test_set_epoch_and_state_rules():
    plan = plan_bins(np.random.default_rng(0).integers(1, 100, 200), 256)
    s = TokenBudgetSampler(plan, seed=2)
    it = iter(s); [next(it) for _ in range(3)]
    s.set_epoch(0)  # the same epoch: keeps its position
    assert s.state_dict()["consumed"] == 3
    s.set_epoch(1)  # another epoch: from its first step
    assert (s.state_dict()["epoch"], s.state_dict()["consumed"]) == (1, 0)
    with pytest.raises(ValueError, match="seed=2 but this sampler has seed=9"):
        TokenBudgetSampler(plan, seed=9).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_replicas x grad_accum = 1 x 1 bins per "
                                         "optimizer step but this sampler serves 2 x 1"):
        TokenBudgetSampler(plan, seed=2, num_replicas=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="steps="):
        TokenBudgetSampler(plan_bins([5] * 10, 5), seed=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="state lacks"): s.load_state_dict({"epoch": 0, "served": 1, "seed": 2})
    with pytest.raises(ValueError, match="outside"): s.load_state_dict({**s.state_dict(), "consumed": 10**6})
    with pytest.raises(ValueError, match="rank 2 is outside num_replicas=2"):
        TokenBudgetSampler(plan, num_replicas=2, rank=2)

# ---------------------------------------------------------------- the planner does not grow with the capacity


def test_plan_size_is_independent_of_capacity():
    "At a capacity of 10^12 the old planner allocated one bucket per token of room (a MemoryError); now it is one bin."
    lengths = np.random.default_rng(0).integers(1, 10_000, 5_000)
    plan = plan_bins(lengths, 10**12)
    assert len(plan.bins) == 1 and plan.bin_tokens.tolist() == [lengths.sum()]
    small, big = plan_bins(lengths, 20_000, seed=1), plan_bins(lengths, 20_000 * 1000, seed=1)
    assert len(big.bins) == -(-lengths.sum() // (20_000 * 1000)) and small.fill > 0.99
