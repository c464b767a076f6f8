"""workbench.sp.ranks: the rank view of a packed row equals a real run of its layout, process by process (ring 2, ring 4
and Ulysses 2 x ring 2 on gloo, every shard strategy, with and without a sliding window): skipped block pairs against
the ring's own counters, trained targets against the shard, bytes against those counted on the wire."""
from workbench.core import tiny_config
from workbench.sp.balance import PLANS
from workbench.sp.proofs import Case, one_process, prove_ring
from workbench.sp.ranks import rank_view

CASES = [Case("qwen2", "sdpa"), Case("mistral", "sdpa"),  # fp32; 203 FLAN-like tokens packed; mistral: a window of 16
         Case("qwen2", "sdpa", packed=False)]  # one document: contiguous ring blocks skip unequally (the rank -> block map shows)


def test_the_view_equals_a_real_run_process_by_process():
    results = prove_ring(CASES, 2, [(1, 2)], PLANS) + prove_ring(CASES, 4, [(1, 4), (2, 2)], PLANS)
    assert len(results) == len(CASES) * len(PLANS) * (2 + 4 + 4)
    for r in results:
        case = r["case"]
        config = tiny_config(case.family)
        row = one_process(case, 1)["rows"][0]
        view = rank_view(row, r["ulysses"], r["ring"], r["strategy"], config, dtype_bytes=4)
        mine = view.table.loc[r["rank"]]
        where = (case.family, r["ulysses"], r["ring"], r["strategy"], r["rank"])
        assert r["skipped"] == config.num_hidden_layers * mine["pairs skipped"], (where, r["skipped"], mine["pairs skipped"])
        assert r["trained"] == mine["trained"], where
        assert sum(r["p2p_bytes"]) == mine["ring bytes"], (where, r["p2p_bytes"], mine["ring bytes"])
        assert sum(r["a2a"]) * 4 == mine["all-to-all bytes"], (where, r["a2a"], mine["all-to-all bytes"])
    assert any(r["skipped"] > 0 for r in results) and any(r["skipped"] == 0 for r in results)  # both kinds of rank met
