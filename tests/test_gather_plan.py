"""The memory planner and the cost model on all-gather context parallelism (`workbench.sp.gather`), alone and inside
Ulysses, against real gather ranks.

Two launches (2 and 4 gloo processes on CPU) measure, on every rank:
- the live bytes of one `gather_attend` call (bf16, forward + backward), counted by `workbench.memory.LiveBytes` as
  the planner's fake-tensor measurements are: on the plain kernel they equal `gather_attention_bytes` exactly on every
  rank (it forms every query tile against the whole gathered row), on long and short rows; on the fused kernel they
  equal `gather_attention_bytes(..., kernel="fused", plans=ring_plans(...))` on every rank (one document under two
  plans, packed rows, a sliding window), and never exceed the bound it gives without the row;
- the bytes sent at the dispatcher (Ulysses all-to-alls, the all-gathers and reduce-scatters, as tests/test_gather.py
  counts them) in one training step of a tiny model: `step_cost(..., context="gather")`'s "all-to-all" and "ring";
- the FLOPs that ran (torch's `FlopCounterMode`): the busiest rank's equal `step_cost`'s total; the plain kernel's are
  the whole row's, more than the ring's met block pairs where a rank's queries meet fewer blocks.
Without processes: the planner's estimate names the gather's part and the layout plans a bf16 run through it;
`plan_layout(split="all")` ranks Ulysses x gather beside Ulysses and Ulysses x ring.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from test_ring_plan import FUSED_ROWS, HEAD_DIM, LENGTHS, N_TOKENS, SHORT, _row, _shape
from workbench.tiny_models import tiny_config, tiny_model
from workbench.flops import CPU_FLOP_FORMULAS, step_cost
from workbench.layout_search import LAYOUT_LEVERS, plan_layout
from workbench.launch import launch
from workbench.memory import Levers, LiveBytes, estimate, gather_attention_bytes, preset_config
from workbench.packing import FlatteningCollator, synthetic_lengths
from workbench.sp.balance import ring_batch
from workbench.sp.gather import gather_attend, gather_forward, register_gather
from workbench.sp.grid import ParallelGrid
from workbench.sp.layout import layout_of
from workbench.sp.ring import ring_plans
from workbench.sp_proofs import CountComm
from workbench.tiling import checkpoint_layers

MEMORY_CASES = {2: [(1, 2, 4, 4), (1, 2, 4, 2)],   # world size -> (ulysses, gather, heads, kv heads): MHA, GQA
                4: [(1, 4, 4, 1), (2, 2, 4, 1)]}   # gather 4 (MQA); Ulysses 2 x gather 2 (the kv head replicated)
PLAIN_ROWS = {"long": N_TOKENS, "short": SHORT}    # blocks of 128 or 64 rows; of 24 or 12 (a product sets the peak)
FUSED = ("zigzag", "contiguous", "packed", "windowed packed")  # tests/test_ring_plan.py's rows
FLAN = tuple(LENGTHS)  # tests/test_ring_plan.py's packed row
SHORT_DOCS = (8,) * 40  # documents inside blocks: under gather 4 (balanced plan) a block's queries meet only its own
COMM_CASES = {2: [(1, 2, "qwen2", False, "plain", FLAN), (1, 2, "qwen2", False, "fused", FLAN)],  # (ulysses,
              4: [(1, 4, "qwen2", False, "plain", SHORT_DOCS), (2, 2, "llama", True, "plain", FLAN),  # gather, family,
                  (2, 2, "mistral", False, "fused", FLAN)]}  # checkpointing, kernel, the row's documents)


def _attention_bytes(u, g, heads, kv_heads, plan, n_tokens=N_TOKENS, kernel="plain", lengths=None, window=None):
    "One gather_attend call on this rank as the layout hands it (heads already exchanged), bf16: its peak live bytes."
    grid = ParallelGrid.build(u, g)
    gen = torch.Generator().manual_seed(dist.get_rank())
    index, doc = _row(u, g, plan, n_tokens, lengths)
    m = index.shape[1]
    q = torch.randn(1, heads // u, m, HEAD_DIM, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(1, max(kv_heads, u) // u, m, HEAD_DIM, generator=gen).bfloat16().requires_grad_() for _ in "kv")
    w = torch.randn(q.shape, generator=gen).bfloat16()  # made outside: (out * w).sum() hands a fresh bf16 gradient
    with LiveBytes() as lb:
        (gather_attend(q, k, v, index, doc, grid.group("ring"), window=window, kernel=kernel) * w).sum().backward()
    return lb.peak - 4  # less the test's own bf16 scalar loss and its seed gradient (2 bytes each)


def _step(u, g, family, checkpointing, kernel, lengths):
    "One training step of a tiny model on this rank's shard: bytes sent per group and FLOPs that ran."
    grid = ParallelGrid.build(u, g)
    model = tiny_model(family, attn_implementation=register_gather()).train()
    if checkpointing: checkpoint_layers(model)
    row = FlatteningCollator()([{"input_ids": list(range(3, 3 + n))} for n in lengths])
    shard = ring_batch(row, grid)
    with CountComm() as comm, FlopCounterMode(display=False, custom_mapping=CPU_FLOP_FORMULAS) as flops:
        _, loss = gather_forward(model, shard, grid, kernel)
        loss.backward()
    return dict(a2a=comm.a2a, gather_bytes=comm.gathered_bytes + comm.scattered_bytes, flops=flops.get_total_flops())


def _rank(world):
    torch.set_num_threads(1)
    memory = {}
    for case in MEMORY_CASES[world]:
        memory[case, "gather rank"] = ParallelGrid.build(*case[:2]).rank("ring")
        for name, n_tokens in PLAIN_ROWS.items(): memory[case, name] = _attention_bytes(*case, "zigzag", n_tokens)
        for name in FUSED:
            plan, lengths, window, n_tokens = FUSED_ROWS[name]
            memory[case, name] = _attention_bytes(*case, plan, n_tokens, "fused", lengths, window)
    return memory, {case: _step(*case) for case in COMM_CASES[world]}


@pytest.fixture(scope="module")
def measured():
    return {world: launch(_rank, world, num_processes=world, cpu=True, quiet=True, timeout_s=60, deadline_s=120)
            for world in MEMORY_CASES}


def test_plain_gather_bytes_equal_live_bytes(measured):
    "Every rank forms its queries against the whole row: the same planned bytes on every rank, long rows and short."
    for world, ranks in measured.items():
        for u, g, heads, kv in MEMORY_CASES[world]:
            for name, n_tokens in PLAIN_ROWS.items():
                planned = sum(gather_attention_bytes(_shape(heads, kv), n_tokens // (u * g), u, g).values())
                got = [memory[(u, g, heads, kv), name] for memory, _ in ranks]
                assert got == [planned] * world, (u, g, heads, kv, name, got, planned)


def test_fused_gather_bytes_equal_live_bytes(measured):
    "The fused kernel on every rank: its live bytes equal the planner's from the rank's own calls, within the bound."
    for world, ranks in measured.items():
        for u, g, heads, kv in MEMORY_CASES[world]:
            for name in FUSED:
                plan, lengths, window, n_tokens = FUSED_ROWS[name]
                shape = replace(_shape(heads, kv), window=window)
                index, doc = _row(u, g, plan, n_tokens, lengths)
                n = index.numel() // (u * g)
                bound = sum(gather_attention_bytes(shape, n, u, g, kernel="fused").values())
                got = []
                for memory, _ in ranks:
                    plans = ring_plans(index, doc, memory[(u, g, heads, kv), "gather rank"], window=window)
                    planned = sum(gather_attention_bytes(shape, n, u, g, kernel="fused", plans=plans).values())
                    got.append(memory[(u, g, heads, kv), name])
                    assert got[-1] == planned <= bound, (u, g, heads, kv, name, got[-1], planned, bound)
                if name == "contiguous": assert max(got) == bound, (u, g, heads, kv, got, bound)


def test_comm_bytes_and_flops_equal_the_dispatcher(measured):
    "What every rank sends, and the busiest rank's FLOPs, as `step_cost` counts the gather; the ring's count is less."
    undercounted = 0
    for world, ranks in measured.items():
        for u, g, family, ck, kernel, lengths in COMM_CASES[world]:
            options = dict(sp=u, ring=g, levers=Levers(checkpointing=ck), dtype_bytes=4, ring_kernel=kernel)
            cost = step_cost(tiny_config(family), [list(lengths)], context="gather", **options)
            steps = [s[u, g, family, ck, kernel, lengths] for _, s in ranks]
            for s in steps:
                assert s["gather_bytes"] == cost.bytes["ring"] and s["a2a"] * 4 == cost.bytes["all-to-all"], (
                    u, g, family, s, cost.bytes)
            assert max(s["flops"] for s in steps) == cost.total, (u, g, family, kernel, [s["flops"] for s in steps],
                                                                  cost.total)
            # the ring's met block pairs; fused: the same calls
            ring = step_cost(tiny_config(family), [list(lengths)], **options)
            assert ring.total == cost.total if kernel == "fused" else ring.total <= cost.total
            undercounted += ring.total < cost.total
    # the row of short documents: counted as the ring's met pairs, gather 4's plain FLOPs fall short
    assert undercounted == 1


def test_the_layout_plans_a_gather_run():
    "The gather's part by name, larger on the plain kernel than the ring's; a bf16 run's readout plans it."
    from workbench.config import TrainConfig
    from workbench.readouts import expected_memory, memory_readout
    tiled = Levers(tiled_loss=True, tiled_mlp=True)  # so that attention, not the loss or the MLP, sets the peak
    gather = estimate("qwen3-4b", 131072, 2, ring=2, context="gather", levers=tiled, optimizer_offload=True)
    ring = estimate("qwen3-4b", 131072, 2, ring=2, levers=tiled, optimizer_offload=True)
    part = gather_attention_bytes(preset_config("qwen3-4b"), 32768, 2, 2)
    assert gather.parts["gather attention"] == (sum(part.values()) - part["saved for backward"]
                                                - part["gathered keys and values"])
    assert gather.parts["gather attention"] > ring.parts["ring attention"] > 0 and "gather=2" in str(gather)
    with pytest.raises(ValueError, match="the planner models"): estimate("qwen3-4b", 8192, ring=2, context="stripes")
    cfg = TrainConfig(model="qwen2", gather=2, max_tokens=256, dtype="bfloat16")
    planned, line = memory_readout(cfg)
    plan = expected_memory(cfg)
    assert planned == plan.total > 0 and f"{plan.gib:.3f} GiB" in line and (plan.context, plan.ring) == ("gather", 2)
    assert "gather attention" in plan.parts
    assert layout_of(2, gather=2).memory_options()["context"] == "gather"


def test_plan_layout_ranks_gather_beside_ring_and_ulysses():
    """split='all': every Ulysses x ring and Ulysses x gather layout
    the heads allow, each fitting the planner, ranked together."""
    config = preset_config("qwen3-4b", num_attention_heads=6, num_key_value_heads=2)  # Ulysses stops at 2 on 4 GPUs
    layouts = plan_layout(config, np.r_[synthetic_lengths("flan", 100), [12_000]], 4, 80, split="all")
    t = layouts.table
    kinds = set(zip(t.ulysses, t.ring, t.context))
    assert {(1, 4, "gather"), (2, 2, "gather"), (1, 4, "ring"), (2, 2, "ring"), (2, 1, "ring")} <= kinds
    for r in t[t.context == "gather"].itertuples():
        assert estimate(config, r.row_tokens, r.ulysses, r.dp, ring=r.ring, context="gather",
                        levers=LAYOUT_LEVERS[r.levers], optimizer_offload=r.optimizer_offload).gib == r.peak_gib <= 80
        assert r.ring_bytes > 0
    assert "gather" in " ".join(layouts.summary(len(layouts.frontier)).layout) or not (t.frontier
                                                                                       & (t.context == "gather")).any()
    assert set(plan_layout(config, [1000] * 4, 4, 80, split="gather").table.context) == {"gather"}
