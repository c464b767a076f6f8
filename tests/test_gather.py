"""Distributed proofs of `workbench.sp.gather` (all-gather context parallelism, alone and inside Ulysses): P CPU
processes joined by gloo compute what one plain-sdpa process computes, on packed FLAN-like rows.

Two launches, 2 processes (gather 2) and 4 (Ulysses 2 x gather 2), check many cases each, on both kernels (plain and
fused): fp64 logits, loss and every parameter gradient within 1e-10 relative error of one process for llama (MHA),
qwen2 (GQA), mistral (GQA + sliding window), one unpacked long document and a row shorter than the processes; fp32
per-step AdamW losses within 1e-6 relative; the elements every process sends into the all-gathers, the reduce-scatters
and the Ulysses all-to-alls, counted at the dispatcher, equal `gather_elements` (their bytes `gather_bytes`). Two
broken variants must fail the same proof: a shard whose global indices are one token off the tokens it holds, and a
reduce-scatter that keeps each process's own share of its block's gradients without adding the others'. Without
processes: other families fit the seam or are refused by name, and the fused kernel's CUDA path (CUDA's varlen kernels
emulated, as in tests/test_ring.py) equals its CPU path on every block of a row.
"""
import sys

import pytest
import torch
import torch.distributed as dist

import workbench.sp.gather as gather_module
import workbench.sp.shard as shard_module
from workbench.tiny_models import tiny_model
from workbench.launch import launch
from workbench.sp.balance import plan_row, plan_window, ring_batch, zigzag_plan
from workbench.sp.gather import (attend_row, attend_row_backward, gather_bytes, gather_elements, gather_forward,
                                 register_gather)
from workbench.sp.grid import ParallelGrid
from workbench.sp.loss import global_loss, sync_gradients
from workbench.sp_proofs import Case, CountComm, _grad_error, _rel, case_model, case_rows, one_process, ring_losses
from workbench.sp.ring import documents, ring_plans, varlen_plans
from workbench.sp.shard import contiguous_plan, ring_shard

F64 = [Case("llama", "sdpa", dtype="float64"),                  # MHA, 203 FLAN-like tokens (not a multiple of P)
       Case("qwen2", "sdpa", dtype="float64"),                  # GQA, 2 kv heads
       Case("mistral", "sdpa", dtype="float64"),                # GQA + sliding window 16
       Case("qwen2", "sdpa", packed=False, dtype="float64"),    # one document spanning every shard
       Case("llama", "sdpa", packed=False, dtype="float64", tokens=3)]  # fewer tokens than processes
TOL = 1e-10       # fp64 logits, loss and gradients, relative to one process
LOSS_RTOL = 1e-6  # fp32 per-step training losses (about 9 here): a few fp32 ulps, as tests/test_ring.py's
BROKEN = 1e-3     # a broken variant's error is far above TOL (measured: the report prints them)


def check_gather(cases: list, layout: tuple, references: list, kernel: str = "plain", strategy: str = "balanced"):
    """On this process, per case: relative errors of logits, loss and every gradient against one process, and the
    elements (bytes) sent into the collectives, counted and by formula."""
    u, g = layout
    grid = ParallelGrid.build(u, g)
    results = []
    for case, ref in zip(cases, references):
        model = case_model(case, register_gather())
        cfg, layers = model.config, model.config.num_hidden_layers
        row = ref["rows"][0]
        batch, plan = plan_row(row, grid.sp_size, strategy, window=plan_window(cfg))  # as training cuts it
        shard = ring_shard(batch, plan, grid.sp_rank, u)
        with CountComm() as fwd: logits, loss = gather_forward(model, shard, grid, kernel)
        with CountComm() as bwd: loss.backward()
        sync_gradients(model, grid)
        idx = shard["token_index"]
        real = idx < row["input_ids"].shape[1]  # the padding's logits have no reference
        n = batch["input_ids"].shape[1]
        elements = gather_elements(cfg, n, u, g)
        itemsize = getattr(torch, case.dtype).itemsize
        results.append(dict(
            case=case, layout=layout, kernel=kernel, rank=dist.get_rank(),
            logits=_rel(logits[0, real].detach(), ref["logits"][0][0, idx[real]]) if real.any() else 0.0,
            loss=abs(global_loss(loss, grid) - ref["loss"]) / abs(ref["loss"]),
            grads=_grad_error(model, ref["grads"]), n_params=sum(p.grad is not None for p in model.parameters()),
            sent=(fwd.gathered, bwd.scattered), sent_formula=tuple(layers * x for x in elements["gather"]),
            a2a=(fwd.a2a, bwd.a2a), a2a_formula=tuple(layers * x for x in elements["all_to_all"]),
            sent_bytes=fwd.gathered_bytes + bwd.scattered_bytes,
            bytes_formula=gather_bytes(cfg, n, u, g, dtype_bytes=itemsize)["gather"]))
    return results


def gather_losses(make_model, rows: list, layout: tuple, kernel: str = "plain", lr: float = 1e-2) -> list:
    "The global loss of every step of AdamW training on `rows` under the gather (`ring_losses`' loop, one row a step)."
    grid = ParallelGrid.build(*layout)
    model = make_model(register_gather()).train()
    opt, losses = torch.optim.AdamW(model.parameters(), lr=lr), []
    for row in rows:
        shard = ring_batch(row, grid, "balanced", window=plan_window(model.config))
        _, loss = gather_forward(model, shard, grid, kernel)
        loss.backward()
        sync_gradients(model, grid)
        opt.step(); opt.zero_grad()
        losses.append(global_loss(loss, grid))
    return losses


def _one_token_off(batch, plan, sp_rank, ulysses=1):
    "Broken: a shard whose global indices are one token off the tokens it holds (every block boundary moved by one)."
    shard = shard_module.ring_shard(batch, plan, sp_rank, ulysses)
    return {**shard, "ring_index": shard["ring_index"].roll(1)}


def _own_share_only(dkv, group):
    "Broken: a reduce-scatter that never adds: each process keeps its own share of its own block's gradients."
    return dkv.unflatten(3, (dist.get_world_size(group), -1))[:, :, :, dist.get_rank(group)]


def _broken(target, name: str, replacement, fn, *args):
    "fn(*args) on this process with `target.name` replaced by a broken variant."
    with pytest.MonkeyPatch.context() as m:
        m.setattr(target, name, replacement)
        return fn(*args)


def _jobs(jobs: list) -> list:
    "Every rank: run each (function, args) job in turn (one launch checks many things)."
    torch.set_num_threads(1)
    return [fn(*args) for fn, args in jobs]


def _one_thread(fn, *args):
    "The reference as the launched ranks compute it: one thread, so the same summation order."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try: return fn(*args)
    finally: torch.set_num_threads(threads)


def qwen2_fp32(attn: str):
    return tiny_model("qwen2", attn_implementation=attn, dtype=torch.float32)


def worst(results: list, key: str) -> float:
    return max(r[key] for r in results)


def assert_exact(results: list, n_expected: int):
    assert len(results) == n_expected
    for r in results:
        where = f"{r['case']} at Ulysses x gather {r['layout']}, {r['kernel']} kernel, rank {r['rank']}"
        assert r["n_params"] >= 21, f"{where}: only {r['n_params']} parameters got gradients"
        assert max(r["logits"], r["loss"], r["grads"]) <= TOL, (
            f"{where}: relative error logits {r['logits']:.2e}, loss "
            f"{r['loss']:.2e}, gradients {r['grads']:.2e} > {TOL}")
        assert r["sent"] == r["sent_formula"], f"{where}: gathered, scattered {r['sent']}, formula {r['sent_formula']}"
        assert r["a2a"] == r["a2a_formula"], f"{where}: all-to-all {r['a2a']}, formula {r['a2a_formula']}"
        assert r["sent_bytes"] == r["bytes_formula"], f"{where}: {r['sent_bytes']} bytes, formula {r['bytes_formula']}"


def close_losses(got: list, want: list) -> bool:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= LOSS_RTOL


# ---------------------------------------------------------------- equivalence: 2 and 4 processes, one launch each

def test_gather_of_two_equals_one_process_and_broken_variants_fail():
    """Gather 2, both kernels, every case; fp32 training; a shard
    one token off and a reduce-scatter that never adds fail."""
    refs = [one_process(case) for case in F64]
    rows3 = case_rows(Case("qwen2", tokens=203), 3)
    qwen = F64[1]
    jobs = [(check_gather, (F64, (1, 2), refs, "plain")),
            (check_gather, (F64, (1, 2), refs, "fused")),
            (check_gather, (F64[:3], (1, 2), refs[:3], "plain", "zigzag")),
            (gather_losses, (qwen2_fp32, rows3, (1, 2), "plain")),
            (gather_losses, (qwen2_fp32, rows3, (1, 2), "fused")),
            (_broken, (sys.modules[__name__], "ring_shard", _one_token_off, check_gather, [qwen], (1, 2), refs[1:2])),
            (_broken, (gather_module, "scatter_gradients", _own_share_only, check_gather, [qwen], (1, 2), refs[1:2]))]
    per_rank = launch(_jobs, jobs, num_processes=2, cpu=True, quiet=True, timeout_s=120, deadline_s=240)
    plain, fused, zigzag, train_plain, train_fused, off, own = zip(*per_rank)
    for results, cases in ((plain, F64), (fused, F64), (zigzag, F64[:3])):
        assert_exact([r for rank in results for r in rank], 2 * len(cases))
    ref_losses = _one_thread(ring_losses, qwen2_fp32, rows3)["losses"]
    for losses in (*train_plain, *train_fused):
        assert len(losses) == 3 and close_losses(losses, ref_losses), (losses, ref_losses)
    good = [r for rank in plain for r in rank if r["case"] == qwen]
    off, own = [r for rank in off for r in rank], [r for rank in own for r in rank]
    print(f"\nqwen2 fp64, gather 2, plain: worst relative error (logits, loss, gradients) "
          f"correct {tuple(f'{worst(good, k):.1e}' for k in ('logits', 'loss', 'grads'))}, "
          f"one token off {tuple(f'{worst(off, k):.1e}' for k in ('logits', 'loss', 'grads'))}, "
          f"own share only {tuple(f'{worst(own, k):.1e}' for k in ('logits', 'loss', 'grads'))}")
    # the mask follows the indices, not the tokens
    assert worst(off, "logits") > BROKEN and worst(off, "grads") > BROKEN
    assert worst(off, "loss") > 1e4 * TOL  # a random model's loss moves little (about ln(vocab) either way)
    assert worst(own, "logits") <= TOL and worst(own, "loss") <= TOL    # the forward is untouched ...
    assert worst(own, "grads") > BROKEN                                 # ... but the key/value gradients miss shares
    for broken in (off, own):
        with pytest.raises(AssertionError, match="relative error"): assert_exact(broken, 2)  # the proof reports it


def test_ulysses_2_x_gather_2_equals_one_process():
    "Four processes: the all-to-all to head shards, the gather over the context group, the all-to-all back; gather 4."
    refs = [one_process(case) for case in F64]
    rows3 = case_rows(Case("qwen2", tokens=203), 3)
    jobs = [(check_gather, (F64, (2, 2), refs, "plain")),
            (check_gather, (F64, (2, 2), refs, "fused")),
            (check_gather, (F64, (1, 4), refs, "plain")),
            (gather_losses, (qwen2_fp32, rows3, (2, 2), "fused"))]
    per_rank = launch(_jobs, jobs, num_processes=4, cpu=True, quiet=True, timeout_s=120, deadline_s=300)
    plain, fused, four, train = zip(*per_rank)
    assert_exact([r for rank in four for r in rank], 4 * len(F64))
    for results in (plain, fused):
        checks = [r for rank in results for r in rank]
        assert_exact(checks, 4 * len(F64))
        assert all(r["a2a"][0] > 0 for r in checks)  # Ulysses really exchanged
    ref_losses = _one_thread(ring_losses, qwen2_fp32, rows3)["losses"]
    for losses in train:
        assert len(losses) == 3 and close_losses(losses, ref_losses), (losses, ref_losses)


# ---------------------------------------------------------------- no processes

def test_one_process_equals_sdpa_across_families_or_refuses_by_name():
    "One process holds the whole row: other families' attention modules fit the seam, or are refused by name."
    row = case_rows(Case(tokens=203))[0]
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    shard = ring_shard(row, contiguous_plan(203, 1), 0)
    for family in ("gemma3", "phi3"):
        ref = tiny_model(family, attn_implementation="sdpa", dtype=torch.float64)(**{k: row[k] for k in keys},
                                                                                use_cache=False).logits
        model = tiny_model(family, attn_implementation=register_gather(), dtype=torch.float64)
        logits, _ = gather_forward(model, shard, ParallelGrid(), "fused")
        assert _rel(logits, ref) <= TOL, family
    for family, words in (("gemma2", "gather attention does not implement softcap"),
                          ("stablelm", "does not pass forward keywords")):
        model = tiny_model(family, attn_implementation=register_gather())
        with pytest.raises(ValueError, match=words): gather_forward(model, shard, ParallelGrid())
    model = tiny_model("qwen2", attn_implementation=register_gather())
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at 204 but the ring blocks hold 203"):
        gather_forward(model, {**shard, "cu_seq_lens_q": torch.tensor([0, 102, 204], dtype=torch.int32)},
                       ParallelGrid())
    with pytest.raises(ValueError, match="ulysses=3 does not suit"):
        gather_forward(model, shard, ParallelGrid(ulysses=3))  # refused before any exchange


def test_the_fused_cuda_path_equals_its_cpu_path_on_every_block(monkeypatch):
    """The fused kernel's CUDA path (varlen calls planned once, tokens-major rows, gradients added by rows) against the
    whole gathered row equals its CPU path for every process of a zigzag plan of 3 over 3 documents, with grouped
    heads, in fp64, CUDA's varlen flash kernel emulated in plain products (tests/test_ring.py's emulation)."""
    from test_ring import _flash_varlen_backward_emulated, _flash_varlen_emulated, _on_fake_cuda
    torch.manual_seed(0)
    doc, plan = documents(torch.tensor([0, 5, 14, 24])), zigzag_plan(24, 3)
    q, dout = (torch.randn(1, 4, 8, 8, dtype=torch.float64) for _ in range(2))  # one process's 8 queries, 4 heads
    kv = torch.randn(2, 1, 2, 24, 8, dtype=torch.float64)  # the gathered row: 2 kv heads
    results = {}
    for path in ("cpu", "cuda"):
        if path == "cuda": _on_fake_cuda(monkeypatch, _flash_varlen_emulated, _flash_varlen_backward_emulated)
        for r in range(3):
            plans = ring_plans(plan, doc, r)
            # as gather_plans makes them on CUDA, here on the host
            if path == "cuda": plans = varlen_plans(plans, "cpu")
            out, lse = attend_row(q, kv, plan, doc, r, 8 ** -0.5, plans=plans)
            dq, dkv = attend_row_backward(q, kv, dout, out, lse, plan, doc, r, 8 ** -0.5, plans=plans)
            results[path, r] = [out.contiguous(), lse, dq, dkv]
    monkeypatch.undo()
    for r in range(3):
        for name, a, b in zip(("out", "lse", "dq", "dkv"), results["cpu", r], results["cuda", r]):
            assert (a - b).abs().max() < 1e-12, (r, name)


# ---------------------------------------------------------------- the training loop, evaluation and resume

def test_gather_trains_resumes_and_evaluates_through_the_loop(tmp_path, capsys):
    """`--gather 2` through the training loop (forked ranks, the layout from the config: nothing in the loop names it)
    equals one process step by step (fp32, 1e-6 relative); a run saved under Ulysses 2 resumes under gather 2 with the
    uninterrupted losses; evaluation under gather 2 equals each example alone; the flag and its refusals."""
    from dataclasses import replace
    import json
    import numpy as np
    from workbench.config import TrainConfig, _config, _parser
    from workbench.samples import load_tokenizer
    from workbench.data import load_features
    from workbench.evaluate import each_alone, evaluate
    from workbench.train import run
    common = dict(model="qwen2", data="orca_like", steps=3, max_tokens=512)
    one = run(TrainConfig(**common, out=str(tmp_path / "one")))
    gathered = run(TrainConfig(**common, gather=2, out=str(tmp_path / "gather")))
    assert len(one) == len(gathered) == 3 and close_losses(gathered, one), (gathered, one)
    saved = json.loads((tmp_path / "gather" / "config.json").read_text())
    assert saved["gather"] == 2 and saved["ring"] == 1 and saved["predicted"]["step_s"] > 0
    first = run(TrainConfig(**{**common, "steps": 2}, ulysses=2, save_every=2, out=str(tmp_path / "switch")))
    rest = run(TrainConfig(**common, gather=2, resume=True, out=str(tmp_path / "switch")))
    assert len(rest) == 1 and close_losses(first + rest, one), (first, rest, one)
    features = load_features("orca_like", load_tokenizer())[-6:]
    base = TrainConfig(model="qwen2", max_tokens=512)
    reference, got = each_alone(base, features), evaluate(replace(base, gather=2), features)
    assert np.max(np.abs(got.loss - reference.loss) / reference.loss) <= LOSS_RTOL, (got, reference)
    assert np.array_equal(got.tokens, reference.tokens) and np.array_equal(got.accuracy, reference.accuracy)
    p = _parser()
    assert _config(p, p.parse_args(["--gather", "2", "--nproc", "4"]), 1).dp == 2
    with pytest.raises(ValueError, match="each split the row's context"): TrainConfig(ring=2, gather=2)
    with pytest.raises(ValueError, match=r"gather \(--gather\) > 1 computes attention"):
        TrainConfig(gather=2, loss_chunk=64)
