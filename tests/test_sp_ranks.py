"""workbench.sp.ranks: the rank view of a packed row equals a real run of its layout, process by process (ring 2, ring 4
and Ulysses 2 x ring 2 on gloo, every shard strategy, with and without a sliding window): skipped block pairs against
the ring's own counters, trained targets against the shard, bytes against those counted on the wire."""
from itertools import product

from workbench.tiny_models import tiny_config
from workbench.sp.balance import PLANS
from workbench.sp.gather import _tiles, _whole_row, gather_bytes
from workbench.sp_proofs import Case, case_rows, prove_ring
from workbench.sp.ranks import rank_view

CASES = [Case("qwen2", "sdpa"), Case("mistral", "sdpa"),  # fp32; 203 FLAN-like tokens packed; mistral: a window of 16
         # one document: contiguous ring blocks skip unequally (the rank -> block map shows)
         Case("qwen2", "sdpa", packed=False)]


def test_the_view_equals_a_real_run_process_by_process():
    results = prove_ring(CASES, 2, [(1, 2)], PLANS) + prove_ring(CASES, 4, [(1, 4), (2, 2)], PLANS)
    assert len(results) == len(CASES) * len(PLANS) * (2 + 4 + 4)
    rows = {case: case_rows(case)[0] for case in CASES}  # each case's row (as `one_process` builds it), once
    for r in results:
        case = r["case"]
        config = tiny_config(case.family)
        row = rows[case]
        view = rank_view(row, r["ulysses"], r["ring"], r["strategy"], config, dtype_bytes=4)
        mine = view.table.loc[r["rank"]]
        where = (case.family, r["ulysses"], r["ring"], r["strategy"], r["rank"])
        assert r["skipped"] == config.num_hidden_layers * mine["pairs skipped"], (
            where, r["skipped"], mine["pairs skipped"])
        assert r["trained"] == mine["trained"], where
        assert sum(r["p2p_bytes"]) == mine["ring bytes"], (where, r["p2p_bytes"], mine["ring bytes"])
        assert sum(r["a2a"]) * 4 == mine["all-to-all bytes"], (where, r["a2a"], mine["all-to-all bytes"])
    assert any(r["skipped"] > 0 for r in results) and any(r["skipped"] == 0 for r in results)  # both kinds of rank met


def test_the_gather_view_is_the_gathers_own_masks_and_bytes():
    """Gather 2 and Ulysses 2 x gather 2, every strategy, a window included, no processes: the ring's shards (held to a
    real run above), no block pairs, each process's work the masks the gather's kernel builds against the whole row
    (`_tiles` over `_whole_row`, what `attend_row` computes), its bytes `gather_bytes` (counted on the wire in
    tests/test_gather.py)."""
    for case in CASES:
        config, row = tiny_config(case.family), case_rows(case)[0]
        for (u, g), strategy in product([(1, 2), (2, 2)], PLANS):
            view = rank_view(row, u, 1, strategy, config, dtype_bytes=4, gather=g)
            ring = rank_view(row, u, g, strategy, config, dtype_bytes=4)
            where = (case.family, u, g, strategy)
            assert view.pairs is None and "pairs skipped" not in view.table, where
            assert view.table[["tokens", "trained"]].equals(ring.table[["tokens", "trained"]]), where
            blocks, window = view.plan.reshape(g, -1), config.sliding_window  # mistral's 16, qwen2's None
            masked = [sum(int(allowed.sum()) for _, allowed in _tiles(*_whole_row(blocks, view.doc, b, window, True)))
                      for b in range(g)]
            heads = config.num_attention_heads // u
            assert view.table["attention work"].tolist() == [masked[r // u] * heads for r in range(u * g)], where
            sent = gather_bytes(config, len(view.doc), u, g, dtype_bytes=4)
            assert view.table["gather bytes"].tolist() == [sent["gather"]] * (u * g), where
            assert view.table["all-to-all bytes"].tolist() == [sent["all_to_all"]] * (u * g), where
