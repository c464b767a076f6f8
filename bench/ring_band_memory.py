"""Peak live bytes of one fused ring call under a sliding window, every rank of ring 2 (bf16, MHA 4 x 16, zigzag, one
document), counted by `workbench.memory.LiveBytes` as the memory planner's measurements are. Run it in two trees to
compare kernels (tests/README.md, thirteenth round):

  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/ring_band_memory.py
"""
import torch
import torch.distributed as dist
from workbench.launch import launch
from workbench.memory import LiveBytes
from workbench.sp.grid import ParallelGrid
from workbench.sp.balance import zigzag_plan
from workbench.sp.ring import ring_attend, documents

def one(n_tokens, window, heads=4, D=16):
    torch.set_num_threads(1)
    grid = ParallelGrid.build(1, 2)
    g = torch.Generator().manual_seed(dist.get_rank())
    m = n_tokens // 2
    q = torch.randn(1, heads, m, D, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, heads, m, D, generator=g).bfloat16().requires_grad_() for _ in "kv")
    w = torch.randn(q.shape, generator=g).bfloat16()
    index, doc = zigzag_plan(n_tokens, 2).reshape(2, -1), documents(torch.tensor([0, n_tokens]))
    with LiveBytes() as lb:
        (ring_attend(q, k, v, index, doc, grid.group("ring"), window=window, kernel="fused") * w).sum().backward()
    return lb.peak - 4

if __name__ == "__main__":
    print("| tokens | window | rank 0 MB | rank 1 MB |\n|---:|---:|---:|---:|")
    for n, w in ((4096, 256), (4096, 1024), (8192, 2048)):
        peaks = launch(one, n, w, num_processes=2, cpu=True, quiet=True, timeout_s=120)
        print(f"| {n} | {w} | {peaks[0] / 1e6:.1f} | {peaks[1] / 1e6:.1f} |")
