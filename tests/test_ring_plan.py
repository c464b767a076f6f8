"""The memory planner and the cost model on ring attention and the hybrid Ulysses x ring layout, against real ring
ranks.

Two launches (2 and 4 gloo processes on CPU) measure, on every rank:
- the live bytes of one `ring_attend` call (bf16, forward + backward), counted by `workbench.memory.LiveBytes` as the
  planner's fake-tensor measurements are: on the plain kernel they equal `ring_attention_bytes` exactly on a rank that
  computes every block pair (the planner's terms are the tensors `_RingAttention` makes, read off its code), and no rank
  holds more; on the fused kernel they equal `ring_attention_bytes(..., kernel="fused", plans=ring_plans(...))` on every
  rank (one document under two plans, packed rows of many short documents, sliding windows), and never exceed the
  bound it gives without the row;
- the bytes sent at the dispatcher (`workbench.sp_proofs.CountComm`: Ulysses all-to-alls, ring sends) during one
  training step of a tiny model: equal to `step_cost`'s "all-to-all" and "ring" bytes;
- the FLOPs that ran (torch's `FlopCounterMode`): the busiest ring rank's equal `step_cost`'s total.
Then `workbench.train.run` with --ring prints a memory readout and a step prediction and records "predicted".
"""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from workbench.tiny_models import tiny_config, tiny_model
from workbench.cost import DEVICES, predict_step
from workbench.flops import CPU_FLOP_FORMULAS, interacting_blocks, ring_blocks, step_cost
from workbench.layout_search import LAYOUT_LEVERS, plan_layout
from workbench.launch import launch
from workbench.memory import LiveBytes, Levers, Shape, estimate, max_context, preset_config, ring_attention_bytes
from workbench.packing import FlatteningCollator, synthetic_lengths
from workbench.sp.balance import PLANS, plan_row, ring_batch, zigzag_plan
from workbench.sp.grid import ParallelGrid, check_layout
from workbench.sp_proofs import CountComm
from workbench.sp.ring import QUERY_TILE, block_pairs, documents, register_ring, ring_attend, ring_forward, ring_plans
from workbench.sp.shard import contiguous_plan
from workbench.tiling import checkpoint_layers

HEAD_DIM = 16
MEMORY_CASES = {2: [(1, 2, 4, 4), (1, 2, 4, 2)],   # world size -> (ulysses, ring, heads, kv heads): MHA, GQA
                4: [(1, 4, 4, 1), (2, 2, 4, 1)]}   # ring of 4 (MQA); hybrid 2 x 2 (the kv head replicated over Ulysses)
N_TOKENS = 256  # tokens of the row (ring blocks of 128 or 64)
# query rows per tile in the tiled case (at least 2 x head_dim):
# blocks of 128 or 64 rows in 4 or 2 tiles, the last one short
TILE = 40
# tokens of a short row: blocks of 24 or 12 rows, shorter than 2 x head_dim (a product, not the scores, sets the peak)
SHORT = 48
LENGTHS = [150, 33, 1, 90, 64]  # a packed row: some block pairs are skipped, so ranks differ in work
FUSED_ROWS = {  # the fused kernel's rows: (plan, packed lengths or None for one document, sliding window, row tokens)
    "zigzag": ("zigzag", None, None, N_TOKENS), "contiguous": ("contiguous", None, None, N_TOKENS),
    "packed": ("balanced", LENGTHS, None, N_TOKENS), "short": ("balanced", [3] * 60 + [16], None, N_TOKENS),
    "windowed": ("zigzag", None, 16, N_TOKENS), "windowed packed": ("balanced", LENGTHS, 16, N_TOKENS),
    "long window": ("zigzag", None, 300, 2048)}  # a band's mask, built beside the block, sets the peak
# (ulysses, ring, family, checkpointing, kernel)
COMM_CASES = {2: [(1, 2, "qwen2", False, "plain"), (1, 2, "qwen2", False, "fused")],
              4: [(1, 4, "qwen2", False, "plain"), (2, 2, "qwen2", True, "plain"), (2, 2, "llama", False, "plain"),
                  # mistral: its sliding window in the calls
                  (2, 2, "qwen2", True, "fused"), (1, 4, "mistral", False, "fused")]}


def _shape(heads, kv_heads) -> Shape:
    return Shape(hidden=heads * HEAD_DIM, layers=1, heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, intermediate=64,
                 vocab=64, tied=False, qk_norm=False)


def _row(u, r, plan, n_tokens=N_TOKENS, lengths=None):
    """The ring blocks `[r, m]` and every token's document: one document
    of `n_tokens` under `plan`, or `lengths` packed under `plan`."""
    if lengths is None:
        index = zigzag_plan(n_tokens, u * r) if plan == "zigzag" else contiguous_plan(n_tokens, u * r)
        return index.reshape(r, -1), documents(torch.tensor([0, n_tokens]))
    padded, index = plan_row(FlatteningCollator(train_all_tokens=True)([{"input_ids": [1] * n} for n in lengths]),
                             u * r, plan)
    return index.reshape(r, -1), documents(padded["cu_seq_lens_q"])


def _attention_bytes(u, r, heads, kv_heads, plan, tile=QUERY_TILE, n_tokens=N_TOKENS, kernel="plain", lengths=None,
                     window=None):
    """One ring_attend call on this rank as the hybrid layout hands
    it (heads already exchanged), bf16: its peak live bytes."""
    grid = ParallelGrid.build(u, r)
    g = torch.Generator().manual_seed(dist.get_rank())
    index, doc = _row(u, r, plan, n_tokens, lengths)  # made outside, as the layer makes the documents before attention
    m = index.shape[1]
    q = torch.randn(1, heads // u, m, HEAD_DIM, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, max(kv_heads, u) // u, m, HEAD_DIM, generator=g).bfloat16().requires_grad_() for _ in "kv")
    # made outside: (out * w).sum() hands the ring a fresh bf16 gradient
    w = torch.randn(q.shape, generator=g).bfloat16()
    with LiveBytes() as lb:
        (ring_attend(q, k, v, index, doc, grid.group("ring"), tile=tile, window=window, kernel=kernel)
         * w).sum().backward()
    return lb.peak - 4  # less the test's own bf16 scalar loss and its seed gradient (2 bytes each)


def _step(u, r, family, checkpointing, kernel):
    "One training step of a tiny model on this rank's shard: bytes sent per group and FLOPs that ran."
    grid = ParallelGrid.build(u, r)
    model = tiny_model(family, attn_implementation=register_ring()).train()
    if checkpointing: checkpoint_layers(model)
    row = FlatteningCollator()([{"input_ids": list(range(3, 3 + n))} for n in LENGTHS])
    shard = ring_batch(row, grid)
    with CountComm() as comm, FlopCounterMode(display=False, custom_mapping=CPU_FLOP_FORMULAS) as flops:
        _, loss = ring_forward(model, shard, grid, kernel)
        loss.backward()
    return dict(a2a=comm.a2a, p2p_bytes=comm.p2p_bytes, flops=flops.get_total_flops(), ring_rank=grid.rank("ring"))


def _rank(world):
    torch.set_num_threads(1)
    memory = {(case, plan): _attention_bytes(*case, plan)
              for case in MEMORY_CASES[world] for plan in ("zigzag", "contiguous")}
    memory.update({(case, "tiled"): _attention_bytes(*case, "zigzag", tile=TILE) for case in MEMORY_CASES[world]})
    memory.update({(case, "short"): _attention_bytes(*case, "zigzag", n_tokens=SHORT) for case in MEMORY_CASES[world]})
    for case in MEMORY_CASES[world]:
        for name, (plan, lengths, window, n_tokens) in FUSED_ROWS.items():
            memory[case, "fused", name] = _attention_bytes(*case, plan, n_tokens=n_tokens, kernel="fused",
                                                           lengths=lengths, window=window)
        memory[case, "ring rank"] = ParallelGrid.build(*case[:2]).rank("ring")
    return memory, {case: _step(*case) for case in COMM_CASES[world]}


@pytest.fixture(scope="module")
def measured():
    return {world: launch(_rank, world, num_processes=world, cpu=True, quiet=True, timeout_s=60, deadline_s=120)
            for world in MEMORY_CASES}


def test_ring_attention_bytes_equal_live_bytes(measured):
    "Zigzag on one document: every rank computes every pair and holds exactly the planned bytes; contiguous: at most."
    for world, ranks in measured.items():
        for u, r, heads, kv in MEMORY_CASES[world]:
            planned = sum(ring_attention_bytes(_shape(heads, kv), N_TOKENS // (u * r), u, r).values())
            zigzag = [memory[(u, r, heads, kv), "zigzag"] for memory, _ in ranks]
            contiguous = [memory[(u, r, heads, kv), "contiguous"] for memory, _ in ranks]
            assert zigzag == [planned] * world, (u, r, heads, kv, zigzag, planned)
            # the first ring rank skips pairs: holds less
            assert max(contiguous) == planned and min(contiguous) < planned
            tiled = sum(ring_attention_bytes(_shape(heads, kv), N_TOKENS // (u * r), u, r, tile=TILE).values())
            assert [memory[(u, r, heads, kv), "tiled"] for memory, _ in ranks] == [tiled] * world and tiled < planned
            short = sum(ring_attention_bytes(_shape(heads, kv), SHORT // (u * r), u, r).values())
            assert [memory[(u, r, heads, kv), "short"] for memory, _ in ranks] == [short] * world, (u, r, heads, kv)


def test_fused_ring_bytes_equal_live_bytes(measured):
    """The fused kernel on every rank: its live bytes equal the planner's from the rank's own calls (`ring_plans`), on
    one document (zigzag, contiguous), on packed rows of many short documents and under sliding windows; none exceeds
    the bound the planner gives without the row, which a contiguous plan's later ranks reach. Binding steps differ: a
    call's gradients, a band's mask, a GQA group's sum, or the hand-off."""
    for world, ranks in measured.items():
        for u, r, heads, kv in MEMORY_CASES[world]:
            for name, (plan, lengths, window, n_tokens) in FUSED_ROWS.items():
                shape = replace(_shape(heads, kv), window=window)
                index, doc = _row(u, r, plan, n_tokens, lengths)
                n = index.numel() // (u * r)
                # the largest calls at every step
                bound = sum(ring_attention_bytes(shape, n, u, r, kernel="fused").values())
                measured_bytes = []
                for memory, _ in ranks:
                    plans = ring_plans(index, doc, memory[(u, r, heads, kv), "ring rank"], window=window)
                    planned = sum(ring_attention_bytes(shape, n, u, r, kernel="fused", plans=plans).values())
                    measured_bytes.append(memory[(u, r, heads, kv), "fused", name])
                    assert measured_bytes[-1] == planned <= bound, (u, r, heads, kv, name, measured_bytes[-1], planned,
                                                                    bound)
                if name == "contiguous": assert max(measured_bytes) == bound, (u, r, heads, kv, measured_bytes, bound)


def test_comm_bytes_and_flops_equal_the_dispatcher(measured):
    for world, ranks in measured.items():
        for u, r, family, ck, kernel in COMM_CASES[world]:
            cost = step_cost(tiny_config(family), [LENGTHS], sp=u, ring=r, levers=Levers(checkpointing=ck),
                             dtype_bytes=4, ring_kernel=kernel)
            steps = [s[u, r, family, ck, kernel] for _, s in ranks]
            for s in steps:  # every rank sends the same: its blocks, its gradients, its all-to-alls
                assert s["p2p_bytes"] == cost.bytes["ring"] and s["a2a"] * 4 == cost.bytes["all-to-all"], (
                    u, r, family, s, cost.bytes)
            assert max(s["flops"] for s in steps) == cost.total, (u, r, family, kernel, [s["flops"] for s in steps],
                                                                  cost.total)
            assert cost.bytes["all-to-all"] > 0 if u > 1 else cost.bytes["all-to-all"] == 0


def test_interacting_blocks_is_block_pairs():
    "The running-minimum answer equals the mask answer on FLAN-like rows, every plan, with and without a window."
    rng = np.random.default_rng(0)
    for _ in range(3):
        lens = synthetic_lengths("flan", int(rng.integers(2, 6)), seed=int(rng.integers(1000))).tolist()
        for (u, r), strategy, window in zip([(1, 2), (2, 2), (1, 4), (2, 3)] * 3, PLANS * 4, [0, 7, 64, 0] * 3):
            cu, blocks = ring_blocks(lens, u, r, strategy)
            assert (interacting_blocks(blocks, cu, window) == block_pairs(blocks, documents(torch.tensor(cu)), window
                                                                          or None).numpy()).all()
            padded, plan = plan_row(FlatteningCollator(train_all_tokens=True)([{"input_ids": [1] * n} for n in lens]),
                                    u * r, strategy)
            assert cu.tolist() == padded["cu_seq_lens_q"].tolist() and torch.equal(blocks, plan.reshape(r, -1))


def test_planner_past_the_head_limit():
    "Heads that refuse Ulysses 4 get an estimate under Ulysses 2 x ring 2 and ring 4, with the ring's part named."
    odd = preset_config("qwen3-4b", num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"): estimate(odd, 8192, 4)
    tiled = Levers(tiled_loss=True, tiled_mlp=True)  # so that attention, not the loss or the MLP, sets the peak
    for u, r in ((2, 2), (1, 4)):
        e = estimate(odd, 131072, u, ring=r, levers=tiled, optimizer_offload=True)
        ring = ring_attention_bytes(odd, 32768, u, r)
        assert e.parts["ring attention"] == sum(ring.values()) - ring["saved for backward"] > 0
        assert e.total == sum(e.parts.values()) and e.ring == r and e.local_tokens == 32768 and "ring=" in str(e)
        # the MLP binds
        assert estimate(odd, 131072, u, ring=r, levers=Levers(tiled_loss=True),
                        optimizer_offload=True).parts["ring attention"] == 0
    # the loss binds a short row
    assert estimate(odd, 8192, 2, ring=2, optimizer_offload=True).parts["ring attention"] == 0
    assert "ring attention" not in estimate(odd, 8192, 2).parts  # Ulysses alone: unchanged
    lim = max_context(odd, 80, 2, ring=2, optimizer_offload=True)
    assert lim.tokens % 4 == 0 and estimate(odd, lim.tokens + 4, 2, ring=2, optimizer_offload=True).gib > 80


@pytest.mark.parametrize("call,match", [
    (lambda: estimate("qwen3-4b", 8192, ring=0), "ring must be a positive integer"),
    (lambda: estimate("qwen3-4b", 8192, ring=-2), "ring must be a positive integer"),
    (lambda: estimate("qwen3-4b", 8192, ring=True), "ring must be a positive integer"),
    (lambda: estimate("qwen3-4b", 8192, ring=2.0), "ring must be a positive integer"),
    (lambda: estimate("qwen3-4b", 8190, 2, ring=2), "multiple of sp x ring"),
    (lambda: estimate("qwen3-4b", 8192, 3, ring=2), "does not divide the 32 attention heads"),
    (lambda: ring_attention_bytes("qwen3-4b", 1024, ring=1), "ring >= 2"),
    (lambda: step_cost(tiny_config("llama"), [[64]], ring=0), "positive integers"),
    (lambda: step_cost(tiny_config("llama"), [[64]], sp=3, ring=2), "does not suit"),
    (lambda: step_cost(tiny_config("llama"), [[64]], ring=2, ring_plan="stripes"), "choose one of"),
    (lambda: plan_layout("qwen3-4b", [100], 4, split="rings"), "unknown split"),
])
def test_bad_ring_inputs(call, match):
    with pytest.raises(ValueError, match=match): call()


def test_prediction_puts_each_group_on_its_link():
    "Ulysses inside a node over NVLink; a ring across nodes over the network; the ring's FLOPs are its computed pairs."
    dev = DEVICES["H100 SXM"]
    for u, r, ring_link in ((4, 2, dev.nvlink), (8, 2, dev.internode), (1, 16, dev.internode)):
        p = predict_step("qwen3-4b", [[131072]], dev, sp=u, ring=r, levers=Levers())
        b = p.cost.bytes
        assert p.terms["comm"] == pytest.approx(b["all-to-all"] / dev.nvlink
                                                + (b["ring"] + b["gradient reduction"]) / ring_link)
        assert b["ring"] > 0 and (b["all-to-all"] > 0) == (u > 1)
    one = step_cost("qwen3-4b", [[131072]], sp=1, ring=4, ring_plan="contiguous")
    d = 4 * 32 * 128 * 32768**2 * 36  # 4 * heads * head_dim * m^2 per pair, every layer
    assert one.flops["forward attention"] == 4 * d  # the last rank of a contiguous causal row computes all 4 pairs


@pytest.mark.parametrize("split,gpus,memory", [("ring", 2, 40), ("hybrid", 4, 80), ("hybrid", 8, 40)])
def test_plan_layout_ring_never_refused(split, gpus, memory):
    "Every returned ring / hybrid layout passes check_layout and fits the memory planner (ring part included)."
    # Ulysses stops at 2 on 4 or 8 GPUs
    config = preset_config("qwen3-4b", num_attention_heads=6, num_key_value_heads=2)
    layouts = plan_layout(config, np.r_[synthetic_lengths("flan", 100), [12_000]], gpus, memory, split=split)
    for r in layouts.table.itertuples():
        check_layout(config, r.ulysses, r.ring, world_size=gpus)
        assert r.sp == r.ulysses * r.ring and r.sp * r.dp == gpus and r.row_tokens % r.sp == 0
        assert estimate(config, r.row_tokens, r.ulysses, r.dp, ring=r.ring, levers=LAYOUT_LEVERS[r.levers],
                        optimizer_offload=r.optimizer_offload).gib <= memory
        assert (r.ring_bytes > 0) == (r.ring > 1) and (r.a2a_bytes > 0) == (r.ulysses > 1)
    if split == "ring": assert set(layouts.table.ulysses) == {1}
    assert (layouts.table.ring > 1).any() and layouts.table.frontier.any()  # a ring layout fits a 12K row here
    assert all("ulysses" in layout for layout, _ in layouts.refused)


def test_ring_run_has_readout_and_prediction(tmp_path, capfd):
    """Ulysses 2 x ring 2 on 4 processes, the default kernel (fused on CPU): the planner's readout line for its CPU
    path, a step prediction, config.json's kernel, planned peak and 'predicted', MFU rows."""
    sp, ring = 2, 2
    from workbench.config import TrainConfig
    from workbench.readouts import memory_readout
    from workbench.tracking import read_metrics
    from workbench.train import run
    cfg = TrainConfig(model="qwen2", ulysses=sp, ring=ring, steps=2, max_tokens=256, dtype="bfloat16",
                      out=str(tmp_path / "run"))
    run(cfg)
    out = capfd.readouterr().out
    assert cfg.ring_kernel == "auto" and cfg.block_kernel == "fused"  # the default, settled on a machine without CUDA
    assert "expected per-rank peak (planner, bf16, the fused ring kernel's CPU path)" in out and "predicted on" in out
    assert "not compared with the planner" in out  # a CPU's resident memory is not the planner's device bytes
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    planned, line = memory_readout(cfg)
    # the planner's activation terms are bf16/fp16 only: no fp32 figure
    unplanned, why = memory_readout(cfg, torch.float32)
    assert unplanned is None and "not planned for fp32" in why and f"{planned / 2**30:.3f} GiB" in why
    assert (record["expected_peak_bytes"] == planned > 0 and f"{planned / 2**30:.3f} GiB" in line
            and record["ring_kernel"] == "fused")
    assert set(record["predicted"]) == {"step_s", "mfu", "flops_per_step", "peak_flops", "device"}
    assert record["predicted"]["step_s"] > 0 and 0 < record["predicted"]["mfu"] < 1
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 * sp * ring and all(r["mfu"] > 0 for r in rows)
