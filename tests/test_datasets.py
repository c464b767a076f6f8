"""Proofs for `datasets` inputs: planning over a Dataset, streaming
packing (every token once, exact resume, DDP), hostile inputs."""
import io
import json
from collections import Counter

import numpy as np
import pytest
import torch
from datasets import Dataset
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader

from workbench.packing import FlatteningCollator, PackedStream, lengths_of, packing_report, plan_bins


def _features(lengths, offset: int = 0) -> list[dict]:
    "Example i holds tokens i * 10_000 + [0, n): every token names its example and its position."
    return [{"input_ids": list(range(i * 10_000, i * 10_000 + int(n))), "idx": i}
            for i, n in enumerate(lengths, offset)]


def _check_kept(bins, feats, capacity):
    "Every token served once, each piece a contiguous run of one example, no bin over the budget."
    served = Counter(t for b in bins for f in b for t in np.asarray(f["input_ids"]).reshape(-1).tolist())
    test = Counter(t for f in feats for t in f["input_ids"])
    assert served == test
    for b in bins:
        assert sum(np.asarray(f["input_ids"]).size for f in b) <= capacity
        for f in b:
            ids = np.asarray(f["input_ids"]).reshape(-1)
            assert (ids // 10_000 == f["idx"]).all() and (np.diff(ids) == 1).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=40), st.integers(1, 50), st.integers(1, 12),
       st.sampled_from(["split", "error"]), st.sampled_from(["keep", "drop"]))
def test_streaming_keeps_every_token_once(lengths, capacity, buffer_size, overlong, untrained):
    feats = _features(lengths)
    stream = PackedStream(feats, capacity, buffer_size=buffer_size, overlong=overlong, untrained=untrained)
    if overlong == "error" and any(n > capacity for n in lengths):
        with pytest.raises(ValueError, match="more than capacity"): list(stream)
        return
    bins = list(stream)
    # ids alone train every token but a piece's first: a piece of one token (the last of an example whose length is 1
    # more than a multiple of the capacity) trains nothing, and untrained='drop' leaves exactly those out
    pieces = [[f["input_ids"][lo:lo + capacity] for lo in range(0, n, capacity)] for f, n in zip(feats, lengths)]
    idle = [p for ps in pieces for p in ps if len(p) == 1] if untrained == "drop" else []
    kept = [{**f, "input_ids": [t for p in ps if untrained == "keep" or len(p) > 1 for t in p]}
            for f, ps in zip(feats, pieces)]
    _check_kept(bins, kept, capacity)
    r = stream.report
    assert (r.examples, r.bins, r.tokens, r.split) == (len(lengths), len(bins), sum(lengths) - len(idle),
                                                       sum(n > capacity for n in lengths))
    assert (r.untrained, r.untrained_tokens) == (len(idle), len(idle))
    # deterministic
    assert list(PackedStream(feats, capacity, buffer_size=buffer_size, overlong=overlong, untrained=untrained)) == bins


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 60), st.integers(1, 8))
def test_resume_at_any_step_is_exact_on_every_rank(lengths, k, stop, buffer_size):
    feats = _features(lengths)
    make = lambda rank: PackedStream(feats, 32, buffer_size=buffer_size, overlong="split", num_replicas=k, rank=rank)
    whole = [list(make(r)) for r in range(k)]
    assert len({len(w) for w in whole}) == 1  # every rank the same number of steps
    for rank in range(k):
        s = make(rank)
        it = iter(s)
        head = [b for _, b in zip(range(stop), it)]
        buf = io.BytesIO(); torch.save(s.state_dict(), buf); buf.seek(0)  # the state survives a checkpoint file
        resumed = make(rank)
        resumed.load_state_dict(torch.load(buf, weights_only=False))
        passes = 2 if stop > len(whole[rank]) else 1  # a pass read to its end resumes at the next pass
        assert head + list(resumed) == whole[rank] * passes
    stream = make(0); list(stream)
    served = Counter(tuple(f["input_ids"]) for w in whole for b in w for f in b)
    pieces = Counter(tuple(f["input_ids"])
                     for b in list(PackedStream(feats, 32, buffer_size=buffer_size, overlong="split")) for f in b)
    assert len(whole[0]) * k == stream.report.bins + stream.report.repeated and stream.report.repeated < k
    assert set(served) == set(pieces) and all(served[p] >= pieces[p] for p in pieces)  # all bins, repeats counted


def test_an_iterable_dataset_with_none_rows_and_1xT_rows():
    rows = [{"input_ids": [[1, 2, 3, 4, 5]]}, {"input_ids": [[6, 7]]}, {"input_ids": [[8, 9, 10]]}]
    ds = Dataset.from_list(rows).to_iterable_dataset()
    # every token, [5] too
    stream = PackedStream(ds, 4, buffer_size=2, overlong="split", collate_fn=FlatteningCollator(train_all_tokens=True),
                          untrained="keep")
    out = [b["input_ids"].tolist() for b in DataLoader(stream, batch_size=None)]
    assert sorted(t for row in out for t in row[0]) == list(range(1, 11)) and max(len(r[0]) for r in out) <= 4
    holed = Dataset.from_list([{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": None}]).to_iterable_dataset()
    with pytest.raises(ValueError, match="example 2 has no 'input_ids'"): list(PackedStream(holed, 8))
    with pytest.raises(ValueError, match="row 2 of 'input_ids' is missing"): plan_bins(Dataset.from_list(
        [{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": None}]), 8)


def test_hostile_streams_name_what_is_wrong():
    with pytest.raises(ValueError, match="example 0 has no 'input_ids'.*tokenize"):
        list(PackedStream([{"text": "hi"}], 8))
    with pytest.raises(ValueError, match=r"example 0 has no 'input_ids' \(it has \['text'\]\)"):
        list(PackedStream(Dataset.from_list([{"text": "hi"}]), 8))
    with pytest.raises(ValueError, match="example 1: input_ids is text"):
        list(PackedStream([{"input_ids": [1]}, {"input_ids": "hi"}], 8))
    with pytest.raises(ValueError, match="example 0 has no tokens"): list(PackedStream([{"input_ids": []}], 8))
    with pytest.raises(ValueError, match="must hold integers"): list(PackedStream([{"input_ids": [0.5, 1.5]}], 8))
    with pytest.raises(TypeError, match="example 0 is a list"): list(PackedStream([[1, 2]], 8))
    with pytest.raises(ValueError, match="buffer_size must be at least 1"): PackedStream([], 8, buffer_size=0)
    with pytest.raises(ValueError, match="capacity must be a positive"): PackedStream([], 0)
    with pytest.raises(ValueError, match="overlong must be one of"): PackedStream([], 8, overlong="wrap")
    with pytest.raises(ValueError, match="rank 2 is outside num_replicas=2"):
        PackedStream([], 8, num_replicas=2, rank=2)
    one_shot = PackedStream((f for f in _features([3, 4])), 8)
    assert len(list(one_shot)) == 1
    with pytest.raises(TypeError, match="one-shot iterator"): list(one_shot)
    with pytest.raises(RuntimeError, match="num_workers=0"):
        list(DataLoader(PackedStream(_features([3]), 8), batch_size=None, num_workers=1, timeout=60))
    s = PackedStream(_features([3, 4, 5]), 8)
    it = iter(s); next(it)
    with pytest.raises(ValueError, match="capacity=8 but this stream has capacity=16"):
        PackedStream(_features([3, 4, 5]), 16).load_state_dict(s.state_dict())
    shorter = PackedStream(_features([3]), 8, buffer_size=1)
    state = PackedStream(_features([3, 4, 5]), 8, buffer_size=1)
    it = iter(state); next(it); next(it)
    shorter.load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="fewer than the 3 examples"): list(shorter)


def test_a_stream_state_is_plain_data_that_knows_its_source():
    """Issue 47: the state failed through JSON (TypeError: ndarray) and torch.load(weights_only=True) (UnpicklingError),
    and resumed silently over another source of the same size."""
    lengths = [3, 13, 2, 7, 4, 25, 1, 8, 3, 2, 5, 4, 2, 11, 6, 7, 2, 1, 3, 2, 4, 5]
    make = lambda source: PackedStream(source, 10, buffer_size=4, overlong="split", num_replicas=2, rank=1)
    whole = make(_features(lengths))
    bins = list(whole)
    s = make(_features(lengths))
    it = iter(s)
    first = [next(it) for _ in range(4)]
    state = s.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    for saved in (json.loads(json.dumps(state)), torch.load(buf, weights_only=True)):
        resumed = make(_features(lengths))
        resumed.load_state_dict(saved)
        assert first + list(resumed) == bins
        assert repr(resumed.report) == repr(whole.report)
    other = make(_features(lengths, offset=50))  # as many examples, as long, other tokens: before, resumed silently
    other.load_state_dict(json.loads(json.dumps(state)))
    p = state["pass"]
    with pytest.raises(ValueError, match=f"first {p['consumed']} examples have fingerprint {p['source']}, but this "
                                         f"source's .* another source"): list(other)
    old = {**state, "pass": {k: v for k, v in state["pass"].items() if k != "source"}}
    with pytest.raises(ValueError, match=r"older PackedStream.*load_state_dict\(\{\*\*state, 'pass': None\}\)"):
        make(_features(lengths)).load_state_dict(old)


def test_edges_of_size():
    assert list(PackedStream([], 8)) == [] and PackedStream([], 8).report.fill == 0
    empty = PackedStream(Dataset.from_list([{"input_ids": [1]}]).to_iterable_dataset().take(0), 8)
    assert list(empty) == [] and empty.report.bins == 0
    assert len(plan_bins(Dataset.from_dict({"input_ids": []}), 8).bins) == 0
    for overlong, want in [("split", (3, 0)), ("truncate", (1, 12)), ("drop", (0, 20))]:  # one overlong example
        s = PackedStream(_features([20]), 8, overlong=overlong)
        assert (len(list(s)), s.report.lost_tokens) == want
    s = PackedStream(_features([20]), 8, overlong="drop", num_replicas=2, rank=1)  # nothing to serve on any rank
    assert list(s) == [] and (s.report.dropped, s.report.repeated) == (1, 0)
    feats = _features([9, 17, 30, 11])  # a capacity below every example
    bins = list(PackedStream(feats, 8, buffer_size=3, overlong="split", untrained="keep"))  # the one-token pieces too
    _check_kept(bins, feats, 8)
    lengths = [5, 3, 7, 2, 6, 1, 4]  # a stream shorter than the buffer is one global best-fit-decreasing pass
    stream = PackedStream(_features(lengths), 8, buffer_size=100, untrained="keep")  # as the bare lengths: [1] kept
    assert (len(list(stream)) == len(plan_bins(lengths, 8).bins)
            and stream.report.fill == stream.report.global_plan().fill)
    tensors = [{"input_ids": torch.arange(10).reshape(1, 10), "completion_mask": torch.ones(1, 10, dtype=torch.long)}]
    # [1, T] tensors, as a tokenizer returns
    pieces = [f for b in PackedStream(tensors, 4, overlong="split") for f in b]
    assert [f["input_ids"].tolist() for f in pieces] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    assert [f["completion_mask"].shape for f in pieces] == [(1, 4), (1, 4), (1, 2)]
    one = PackedStream(_features([3] * 6), 8, buffer_size=1)  # a buffer of one example: at most two per bin
    assert [len(b) for b in one] == [2, 2, 2]


def test_a_shuffled_iterable_dataset_resumes_in_its_epoch():
    ds = Dataset.from_list(_features(range(1, 40))).to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=8)
    make = lambda: PackedStream(ds, 64, buffer_size=4)
    s = make()
    epoch0, epoch1 = list(s), list(s)  # one pass per epoch; the source reshuffles with set_epoch
    assert epoch0 != epoch1 and s.epoch == 2
    s = make(); list(s)
    it = iter(s); head = [next(it) for _ in range(3)]
    resumed = make(); resumed.load_state_dict(s.state_dict())
    assert head + list(resumed) == epoch1


def test_plan_dataset_over_a_selected_dataset_with_1xT_rows():
    feats = _features([9, 3, 12, 5, 7])
    ds = Dataset.from_list([{**f, "input_ids": [f["input_ids"]]} for f in feats]).shuffle(seed=1).select([4, 0, 2])
    plan = plan_bins(ds, 8, overlong="split")
    assert lengths_of(ds).tolist() == [len(ds[i]["input_ids"][0]) for i in range(3)]
    pieces = plan.dataset(ds)
    bins = [[pieces[i] for i in b] for b in plan.bins]
    _check_kept(bins, [{"input_ids": r["input_ids"][0], "idx": r["idx"]} for r in ds], 8)
    batch = FlatteningCollator(train_all_tokens=True)([{"input_ids": f["input_ids"]} for f in bins[0]])
    assert batch["input_ids"].shape[1] == plan.bin_tokens[0]
    assert str(packing_report(ds, batch_size=2)) == str(packing_report([len(r["input_ids"][0]) for r in ds],
                                                                       batch_size=2))


def test_hf_trainer_steps_through_a_packed_stream(tmp_path):
    """Trainer takes one packed row per step from a PackedStream
    (batch size 1, its collator unwraps the row), in stream order."""
    from transformers import Trainer, TrainingArguments
    from workbench.samples import load_sample
    from workbench.tiny_models import tiny_model
    flan = load_sample("flan_like", limit=64)
    make = lambda: PackedStream(Dataset.from_list(flan).to_iterable_dataset(), 1024, buffer_size=16, overlong="split",
                                collate_fn=FlatteningCollator())
    rows = []
    def unwrap(batch):
        rows.append(batch[0]["input_ids"])
        return batch[0]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=3, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    out = Trainer(model=tiny_model("llama").train(), args=args, train_dataset=make(), data_collator=unwrap).train()
    assert out.global_step == 3 and 0 < out.training_loss < 20
    expected = [b["input_ids"] for b, _ in zip(make(), range(len(rows)))]
    assert len(rows) >= 3 and all(torch.equal(a, b) for a, b in zip(rows, expected))


def test_a_dataset_s_trained_targets_are_read_in_arrow_as_row_by_row():
    """plan_bins over a Dataset reads labels and masks in Arrow; the
    pieces it keeps and their targets equal the row-by-row reading."""
    rng = np.random.default_rng(0)
    rows = [{"input_ids": list(range(n)), "completion_mask": (rng.random(n) < 0.3).astype(int).tolist(),
             "labels": np.where(rng.random(n) < 0.8, 5, -100).tolist()} for n in rng.integers(1, 40, 200).tolist()]
    nested = [{k: [v] for k, v in r.items()} for r in rows]  # [1, T] rows
    # None: every token trains
    holed = [{**r, "completion_mask": None} if i % 7 == 0 else r for i, r in enumerate(rows)]
    for data in (rows, nested, holed):
        ds = Dataset.from_list(data).shuffle(seed=2).select(range(0, 200, 3))
        for cap in (4, 16):
            a, b = plan_bins(ds, cap, overlong="split"), plan_bins(ds.to_list(), cap, overlong="split")
            assert (a.example.tolist(), a.offset.tolist(), a.trained.tolist(), a.untrained) == \
                   (b.example.tolist(), b.offset.tolist(), b.trained.tolist(), b.untrained) and a.untrained > 0
