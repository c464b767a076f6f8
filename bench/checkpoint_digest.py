"""What a checkpoint's digests cost: a 1 GiB `state.pt` written as `commit_checkpoint` writes it (torch.save, flushed),
then its CRC-32 read back in 1 MiB blocks (`workbench.checkpoint.file_digest`), as a save records it and a resume
checks it. The file is read right after it was written, so from the page cache, as at a save; a resume in a fresh
process after the cache was dropped also pays the disk read, which its own torch.load of the same file pays anyway.

  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/checkpoint_digest.py [--gib 1] [--rounds 3]
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from workbench.checkpoint import file_digest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0, help="size of the state written")
    p.add_argument("--rounds", type=int, default=3, help="digests timed (the fastest is reported)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.pt"
        state = {"model": {"w": torch.ones(int(a.gib * 2**30) // 4)}}  # fp32: 4 bytes each
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f); f.flush(); os.fsync(f.fileno())
        save_s = time.perf_counter() - t
        times = []
        for _ in range(a.rounds):
            t = time.perf_counter(); file_digest(path); times.append(time.perf_counter() - t)
        size = path.stat().st_size
        print(f"state.pt {size / 2**30:.2f} GiB: torch.save + fsync {save_s:.2f} s; "
              f"CRC-32 in 1 MiB blocks {min(times):.2f} s "
              f"(fastest of {a.rounds}; {size / 2**30 / min(times):.1f} GiB/s), {min(times) / save_s:.0%} of the save")


if __name__ == "__main__":
    main()
