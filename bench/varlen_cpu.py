"""The varlen attention's CPU path (`workbench.attention.reference_varlen`, what `workbench_varlen` and every Ulysses
rank run on CPU) side by side with the same per-document calls made without a batch axis, which PyTorch's CPU dispatcher
sends to the math kernel (batched products, every score formed). Forward and backward of one packed row, one thread.

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/varlen_cpu.py [--rounds 3] [--lengths 2048,8192]
"""
import argparse
import time

import torch
import torch.nn.functional as F

from workbench.attention import reference_varlen
from workbench.bench import best_times, print_table
from ring_kernel import row_boundaries  # the FLAN-like and long-document rows of the ring kernel benchmark


def math_varlen(q, k, v, cu):
    "The same per-document calls with 3-D inputs `[H, l, D]`: the math kernel (what `reference_varlen` ran before)."
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


def seconds(fn, q, k, v, cu) -> float:
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    t = time.perf_counter()
    fn(qq, kk, vv, cu).square().sum().backward()
    return time.perf_counter() - t


def main(rounds: int, lengths: list[int], heads: int = 8, kv_heads: int = 2, head_dim: int = 64):
    torch.set_num_threads(1)
    rows = []
    for kind in ("flan", "long"):
        for n in lengths:
            torch.manual_seed(0)
            q = torch.randn(n, heads, head_dim)
            k, v = (torch.randn(n, kv_heads, head_dim) for _ in range(2))
            cu = row_boundaries(kind, n)
            gap = (reference_varlen(q, k, v, cu) - math_varlen(q, k, v, cu)).abs().max().item()
            t_math, t_flash = best_times([lambda: seconds(math_varlen, q, k, v, cu),
                                          lambda: seconds(reference_varlen, q, k, v, cu)], rounds)
            rows.append({"row": kind, "tokens": n, "documents": len(cu) - 1, "math kernel s": t_math,
                         "flash kernel s": t_flash, "speedup": t_math / t_flash, "max |diff| out": gap})
            print(rows[-1], flush=True)
    print_table(rows, f"varlen attention on CPU, fwd + bwd, {heads} query heads over {kv_heads} kv heads x {head_dim}, "
                      "1 thread: math kernel (3-D calls) against the fused flash kernel (reference_varlen)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", default="2048,8192")
    a = p.parse_args()
    main(a.rounds, [int(x) for x in a.lengths.split(",")])
