"""The ring's block-pair kernels side by side (issue 31): plain (masked products in query tiles) against fused
(PyTorch's CPU flash attention per document stretch), then one training step of ring 2 (each kernel) against Ulysses 2
and one process on the same packed long-document rows.

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/ring_kernel.py [--rounds 3] [--lengths 2048,8192,32768]
Part 1 runs in this process (one thread): one block pair of a whole row (the diagonal pair, every document causal),
forward and backward, FLAN-like rows (many short documents) and long-document rows. Outputs and gradients of both
kernels are compared before timing. Part 2 launches 2 CPU processes (one thread each) and times optimizer steps of a
tiny Llama on the same rows under each layout; the first step is a warm-up, the median of the rest is kept.
"""
import argparse, statistics, time

import numpy as np
import torch

from workbench.bench import best_times, print_table
from workbench.packing import synthetic_lengths


def row_boundaries(kind: str, n_tokens: int, seed: int = 0) -> torch.Tensor:
    "`cu_seq_lens` of one packed row of `n_tokens`: FLAN-like documents, or long ones (lognormal, median 4,096)."
    rng = np.random.default_rng(seed)
    if kind == "flan": lengths = synthetic_lengths("flan", n_tokens // 8 + 8, seed=seed)
    else: lengths = np.clip(rng.lognormal(np.log(4096), 0.5, n_tokens // 512 + 8), 1024, 16384).astype(np.int64)
    cu = np.minimum(np.r_[0, np.cumsum(lengths)], n_tokens)
    cu = cu[: int(np.searchsorted(cu, n_tokens)) + 1]
    return torch.tensor(cu, dtype=torch.int64)


def time_pair(kernel: str, q, k, v, doc, window=None) -> float:
    "Seconds of one forward and backward of the whole row as one block pair."
    from workbench.sp.ring import ring_attend
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    t = time.perf_counter()
    ring_attend(qq, kk, vv, torch.arange(q.shape[2])[None], doc, window=window, kernel=kernel).sum().backward()
    return time.perf_counter() - t


def block_pairs_table(lengths, rounds: int, heads: int = 4, head_dim: int = 64, window=None) -> list:
    from workbench.sp.ring import documents, ring_attend
    rows = []
    for kind in ("flan", "long"):
        for n in lengths:
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, heads, n, head_dim) for _ in range(3))
            cu = row_boundaries(kind, n)
            doc = documents(cu)
            outs = {}
            for kernel in ("plain", "fused"):
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                out = ring_attend(qq, kk, vv, torch.arange(n)[None], doc, window=window, kernel=kernel)
                out.square().sum().backward()
                outs[kernel] = (out.detach(), qq.grad, kk.grad, vv.grad)
            gap = max((a - b).abs().max().item() for a, b in zip(outs["plain"], outs["fused"]))
            t_plain, t_fused = best_times([lambda: time_pair("plain", q, k, v, doc, window),
                                           lambda: time_pair("fused", q, k, v, doc, window)],
                                          rounds if n <= 8192 else 1)
            rows.append({"row": kind, "tokens": n, "window": window or "none", "documents": len(cu) - 1,
                         "plain s": t_plain, "fused s": t_fused, "fused speedup": t_plain / t_fused, "max |diff|": gap})
            print(rows[-1], flush=True)  # each row as it is measured: a 32K plain pair takes minutes
    return rows


def step_times(layout, kernel: str, rows: list, lr: float = 1e-3) -> list:
    "Seconds of each optimizer step on this process (launched): None = one process; (u, r) = Ulysses u x ring r."
    import torch.nn.functional as F
    from workbench.core import IGNORE_INDEX
    from workbench.tiny_models import tiny_model
    from workbench.sp.balance import ring_batch
    from workbench.sp.grid import ParallelGrid
    from workbench.sp.ring import register_ring, ring_forward
    from workbench.sp.shard import SHARD_KEYS, shard_batch
    from workbench.sp.ulysses import register_ulysses, sp_forward
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if layout is None: attn, grid = "sdpa", None
    elif layout[1] == 1: attn, grid = register_ulysses("sdpa"), ParallelGrid.build(layout[0])
    else: attn, grid = register_ring(), ParallelGrid.build(*layout)
    model = tiny_model("llama", attn_implementation=attn).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    seconds = []
    for row in rows:
        t = time.perf_counter()
        if grid is None:
            logits = model(**{k: row[k] for k in SHARD_KEYS}, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1], row["labels"][0, 1:], ignore_index=IGNORE_INDEX)
        elif layout[1] == 1: _, loss = sp_forward(model, shard_batch(row, grid.sp_rank, grid.sp_size), grid)
        else: _, loss = ring_forward(model, ring_batch(row, grid, "balanced"), grid, kernel)
        loss.backward()
        opt.step(); opt.zero_grad()
        seconds.append(time.perf_counter() - t)
    return seconds


def packed_rows(kind: str, n_tokens: int, count: int) -> list:
    "`count` packed rows (the contract) of `n_tokens` random token ids, cut into documents by `row_boundaries`."
    from workbench.packing import FlatteningCollator
    rng = np.random.default_rng(0)
    rows = []
    for s in range(count):
        cu = row_boundaries(kind, n_tokens, seed=s).tolist()
        feats = [{"input_ids": rng.integers(3, 8000, b - a).tolist()} for a, b in zip(cu[:-1], cu[1:])]
        rows.append(FlatteningCollator(train_all_tokens=True, pad_to_multiple_of=4)(feats))
    return rows


def training_table(n_tokens: int, steps: int) -> list:
    from workbench.launch import launch
    rows = packed_rows("long", n_tokens, steps)
    table = []
    runs = [("one process", None, "plain"), ("Ulysses 2", (2, 1), "plain"), ("ring 2, plain", (1, 2), "plain"),
            ("ring 2, fused", (1, 2), "fused")]
    for name, layout, kernel in runs:
        if layout is None: per_rank = [step_times(None, kernel, rows)]
        else: per_rank = launch(step_times, layout, kernel, rows, num_processes=2, cpu=True, quiet=True, timeout_s=600)
        slowest = [max(r[i] for r in per_rank) for i in range(steps)]
        table.append({"layout": name, "median s/step (past step 0)": statistics.median(slowest[1:])})
        print(table[-1], flush=True)
    ulysses = table[1]["median s/step (past step 0)"]
    for r in table: r["× Ulysses 2"] = r["median s/step (past step 0)"] / ulysses
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the block-pair timing (best kept)")
    p.add_argument("--lengths", default="2048,8192,32768", help="row lengths of the block-pair timing")
    p.add_argument("--train-tokens", type=int, default=8192, help="row length of the training steps")
    p.add_argument("--steps", type=int, default=4, help="training steps per layout (the first is a warm-up)")
    p.add_argument("--window", type=int, help="a sliding window for the block-pair timing (Mistral: 4096)")
    p.add_argument("--no-training", action="store_true", help="the block-pair timing only")
    a = p.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in a.lengths.split(",")]
    print_table(block_pairs_table(lengths, a.rounds, window=a.window),
                "One block pair (a whole row), forward + backward, fp32, 4 heads x 64, one thread")
    if not a.no_training: print_table(training_table(a.train_tokens, a.steps),
                                      f"Training steps on {a.train_tokens}-token "
                                      "long-document rows, 2 CPU processes, one thread each")


if __name__ == "__main__": main()
