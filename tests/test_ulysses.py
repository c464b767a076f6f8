"""Distributed proofs of `workbench.sp.ulysses`: P CPU processes joined by gloo compute what one process computes.

Every launch forks its processes from this (warm) interpreter and checks many cases at once, so each test stays well
under a minute on two cores. Equality is asserted on real tiny transformers models: logits, the loss and every
parameter gradient, within 1e-5 relative error in fp32 and 1e-10 in fp64.
"""
import pytest
import torch
import torch.distributed as dist

from workbench.core import shift_labels
from workbench.tiny_models import tiny_config, tiny_model
from workbench.launch import launch
from workbench.packing import FlatteningCollator
from workbench.sp_proofs import Case, case_rows, prove_equivalence
from workbench.sp.grid import check_sp, grid_degrees, ParallelGrid, sp_sizes
from workbench.sp.all_to_all import all_to_all, simulate_all_to_all
from workbench.sp.loss import global_loss, sync_gradients
from workbench.sp_measure import memory_table
from workbench.sp.ulysses import register_ulysses, sp_forward
from workbench.sp.shard import shard_batch

FAMILIES = ("llama", "qwen2", "mistral")  # MHA; GQA with 2 kv heads (replicated at P=4); GQA + sliding window 16
VARLEN = "workbench.attention"  # registers the "workbench_varlen" attention (and its mask function) on import
INNERS = ("eager", "sdpa", "workbench_varlen")
TOL = {"float32": 1e-5, "float64": 1e-10}


def matrix(dtype: str = "float32") -> list:
    "Every family × inner attention × packed / one document, with a 203-token row (not a multiple of 2 or 4)."
    return [Case(f, inner, packed=packed, dtype=dtype, requires=VARLEN if inner == "workbench_varlen" else None)
            for f in FAMILIES for inner in INNERS for packed in (True, False)]


def assert_equal_to_one_process(results: list, world_size: int, sp_size: int):
    assert len(results) > 0
    for r in results:
        tol = TOL[r["case"].dtype]
        worst = max(v for v in (r["logits"], r["loss"], r["grads"]) if v is not None)  # logits: None when tiled
        assert (r["logits"] is None) == bool(r["case"].loss_chunk)
        assert r["sp"] == sp_size and r["dp"] == world_size // sp_size
        assert r["n_params"] >= 21, f"{r['case']}: only {r['n_params']} parameters got gradients"
        assert worst <= tol, (f"{r['case']} at SP={sp_size}, DP={world_size // sp_size}: relative error logits "
                              f"{r['logits']}, loss {r['loss']:.2e}, gradients {r['grads']:.2e} > {tol}")


# ---------------------------------------------------------------- preflight and sharding: no processes needed

def test_preflight_refuses_before_any_work():
    qwen = tiny_config("qwen2")  # 4 heads, 2 kv heads
    assert check_sp(qwen, 4).kv_repeat == 2 and check_sp(qwen, 2).kv_repeat == 1
    assert check_sp(qwen, 2, world_size=8).dp_size == 4
    assert sp_sizes(qwen) == [1, 2, 4] and sp_sizes(qwen, world_size=6) == [1, 2]
    with pytest.raises(ValueError, match=r"sp_size=3 does not divide the 4 attention "
                                         r"heads.*work for this qwen2 model: \[1, 2, 4\]"):
        check_sp(qwen, 3)
    with pytest.raises(ValueError, match=r"more than the 4 attention heads.*heads >= sp_size"):
        check_sp(qwen, 8)
    with pytest.raises(ValueError, match=r"world_size=6 is not a multiple of sp_size=4.*use sp_size in \[1, 2, 3, 6\]"):
        check_sp(qwen, 4, world_size=6)
    with pytest.raises(ValueError, match=r"row of 3 tokens cannot be split over sp_size=4"):
        check_sp(qwen, 4, seq_len=3)
    odd_kv = tiny_config("llama", num_attention_heads=6, num_key_value_heads=4, head_dim=16)
    with pytest.raises(ValueError, match=r"cannot split the 4 key/value heads"):
        check_sp(odd_kv, 3)
    assert grid_degrees(8, 2) == 4
    with pytest.raises(ValueError, match="positive"):
        grid_degrees(4, 0)


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4, 5])
def test_shards_put_back_together_are_the_globally_shifted_row(sp_size):
    row = case_rows(Case(tokens=203))[0]
    shards = [shard_batch(row, r, sp_size) for r in range(sp_size)]
    n, padded = 203, -(-203 // sp_size) * sp_size
    joined = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}
    assert joined["input_ids"].shape[1] == padded
    assert torch.equal(joined["input_ids"][:, :n], row["input_ids"])
    assert torch.equal(joined["position_ids"][:, :n], row["position_ids"])  # global values, cut per token
    assert torch.equal(joined["shift_labels"][:, :n], shift_labels(row["labels"]))
    assert (joined["shift_labels"][:, n:] == -100).all()  # the dummy example trains nothing
    cu = row["cu_seq_lens_q"].tolist() + ([padded] if padded > n else [])
    assert all(s["cu_seq_lens_q"].tolist() == cu for s in shards)  # boundaries stay global
    assert {s["num_items_in_batch"] for s in shards} == {int((shift_labels(row["labels"]) != -100).sum())}


def test_single_process_wrapper_refuses_what_it_cannot_compute():
    model = tiny_model("llama", attn_implementation=register_ulysses("sdpa"))
    shard = shard_batch(FlatteningCollator(train_all_tokens=True)([{"input_ids": list(range(3, 40))}]), 0, 1)
    with pytest.raises(ValueError, match="sp_grid=grid"):
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
              cu_seq_lens_q=shard["cu_seq_lens_q"], use_cache=False)
    with pytest.raises(ValueError, match="carries no attention_mask"):
        model(input_ids=shard["input_ids"], attention_mask=torch.ones_like(shard["input_ids"]), use_cache=False,
              sp_grid=ParallelGrid(), cu_seq_lens_q=shard["cu_seq_lens_q"])
    too_many = ParallelGrid(ulysses=8)  # 4 heads cannot split over 8 processes, whatever the mesh
    with pytest.raises(ValueError, match="heads >= sp_size"):
        sp_forward(model, shard, too_many)


# ---------------------------------------------------------------- equivalence: 1, 2 and 4 processes

def test_one_process_equals_plain_attention():
    assert_equal_to_one_process(prove_equivalence(matrix(), world_size=1, sp_size=1), 1, 1)


def test_two_processes_equal_one():
    cases = matrix() + [Case("qwen2", "sdpa", dtype="float64"), Case("mistral", "eager", packed=False, dtype="float64"),
                        Case("llama", "sdpa", tokens=256),  # a row that needs no padding
                        Case("mistral", "sdpa", checkpointing=True)]  # layers recomputed in backward: all-to-alls rerun
    assert_equal_to_one_process(prove_equivalence(cases, world_size=2, sp_size=2), 2, 2)


def test_tiled_loss_and_mlp_under_sp2_equal_one_untiled_process():
    """fp64: the tiled loss (tiles smaller than a shard), the tiled MLP and
    the lean kernels under SP=2 on packed rows equal one untiled process."""
    cases = [Case("llama", "sdpa", dtype="float64", loss_chunk=16, mlp_chunk=24),
             Case("qwen2", "eager", dtype="float64", loss_chunk=37, mlp_chunk=7, checkpointing=True),
             Case("qwen3", "sdpa", dtype="float64", loss_chunk=16, mlp_chunk=24, lean=True)]
    results = prove_equivalence(cases, world_size=2, sp_size=2)
    assert_equal_to_one_process(results, 2, 2)
    assert all(r["loss"] <= 1e-10 and r["grads"] <= 1e-10 for r in results), results


def test_four_processes_equal_one():
    cases = matrix() + [Case("qwen2", "eager", dtype="float64"), Case("mistral", "sdpa", tokens=64),
                        Case("mistral", "workbench_varlen", dtype="float64", requires=VARLEN)]
    assert_equal_to_one_process(prove_equivalence(cases, world_size=4, sp_size=4), 4, 4)


def test_dp2_x_sp2_equals_one_process_on_both_rows():
    cases = matrix() + [Case("qwen2", "sdpa", dtype="float64")]
    assert_equal_to_one_process(prove_equivalence(cases, world_size=4, sp_size=2), 4, 2)


# ---------------------------------------------------------------- the exchange and the gradient scale

def _exchange_worker():
    "Every rank: the all-to-all and its backward against the single-process simulation, on a non-contiguous input."
    grid = ParallelGrid.build(dist.get_world_size())
    p, r = grid.sp_size, grid.sp_rank
    torch.manual_seed(0)
    full = [torch.randn(1, 8, 12, 3, dtype=torch.float64) for _ in range(p)]  # every rank's [B, H, N/P, D]
    x = full[r].transpose(2, 3).detach().requires_grad_()                      # non-contiguous [B, H, D, N/P]
    out = all_to_all(x.transpose(2, 3), grid.group("ulysses"), scatter_dim=1, gather_dim=2)
    expected = simulate_all_to_all(full, scatter_dim=1, gather_dim=2)[r]
    weights = [torch.randn_like(e) for e in simulate_all_to_all(full, 1, 2)]   # d loss / d out, per rank
    (out * weights[r]).sum().backward()
    grad_expected = simulate_all_to_all(weights, scatter_dim=2, gather_dim=1)[r]  # the inverse exchange
    return dict(forward=torch.equal(out, expected), contiguous=out.is_contiguous(),
                backward=torch.equal(x.grad.transpose(2, 3), grad_expected))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_and_its_backward_match_the_simulation(world_size):
    for r in launch(_exchange_worker, num_processes=world_size, cpu=True, quiet=True):
        assert r == dict(forward=True, contiguous=True, backward=True)


def _gradient_scale_worker():
    "The exact loss against all-gathering the losses and backpropagating their mean on every rank (HF's formula)."
    from torch.distributed.nn.functional import all_gather
    grid = ParallelGrid.build(dist.get_world_size())
    row = case_rows(Case("llama", "sdpa"))[0]
    ref = tiny_model("llama")
    ref(**{k: row[k] for k in ("input_ids", "position_ids")}, labels=row["labels"], use_cache=False).loss.backward()
    ratios = {}
    for name in ("exact", "all_gather_mean"):
        model = tiny_model("llama", attn_implementation=register_ulysses("sdpa"))
        shard = shard_batch(row, grid.sp_rank, grid.sp_size)
        logits, loss = sp_forward(model, shard, grid)
        if name == "all_gather_mean":
            local = torch.nn.functional.cross_entropy(logits[0], shard["shift_labels"][0], reduction="sum")
            count = (shard["shift_labels"] != -100).sum().float()
            sums, counts = all_gather(local), all_gather(count)
            loss = torch.stack(sums).sum() / torch.stack(counts).sum()  # the whole loss, on every rank
        loss.backward()
        sync_gradients(model, grid)
        ratios[name] = (model.lm_head.weight.grad.norm() / ref.lm_head.weight.grad.norm()).item()
        ratios[name + "_loss"] = global_loss(loss, grid) if name == "exact" else loss.item()
    return ratios


def test_gradient_scale_is_one_process_not_p_times():
    r = launch(_gradient_scale_worker, num_processes=2, cpu=True, quiet=True)[0]
    assert abs(r["exact"] - 1) < 1e-5
    assert abs(r["all_gather_mean"] - 2) < 1e-5  # the loss is right, but its gradients are P times too large
    assert abs(r["exact_loss"] - r["all_gather_mean_loss"]) < 1e-5


# ---------------------------------------------------------------- memory and communication

def test_saved_activations_shrink_as_one_over_p_and_traffic_is_4nh_over_p():
    rows = memory_table(Case("llama", "sdpa", packed=False, tokens=1024), sizes=(1, 2, 4))
    for r in rows:
        assert r["other_vs_sp1"] <= 1.1 / r["sp"], r
        assert r["a2a"] == r["a2a_formula"], r
    config = tiny_config("llama")
    assert rows[2]["a2a"] == 4 * 1024 * config.hidden_size // 4  # 4·N·h/P for multi-head attention
    gqa = memory_table(Case("qwen2", "sdpa", tokens=1024), sizes=(1, 4))  # kv heads replicated 2x at P=4
    assert gqa[1]["other_vs_sp1"] <= 1.1 / 4 and gqa[1]["a2a"] == gqa[1]["a2a_formula"]
