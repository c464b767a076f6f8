"""The communication accounting of a training run covers the ring, and the dashboard shows it apart from the all-to-all.

Real `train_rank` runs on forked CPU ranks (hybrid Ulysses 2 x ring 2 with two micro-steps, ring 2 alone in bf16 with
recomputed layers, Ulysses 2 alone), each inside a dispatcher counter: the bytes every metrics row claims (`a2a_bytes`,
`ring_bytes`) add up, rank by rank, to the bytes counted at the dispatcher; `ring_share` is measured on ring runs and
0.0 without a ring. The dashboard draws both shares per run from those rows, and no ring trace for rows written before
`ring_share` existed. `plan_run` with `balance="tokens"` never deals the cost grouping, yet prints the same
token-balanced imbalance `plan_balanced` computes.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workbench.samples import load_tokenizer
from workbench.tiny_models import tiny_config
from workbench.cost import run_options
from workbench.step_balance import plan_balanced
from workbench.dashboard import COMM_TITLE, METRIC_KEYS, Dashboard
from workbench.launch import launch
from workbench.sp_proofs import CountComm
from workbench.config import model_config, TrainConfig
from workbench.readouts import balance_readout
from workbench.train import plan_run, train_rank

COMMON = dict(model="qwen2", data="orca_like", steps=2, max_tokens=256, timeout_s=60)  # qwen2: 4 heads, 2 kv heads
RUNS = {"hybrid": dict(ulysses=2, ring=2, grad_accum=2),                       # both groups; two rows per step
        "ring": dict(ring=2, dtype="bfloat16", checkpointing=True),            # bf16 blocks, fp32 gradients, recompute
        "ulysses": dict(ulysses=2),                                           # no ring: ring_share 0.0, ring_bytes 0
        # a local model of 2 heads and 1 kv head: Ulysses 2 replicates it, the ring passes both
        "replicated": dict(ulysses=2, ring=2)}


class CountBytes(CountComm):
    "`CountComm`, and the bytes of every all-to-all's input too."
    def __init__(self): super().__init__(); self.a2a_bytes = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().startswith("c10d::alltoall"): self.a2a_bytes += args[1].numel() * args[1].element_size()
        return super().__torch_dispatch__(func, types, args, kwargs)


def counted_train(cfg: TrainConfig) -> dict:
    "One rank's whole training run under the counter: what it sent over each group."
    torch.set_num_threads(1)
    with CountBytes() as c: train_rank(cfg)
    return dict(rank=dist.get_rank(), a2a_bytes=c.a2a_bytes, ring_bytes=c.p2p_bytes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("ringdash"), {}
    tiny_config("llama", num_attention_heads=2, num_key_value_heads=1).save_pretrained(root / "two_heads")
    load_tokenizer().save_pretrained(root / "two_heads")  # a model directory brings its tokenizer
    for name, kw in RUNS.items():
        model = str(root / "two_heads") if name == "replicated" else COMMON["model"]
        cfg = TrainConfig(**{**COMMON, "model": model}, **kw, name=name, out=str(root / name))
        counted = launch(counted_train, cfg, num_processes=cfg.world, sp_size=cfg.ulysses, ring=cfg.ring, cpu=True,
                         quiet=True, timeout_s=60, deadline_s=240)
        rows = [json.loads(l) for l in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        out[name] = cfg, counted, rows
    return out


def test_every_row_carries_both_shares_and_the_bytes_counted(runs):
    for name, (cfg, counted, rows) in runs.items():
        assert sorted((r["step"], r["rank"])
                      for r in rows) == [(s, k) for s in range(2) for k in range(cfg.world)], name
        # mfu absent: not modelled
        assert all(tuple(r) == METRIC_KEYS[:len(r)] and "ring_share" in r for r in rows), rows[0]
        for c in counted:  # every byte the dispatcher saw, and nothing the rows claim that it did not see
            mine = [r for r in rows if r["rank"] == c["rank"]]
            assert sum(r["a2a_bytes"] for r in mine) == c["a2a_bytes"], (name, c, mine)
            assert sum(r["ring_bytes"] for r in mine) == c["ring_bytes"], (name, c, mine)
        for r in rows:
            assert 0 <= r["a2a_share"] and 0 <= r["ring_share"] and r["a2a_share"] + r["ring_share"] < 1, r
            assert (r["ring_share"] > 0) == (cfg.ring > 1) and (r["a2a_share"] > 0) == (cfg.ulysses > 1), (name, r)
            assert (r["ring_bytes"] > 0) == (cfg.ring > 1) and (r["a2a_bytes"] > 0) == (cfg.ulysses > 1), (name, r)
    hybrid, ring = runs["hybrid"][2][0], runs["ring"][2][0]
    assert hybrid["ring_bytes"] > 0 and hybrid["a2a_bytes"] > 0 and runs["ulysses"][2][0]["ring_share"] == 0.0
    assert ring["ring_bytes"] % 2 == 0 and ring["a2a_bytes"] == 0


def test_dashboard_draws_the_all_to_all_and_the_ring_apart_and_old_rows_without_a_ring_trace(runs, tmp_path):
    old = tmp_path / "old"; old.mkdir()  # a run written before ring_share existed
    (old / "config.json").write_text(json.dumps({"ulysses": 2, "dp": 1, "steps": 2}))
    (old / "metrics.jsonl").write_text("".join(json.dumps(dict(step=s, rank=k, loss=9.0 - s, tokens=100,
                                                               tokens_per_s=1e3,
                                                               peak_mem_bytes=2**30, a2a_share=(0.2, 0.3)[s],
                                                               time=s + 1.0)) + "\n"
                                               for s in range(2) for k in range(2)))
    dash = Dashboard(*(runs[n][0] for n in RUNS), old, names=[*RUNS, "old"])
    assert dash.comm.layout.title.text == COMM_TITLE and dash.comm in dash.figures()
    traces = {t.name: t for t in dash.comm.data if t.showlegend}
    assert sorted(traces) == sorted([f"{n} {kind}" for n in RUNS for kind in ("all-to-all", "ring")]
                                    + ["old all-to-all"])
    for name, (_, _, rows) in runs.items():
        rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
        for key, kind, dash_ in (("a2a_share", "all-to-all", "solid"), ("ring_share", "ring", "dash")):
            t = traces[f"{name} {kind}"]
            assert list(t.x) == [0, 1] and list(t.y) == [r[key] for r in rank0] and t.line.dash == dash_, (name, kind)
    assert list(traces["old all-to-all"].y) == [0.2, 0.3]
    colors = {t.name.split()[0]: t.line.color for t in traces.values()}
    # one colour per run: its two traces share it, the dash tells them apart
    assert len(set(colors.values())) == len(RUNS) + 1
    assert traces["hybrid ring"].line.color == traces["hybrid all-to-all"].line.color


def test_tokens_balance_never_deals_the_cost_grouping_and_reads_the_same_imbalance(monkeypatch):
    import workbench.train as train
    from workbench.samples import load_tokenizer
    from workbench.data import load_features
    lengths = [len(f["input_ids"]) for f in load_features("flan_like", load_tokenizer())]
    for dp, accum in ((1, 1), (2, 1), (3, 2)):
        cfg = TrainConfig(dp=dp, grad_accum=accum, max_tokens=1024)
        config = model_config(cfg)
        opts = run_options(cfg)
        bal = plan_balanced(lengths, cfg.max_tokens, dp, config, accum, opts["attention"], opts["levers"],
                            overlong="split", seed=0)
        with monkeypatch.context() as m:
            m.setattr(train, "plan_balanced", lambda *a, **k: pytest.fail("a tokens run dealt the cost grouping"))
            plan, sampler, imbalance, _, _ = plan_run(cfg, config, lengths, rank=dp - 1)
        assert imbalance == {"tokens": bal.token_imbalance} and repr(plan) == repr(bal.plan), (dp, accum)
        assert [list(b) for b in plan.bins] == [list(b) for b in bal.plan.bins]
        _, _, both, _, _ = plan_run(TrainConfig(**{**cfg.__dict__, "balance": "cost"}), config, lengths)
        assert both == {"tokens": bal.token_imbalance, "cost": bal.cost_imbalance}
        line = balance_readout(cfg, imbalance)
        assert line.startswith("balance: tokens; predicted max/mean rank cost per "
                               f"optimizer step: token-balanced {bal.token_imbalance:.3f}")
        assert ("--balance cost groups" in line) == (dp > 1) and "cost-balanced" not in line, line
    assert bal.token_imbalance != bal.cost_imbalance  # at dp=3 the groupings differ: the equalities above could fail
    assert plan_run(TrainConfig(model="mixtral"), tiny_config("mixtral"), lengths)[2] is None  # not modelled: trains on
    assert balance_readout(TrainConfig(model="mixtral"), None) == ("balance: tokens; no cost "
                                                                   "prediction for this architecture")


def test_a_run_resumed_past_the_upgrade_draws_its_ring_trace_only_where_rows_have_it(tmp_path):
    """Older rows (no ring_share) then newer ones in one directory, as
    a run resumed after an upgrade writes them: no zeros invented."""
    d = tmp_path / "resumed"; d.mkdir()
    base = dict(rank=0, loss=9.0, tokens=100, tokens_per_s=1e3, peak_mem_bytes=2**30, a2a_share=0.25)
    rows = ([dict(base, step=s, time=s + 1.0) for s in range(2)]
            + [dict(base, step=s, time=s - 1.0, ring_share=0.125) for s in (2, 3)])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dash = Dashboard(d, names=["resumed"])
    traces = {t.name: (list(t.x), list(t.y)) for t in dash.comm.data}
    assert traces == {"resumed all-to-all": ([0, 1, 2, 3], [0.25] * 4), "resumed ring": ([2, 3], [0.125] * 2)}
