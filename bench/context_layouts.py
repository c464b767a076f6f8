"""All-gather context parallelism against the ring and Ulysses (issue 49): one forward + backward of a tiny GQA Llama on
the same packed rows under Ulysses 2, ring 2 and gather 2 (the ring and the gather on both block kernels), and the
bytes each process sends, counted at the dispatcher and by each layout's formula (`Layout.comm_bytes`).

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/context_layouts.py [--lengths 2048,8192] [--rounds 5]
One launch of 2 CPU processes, one thread each, builds every layout through `workbench.sp.layout` (its attention key,
shard and forward: what `python -m workbench.train` runs) and times them round by round, interleaved, so that the box's
drift falls on every layout alike. Round 0 is a warm-up and counts the bytes (the counting mode slows every op, so no
timed round runs under it); each row length gets its own packed FLAN-like row, the same for every layout.
"""
import argparse, contextlib, os, statistics, time

import torch

from ring_kernel import packed_rows
from workbench.bench import print_table
from workbench.sp_proofs import CountComm  # the collectives counted as the proofs count them

LAYOUTS = {"Ulysses 2": dict(ulysses=2), "ring 2, plain": dict(ring=2), "ring 2, fused": dict(ring=2, kernel="fused"),
           "gather 2, plain": dict(gather=2), "gather 2, fused": dict(gather=2, kernel="fused")}  # `layout_of`'s
FAMILY = "llama3"  # the tiny config: 4 query heads sharing 2 key/value heads (GQA), 2 layers, fp32


def sent_bytes(count: CountComm) -> int:
    "Bytes sent while `count` was active: all-to-alls (fp32 elements), ring sends, all-gathers, reduce-scatters."
    return count.a2a * 4 + count.p2p_bytes + count.gathered_bytes + count.scattered_bytes


def rank_rounds(rows: list, rounds: int) -> list:
    "On each launched process, per row: every layout's seconds of each timed round, its bytes counted and by formula."
    from workbench.tiny_models import tiny_model
    from workbench.sp.grid import ParallelGrid
    from workbench.sp.layout import layout_of
    torch.set_num_threads(1)
    built = {}
    for name, degrees in LAYOUTS.items():
        layout = layout_of(**degrees)
        torch.manual_seed(0)  # the same weights under every layout
        model = tiny_model(FAMILY, attn_implementation=layout.attention_key("sdpa")).train()
        built[name] = layout, ParallelGrid.build(layout.ulysses, layout.context), model
    out = []
    for row in rows:
        shards = {name: layout.shard(row, grid) for name, (layout, grid, _) in built.items()}
        seconds, counted = {name: [] for name in built}, {}
        for r in range(rounds + 1):
            for name, (layout, grid, model) in built.items():
                count = CountComm() if r == 0 else None  # round 0 only: counted, not timed
                with count if count is not None else contextlib.nullcontext():
                    t = time.perf_counter()
                    _, loss = layout.forward(model, shards[name], grid)
                    loss.backward()
                    elapsed = time.perf_counter() - t
                model.zero_grad(set_to_none=True)
                if count is not None: counted[name] = sent_bytes(count)
                else: seconds[name].append(elapsed)
        formula = {name: sum(layout.comm_bytes(model.config, layout.row_tokens(shards[name]), dtype_bytes=4).values())
                   for name, (layout, _, model) in built.items()}
        out.append(dict(seconds=seconds, counted=counted, formula=formula))
    return out


def layouts_table(lengths: list, rounds: int) -> list:
    "Every layout at every row length: each rank's median seconds, the slowest rank's, and the bytes per rank."
    from workbench.launch import launch
    rows = [packed_rows("flan", n, 1)[0] for n in lengths]
    per_rank = launch(rank_rounds, rows, rounds, num_processes=2, cpu=True, quiet=True, timeout_s=1800)
    table = []
    for i, n in enumerate(lengths):
        ranks = [pr[i] for pr in per_rank]
        for name in LAYOUTS:
            times = [rk["seconds"][name] for rk in ranks]
            slowest = [max(ts) for ts in zip(*times)]  # each round lasts as long as its slowest rank
            counted = {rk["counted"][name] for rk in ranks}
            assert counted == {ranks[0]["formula"][name]}, (n, name, counted, ranks[0]["formula"][name])
            medians = {f"rank {k} s": statistics.median(t) for k, t in enumerate(times)}
            table.append({"tokens": n, "layout": name, **medians, "slowest s": statistics.median(slowest),
                          "bytes sent": ranks[0]["formula"][name]})
        base = {r["layout"]: r for r in table if r["tokens"] == n}
        for r in base.values():
            r["× Ulysses 2 (time)"] = r["slowest s"] / base["Ulysses 2"]["slowest s"]
            r["× ring 2 (bytes)"] = r["bytes sent"] / base["ring 2, plain"]["bytes sent"]
    return table


def formula_table(n_tokens: int = 131072, degrees=(2, 4, 8)) -> list:
    "Bytes one process sends per step by each layout's formula, Llama 3.1 8B's shape in bf16: GQA (8 kv heads), MHA."
    from workbench.memory import preset_config
    from workbench.sp.layout import layout_of
    table = []
    for kv, degree in ((kv, d) for kv in (8, 32) for d in degrees):
        config = preset_config("llama-3.1-8b", num_key_value_heads=kv)
        sent = {kind: sum(layout_of(**{kind: degree}).comm_bytes(config, n_tokens, dtype_bytes=2).values())
                for kind in ("ulysses", "ring", "gather")}
        ratios = {"gather / ring": sent["gather"] / sent["ring"], "gather / Ulysses": sent["gather"] / sent["ulysses"]}
        gigabytes = {f"{kind} GB": b / 1e9 for kind, b in sent.items()}
        table.append({"kv heads": kv, "degree": degree, **gigabytes, **ratios})
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,8192", help="row lengths, one packed FLAN-like row each")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per layout, interleaved (a warm-up before)")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    print(f"load average before: {os.getloadavg()}", flush=True)
    table = layouts_table(lengths, a.rounds)
    print(f"load average after: {os.getloadavg()}")
    print_table(table, f"Forward + backward of the tiny {FAMILY} (GQA 4:2), fp32, 2 CPU processes, one thread each: "
                       f"median of {a.rounds} interleaved rounds; bytes each process sent (counted = formula)")
    print_table(formula_table(), "Bytes one process sends per step (forward + backward), Llama 3.1 8B's shape, 131,072 "
                                 "tokens, bf16, by the layouts' formulas")


if __name__ == "__main__": main()
