"""`workbench.sp.layout`: each kind refuses what the old checks refused, in their words; the factory and the config
pick the kind from the degrees; on a real packed row every kind's shards hold each row position once, at the token
the row has there, and count the row's real tokens once (what training's metrics and evaluation's per-example sums
read). No process group: each process's shard is cut as that process would cut it."""
import pytest
import torch

from workbench.config import TrainConfig, _config, _parser
from workbench.samples import load_sample
from workbench.tiny_models import tiny_config
from workbench.packing import FlatteningCollator
from workbench.sp.grid import ParallelGrid, check_layout, check_sp
from workbench.sp.layout import LAYOUTS, Layout, RingLayout, UlyssesLayout, layout_of, register_layout
from workbench.sp.ring import comm_bytes

LLAMA = tiny_config("llama")                                                      # 4 heads, 4 kv heads
TWO_HEADS = tiny_config("llama", num_attention_heads=2, num_key_value_heads=1)   # Ulysses stops at 2


class Rank(ParallelGrid):
    "The grid seen from process `place` of its row's group, with no process group: what cutting a row reads."
    def __init__(self, ulysses: int, ring: int, place: int):
        super().__init__(ulysses, ring)
        self.place = place

    @property
    def sp_rank(self) -> int: return self.place


def message(fn) -> str:
    with pytest.raises(ValueError) as e: fn()
    return str(e.value)


@pytest.mark.parametrize("config, sp, ring, world, seq_len", [
    (LLAMA, 3, 1, None, None),        # 3 does not divide 4 heads
    (LLAMA, 8, 1, None, None),        # more processes than heads
    (TWO_HEADS, 4, 1, 4, None),       # past the kv heads
    (LLAMA, 2, 1, 6, None),           # the world is no multiple of sp... (6 % 2 == 0: accepted, dp 3)
    (LLAMA, 4, 1, 6, None),           # ... 6 % 4: refused
    (LLAMA, 2, 1, None, 1),           # a row of 1 token over 2 processes
    (LLAMA, 3, 2, None, None),        # ring: Ulysses 3 does not suit the heads
    (TWO_HEADS, 4, 2, 8, None),       # ring: Ulysses 4 past the kv heads
    (LLAMA, 2, 2, 6, None),           # ring: 2 x 2 does not divide 6
    (LLAMA, 1, 0, None, None),        # a ring of no process
])
def test_each_kind_refuses_what_the_old_pair_refused_in_its_words(config, sp, ring, world, seq_len):
    def old():  # train.rank_model / preflight_run / evaluate.preflight_eval before the layouts
        if ring > 1 or ring < 1: return check_layout(config, sp, ring, world_size=world)
        return check_sp(config, sp, world_size=world, seq_len=seq_len)
    def new(): return layout_of(sp, ring=ring).check(config, world_size=world, seq_len=seq_len)
    try: expected = old()
    except ValueError as e: expected = e
    if isinstance(expected, ValueError):
        # the degrees are refused when the layout is built (its own words), or by the same check in the same words
        got = message(new)
        assert got == str(expected) or got == "ring must be a positive integer, got 0", got
    else: assert new() == expected


def test_the_factory_and_the_config_pick_the_kind_from_the_degrees():
    assert type(layout_of()) is UlyssesLayout and type(layout_of(4, ring=1)) is UlyssesLayout
    hybrid = layout_of(2, ring=2, kernel="fused")
    assert (type(hybrid), hybrid.ulysses, hybrid.context, hybrid.kernel) == (RingLayout, 2, 2, "fused")
    assert (hybrid.sp_size, hybrid.fields, hybrid.degrees) == (4, ("ulysses", "ring"), (2, 2))
    assert (str(layout_of(2)), str(hybrid)) == ("ulysses=2", "ulysses=2 ring=2")
    assert list(LAYOUTS) == ["ring", "gather"] and LAYOUTS["ring"] is RingLayout  # the kinds registered in sp/layout
    assert "no sequence-parallel layout named ['stripe']" in message(lambda: layout_of(2, stripe=2))
    assert "not a Layout subclass" in message(lambda: register_layout(dict))
    with pytest.raises(TypeError, match="abstract"):  # a kind that leaves a method out cannot be built
        type("Half", (Layout,), {"degree": "half"})(1, 2)
    cfg = TrainConfig(ulysses=2, ring=2, dp=2, ring_kernel="plain")
    assert (type(cfg.layout), cfg.layout.kernel, cfg.world) == (RingLayout, "plain", 8)
    assert type(TrainConfig(ulysses=2).layout) is UlyssesLayout and TrainConfig(ulysses=2, dp=3).world == 6


def test_the_config_and_the_command_line_say_what_they_said():
    assert message(lambda: TrainConfig(ring=2, loss_chunk=64)) == (
        "ring (--ring) > 1 computes attention with its own exact blocks and does not combine with --attn other than "
        "sdpa, --loss-chunk or --shard yet: drop them or use --ring 1")
    assert message(lambda: TrainConfig(ring_kernel="fused")) == (
        "ring_kernel (--ring-kernel) 'fused' chooses the ring's block-pair kernel, and this run has no ring or gather: "
        "set ring (--ring) or gather (--gather) to 2 or more, or drop --ring-kernel")
    p = _parser()
    said = []
    p.error = lambda text: said.append(text) or (_ for _ in ()).throw(SystemExit(2))
    for argv in (["--ulysses", "2", "--nproc", "3"], ["--ulysses", "2", "--ring", "2", "--nproc", "6"],
                 ["--ulysses", "2", "--dp", "2", "--nproc", "2"],
                 ["--ulysses", "2", "--ring", "2", "--dp", "2", "--nproc", "4"]):
        with pytest.raises(SystemExit): _config(p, p.parse_args(argv), 1)
    assert said == [
        "--nproc 3 is not a multiple of --ulysses 2: the processes form a dp x ulysses grid; use --nproc 2 or an "
        "--ulysses that divides 3",
        "--nproc 6 is not a multiple of --ulysses x --ring = 2 x 2 = 4: the processes form a dp x ulysses x ring grid; "
        "use --nproc 4 or an --ulysses/--ring that divides 6",
        "--nproc 2 but --ulysses x --dp = 2 x 2 = 4",
        "--nproc 4 but --ulysses x --ring x --dp = 2 x 2 x 2 = 8"]


@pytest.fixture(scope="module")
def row():
    "A real packed row: five FLAN-like examples, every token trained."
    return FlatteningCollator(train_all_tokens=True)(load_sample("flan_like", limit=5))


@pytest.mark.parametrize("ulysses, ring", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)])
def test_every_shard_holds_each_row_position_once_at_its_token(row, ulysses, ring):
    layout, real = layout_of(ulysses, ring=ring), row["input_ids"].shape[1]
    places = [Rank(ulysses, ring, place) for place in range(ulysses * ring)]
    shards = [layout.shard(row, grid) for grid in places]
    positions = [layout.token_positions(shard, grid) for shard, grid in zip(shards, places)]
    n = layout.padded_tokens(real)
    assert sorted(torch.cat(positions).tolist()) == list(range(n))  # every position of the padded row, once
    padded = torch.cat([row["input_ids"][0], torch.zeros(n - real, dtype=row["input_ids"].dtype)])
    for shard, where in zip(shards, positions):
        real_ones = where < real  # the padding's ids are the collator's choice; the row's own tokens are not
        assert torch.equal(shard["input_ids"][0][real_ones], padded[where][real_ones])
    assert sum(layout.shard_tokens(s, real, g) for s, g in zip(shards, places)) == real
    assert {layout.row_tokens(s) for s in shards} == {n}
    assert layout.comm_bytes(LLAMA, n, True, 2) == comm_bytes(LLAMA, n, ulysses, ring, True, 2)


def test_the_ring_deals_tokens_out_of_order_so_contiguous_positions_would_be_wrong(row):
    "The broken variant: a ring shard's positions read as Ulysses reads them (contiguous) miss the shard's tokens."
    ring, grid = layout_of(ring=2), Rank(1, 2, 0)
    shard = ring.shard(row, grid)
    contiguous = torch.arange(shard["input_ids"].shape[1])  # what Ulysses' positions would say for place 0
    assert not torch.equal(ring.token_positions(shard, grid), contiguous)
    assert not torch.equal(shard["input_ids"][0], row["input_ids"][0][contiguous])
