"""The per-step losses of nine training runs as exact floats (`float.hex`): run it before and after a change to the
training code and compare the two files; a refactor that changes nothing leaves them equal to the last bit.

Run: HF_HUB_OFFLINE=1 PYTHONPATH=$PWD .venv/bin/python bench/loss_fingerprint.py OUT.json   (about 30-45 s on 2 cores)
Runs: one process plain, grad-accum 2, LoRA, every long-context lever, a run resumed after 2 of 4 steps; forked:
SP 2, DP 2 x accum 2 with --balance cost and workbench_varlen, ring 2, SP 2 sharded (FSDP2).
"""
import json, sys, tempfile

from workbench.config import TrainConfig
from workbench.train import run, train_rank


def fresh(**fields) -> TrainConfig:
    return TrainConfig(out=tempfile.mkdtemp(), **fields)


def fingerprint() -> dict:
    losses = {}
    losses["one"] = train_rank(fresh(steps=3, max_tokens=512))
    losses["accum"] = train_rank(fresh(steps=2, max_tokens=512, grad_accum=2))
    losses["lora"] = train_rank(fresh(steps=2, max_tokens=512, lora_r=4))
    losses["levers"] = train_rank(fresh(steps=2, max_tokens=512, checkpointing=True, loss_chunk=64, lean_kernels=True,
                                        mlp_chunk=64))
    resumed = tempfile.mkdtemp()
    first = train_rank(TrainConfig(steps=2, max_tokens=512, save_every=1, out=resumed))
    losses["resume"] = first + train_rank(TrainConfig(steps=4, max_tokens=512, save_every=1, out=resumed, resume=True))
    losses["sp2"] = run(fresh(ulysses=2, steps=2, max_tokens=512))
    losses["dp2cost"] = run(fresh(dp=2, grad_accum=2, steps=2, max_tokens=1024, balance="cost",
                                  attn="workbench_varlen"))
    # named: the default kernel depends on the device
    losses["ring2"] = run(fresh(ring=2, ring_kernel="plain", steps=2, max_tokens=512))
    losses["shard"] = run(fresh(ulysses=2, steps=2, max_tokens=512, shard=True))
    return {name: [float(x).hex() for x in values] for name, values in losses.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2: raise SystemExit(__doc__)
    with open(sys.argv[1], "w") as f: json.dump(fingerprint(), f, indent=1)
