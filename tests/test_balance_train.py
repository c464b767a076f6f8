"""Cost-balanced grouping in training: the sampler serves exactly the planned
groups, reshuffles whole ones, resumes exactly; a real DP run trains them."""
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from workbench.step_balance import plan_balanced
from workbench.packing import FlatteningCollator, TokenBudgetSampler, plan_bins, synthetic_lengths

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    return np.r_[synthetic_lengths("flan", 1500, seed=1), rng.integers(1024, 4097, 30)]


def _bin_ids(plan, batches) -> list[int]:
    "The bin each served batch of piece ids is (bins are disjoint: the first piece names it)."
    first = {int(b[0]): k for k, b in enumerate(plan.bins)}
    return [first[batch[0]] for batch in batches]


def _steps(bal, samplers, grad_accum) -> list[tuple]:
    "Per optimizer step, every rank's bins, from what each rank's sampler yields over one epoch."
    per_rank = [np.array(_bin_ids(bal.plan, list(s))).reshape(-1, grad_accum) for s in samplers]
    return [tuple(tuple(r[k]) for r in per_rank) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("dp,grad_accum", [(2, 2), (3, 1), (1, 3)])
def test_sampler_serves_the_planned_groups_on_every_rank_and_reshuffles_whole_ones(lengths, dp, grad_accum):
    bal = plan_balanced(lengths, 4096, dp, "qwen3-4b", grad_accum=grad_accum, seed=2)
    planned = [tuple(tuple(step[:, r]) for r in range(dp)) for step in bal.cost_steps]
    samplers = [bal.sampler(r, seed=2) for r in range(dp)]
    orders = []
    for epoch in (0, 1):
        got = _steps(bal, samplers, grad_accum)
        assert Counter(got) == Counter(planned)  # the same optimizer steps, each whole, rank by rank
        served = Counter(b for step in got for r in step for b in r)
        assert set(served) == set(range(len(bal.plan.bins)))  # every bin once (the few repeats complete the last step)
        assert sum(served.values()) - len(bal.plan.bins) == samplers[0].repeated
        orders.append(got)
    assert orders[0] != orders[1]  # set_epoch (the roll to the next epoch) reshuffled whole steps
    fixed = [bal.sampler(r, shuffle=False) for r in range(dp)]
    assert _steps(bal, fixed, grad_accum) == planned  # unshuffled: exactly cost_steps, in order


def test_default_grouping_is_unchanged(lengths):
    plan = plan_bins(lengths, 4096)
    s = TokenBudgetSampler(plan, seed=3, num_replicas=2); s.set_epoch(5)
    by_size = np.argsort(-plan.bin_tokens, kind="stable")
    steps = np.resize(by_size, (-(-len(by_size) // 2), 2))
    rng = np.random.default_rng([3, 5])  # the order before groupings existed: rows permuted, then ranks within a row
    old = steps[rng.permutation(len(steps))]
    old = np.take_along_axis(old, rng.random(old.shape).argsort(1), 1)
    assert (s.epoch_steps() == old).all() and (s.steps == steps).all() and s.repeated == steps.size - len(plan.bins)


@pytest.mark.parametrize("taken", [3, 4, 0])
def test_resume_mid_epoch_and_mid_group_continues_exactly(lengths, taken):
    bal = plan_balanced(lengths, 4096, 2, "qwen3-4b", grad_accum=2, seed=4)
    s = bal.sampler(1, seed=4); s.set_epoch(2)
    it = iter(s); [next(it) for _ in range(taken)]  # 3: inside an optimizer step of 2 micro-steps
    state = s.state_dict(); rest = list(it)
    r = bal.sampler(1, seed=4); r.load_state_dict(state); r.set_epoch(2)  # set_epoch of the current epoch: no replay
    assert list(r) == rest and len(rest) == len(s) - taken
    nxt = bal.sampler(1, seed=4); nxt.set_epoch(3)
    assert list(r) == list(nxt)  # and then the next epoch, reshuffled the same way
    # a state saved before groupings were recorded: the default's
    old = {k: v for k, v in state.items() if k != "grouping"}
    with pytest.raises(ValueError, match="another grouping of the bins"): bal.sampler(1, seed=4).load_state_dict(old)
    token = TokenBudgetSampler(bal.plan, seed=4, num_replicas=2, rank=1, grad_accum=2)
    assert len(token) == len(s)  # the same global batch, so the same rows: only the grouping tells them apart
    token.load_state_dict(old)  # the default grouping takes it
    with pytest.raises(ValueError, match="another grouping of the bins"): token.load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("global batch of num_replicas x grad_accum "
                                                   "= 2 x 2 bins per optimizer step")):
        TokenBudgetSampler(bal.plan, seed=4, num_replicas=2, rank=1).load_state_dict(state)


def test_a_cost_balanced_state_resumes_on_another_split_of_the_global_batch(lengths):
    """Saved after 3 optimizer steps of 2 ranks x 2 micro-steps, resumed
    on 1 rank x 4 micro-steps: the same bins in every later step."""
    two = plan_balanced(lengths, 4096, 2, "qwen3-4b", grad_accum=2, seed=4)
    one = plan_balanced(lengths, 4096, 1, "qwen3-4b", grad_accum=4, seed=4)
    ranks = [two.sampler(r, seed=4) for r in (0, 1)]
    streams = [iter(s) for s in ranks]
    for _ in range(3 * 2):
        for stream in streams: next(stream)
    state = ranks[0].state_dict()
    rest = [_bin_ids(two.plan, list(stream)) for stream in streams]  # the rest of the epoch, rank by rank
    per_step_two = [sorted(rest[0][k:k + 2] + rest[1][k:k + 2]) for k in range(0, len(rest[0]), 2)]
    resumed = one.sampler(0, seed=4)
    resumed.load_state_dict(state)
    got = _bin_ids(one.plan, list(resumed))
    per_step_one = [sorted(got[k:k + 4]) for k in range(0, len(got), 4)]
    assert len(per_step_one) == len(two.cost_steps) - 3 and per_step_one == per_step_two
    inside = two.sampler(0, seed=4)
    next(iter(inside))
    with pytest.raises(ValueError, match="after micro-step 1 of an optimizer step of 2"):
        one.sampler(0, seed=4).load_state_dict(inside.state_dict())


def test_bad_groupings_are_refused_with_the_fix(lengths):
    plan = plan_bins(lengths, 4096)
    n = len(plan.bins)
    good = np.resize(np.arange(n), (-(-n // 4), 4))  # optimizer steps of 2 micro-steps x 2 ranks
    assert len(TokenBudgetSampler(plan, num_replicas=2, steps=good, grad_accum=2)) == 2 * len(good)
    cases = [
        (dict(steps=good.reshape(-1), grad_accum=2), "must be [n_steps, grad_accum x num_replicas = 4]"),
        (dict(steps=good), "must be [n_steps, grad_accum x num_replicas = 2]"),  # 4 bins a step without grad_accum=2
        (dict(steps=good.astype(float), grad_accum=2), "integer bin ids"),
        (dict(steps=np.where(good == 5, n, good), grad_accum=2), f"bin id {n} (1 ids in all) "
                                                                 f"outside the plan's {n} bins"),
        (dict(steps=np.where(good == 5, -1, good), grad_accum=2), "bin id -1"),
        (dict(steps=np.where(good == 5, 6, good), grad_accum=2), f"never serve 1 of the plan's {n} bins (e.g. bin 5)"),
        (dict(steps=np.zeros((0, 4), dtype=int), grad_accum=2), f"never serve {n} of the plan's {n} bins"),
        (dict(steps=good, grad_accum=0), "grad_accum must be a positive integer"),
        (dict(steps=good, grad_accum=True), "grad_accum must be a positive integer"),
        (dict(grad_accum=2.0), "grad_accum must be a positive integer"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)): TokenBudgetSampler(plan, num_replicas=2, **kwargs)


def test_bad_balance_values_and_unmodelled_models_are_refused(tmp_path):
    from workbench.tiny_models import tiny_config
    from workbench.config import TrainConfig
    from workbench.train import cost_modelled, preflight_run
    with pytest.raises(ValueError, match="balance .--balance. 'flops' is not one of"): TrainConfig(balance="flops")
    cli = subprocess.run([sys.executable, "-m", "workbench.train", "--balance", "flops", "--out",
                          str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 2 and "balance (--balance) 'flops' is not one of" in cli.stderr, cli.stderr
    with pytest.raises(ValueError, match=r"balance \(--balance\) 'cost' needs the cost "
                                         r"of this model's steps: mixtral is a mixture"):
        # before any process starts
        preflight_run(TrainConfig(model="mixtral", balance="cost", out=str(tmp_path / "moe")))
    assert cost_modelled(TrainConfig(model="mixtral"), tiny_config("mixtral")) is False  # tokens: trains on, no readout


def test_a_cost_balanced_dp_run_trains_the_planned_groups_and_refuses_the_other_balance_on_resume(tmp_path):
    from workbench.samples import load_tokenizer
    from workbench.config import model_config, TrainConfig
    from workbench.data import load_features
    from workbench.train import plan_run, run
    cfg = TrainConfig(dp=2, grad_accum=2, steps=2, max_tokens=1024, attn="workbench_varlen", balance="cost", seed=1,
                      out=str(tmp_path / "run"), timeout_s=60)
    run(cfg)
    run(TrainConfig(**{**cfg.__dict__, "steps": 4, "resume": True}))  # continues from the step-2 checkpoint
    feats = load_features(cfg.data, load_tokenizer())  # what the run plans (its masks say which pieces train)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in range(4) for r in range(2)]
    logged = {(r["step"], r["rank"]): r["tokens"] for r in rows}
    expect, imbalance = {}, {}
    for balance in ("cost", "tokens"):
        for rank in (0, 1):
            plan, sampler, imbalance[balance], _, _ = plan_run(TrainConfig(**{**cfg.__dict__, "balance": balance}),
                                                               model_config(cfg), feats, rank)
            # 4 optimizer steps x 2 micro-steps x 2 ranks
            served = sampler.epoch_steps()[:4].reshape(4, 2, 2)[:, :, rank]
            for step, bins in enumerate(served):
                expect[balance, step, rank] = int(sum(plan.length[plan.bins[b]].sum() for b in bins))
    assert all(logged[s, r] == expect["cost", s, r] for s in range(4) for r in range(2)), (logged, expect)
    assert any(expect["tokens", s, r] != expect["cost", s, r] for s in range(4) for r in range(2))  # it could fail
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["balance"] == "cost" and config["imbalance"] == imbalance["cost"]
            and set(imbalance["cost"]) == {"tokens", "cost"})
    # a tokens run: its own grouping's, no cost grouping dealt
    assert imbalance["tokens"] == {"tokens": imbalance["cost"]["tokens"]}
    with pytest.raises(ValueError, match=r"balance='cost' \(--balance; this run has 'tokens'\)"):
        run(TrainConfig(**{**cfg.__dict__, "balance": "tokens", "steps": 6, "resume": True}))


def test_packed_trainer_cost_balance_trains_the_plan_and_resumes_exactly(tmp_path):
    import torch
    from datasets import Dataset
    from transformers import TrainingArguments
    from workbench.samples import load_sample
    from workbench.tiny_models import tiny_model
    from workbench.hf import PackedTrainer
    ds = Dataset.from_list(load_sample("flan_like", limit=48))
    seen = []
    def record(features):  # the pieces of every micro-step the trainer collates
        seen.append(sorted(len(f["input_ids"]) for f in features))
        return FlatteningCollator()(features)
    def mk(out, collate=None, **kw):
        args = TrainingArguments(**{**dict(output_dir=str(out), max_steps=4, gradient_accumulation_steps=2,
                                           report_to=[],
                                           use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True), **kw})
        return PackedTrainer(model=tiny_model("llama").train(), args=args, train_dataset=ds, max_tokens=1024,
                             balance="cost", data_collator=collate)
    full = mk(tmp_path / "full", record); full.train()
    bal = full.balanced
    assert bal.cost_steps.shape[1:] == (2, 1) and full.plan is bal.plan
    # one rank: its micro-steps row by row (TrainingArguments' default seed)
    served = bal.sampler(0, seed=42).epoch_steps().reshape(-1)
    epoch = [sorted(int(bal.plan.length[i]) for i in bal.plan.bins[b]) for b in served]
    assert seen[:len(epoch)] == epoch[:len(seen)]  # the micro-steps in the planned order, each optimizer step whole
    half = mk(tmp_path / "half", save_strategy="steps", save_steps=2); half.train()
    resumed = mk(tmp_path / "half"); resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-2"))
    loss = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]
    assert len(loss(resumed)) == 4 and loss(resumed) == loss(full)
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for kw, msg in ((dict(balance="flops"), "balance must be 'tokens' or 'cost'"),
                    (dict(balance="cost", max_tokens=None), "pass max_tokens= as well"),
                    (dict(balance="cost", train_dataset=ds.to_iterable_dataset()), "a stream is packed as it is read")):
        args = TrainingArguments(output_dir=str(tmp_path / "bad"), max_steps=1, report_to=[], use_cpu=True)
        with pytest.raises(ValueError, match=re.escape(msg)):
            PackedTrainer(model=tiny_model("llama"), args=args, **{"train_dataset": ds, "max_tokens": 1024, **kw})
