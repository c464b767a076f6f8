"""The collator before and after a change, and transformers' beside both, interleaved in one process (issue 31).

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/collation_before_after.py [--rev main] [--rounds 11]
The "before" collator is `workbench/packing.py` as git holds it at `--rev`, loaded as its own module; the "after" one
is this checkout's. Every round times transformers', the old and the new collator in turn on the same FLAN-like
batches (`workbench.bench.flan_batches`, about 2 M tokens per batch size, fresh Python lists each call, as a
`datasets.Dataset` hands them over); the best round of each is kept, so other jobs on a shared machine slow a round,
not a ratio. Outputs are checked identical (old, new and transformers') before timing.
"""
import argparse, importlib.util, subprocess, sys, tempfile
from pathlib import Path

import torch
from transformers import DataCollatorWithFlattening

from workbench.bench import _features, best_times, flan_batches, print_table, time_collator
from workbench.packing import FlatteningCollator


def masked_features(batch):
    "A batch as fresh lists with `labels` and a `completion_mask` whose first quarter is 0 (the prompt)."
    feats = []
    for x in batch:
        ids = x.tolist()
        prompt = len(ids) // 4
        feats.append({"input_ids": ids, "labels": list(ids),
                      "completion_mask": [0] * prompt + [1] * (len(ids) - prompt)})
    return feats


def old_collator(rev: str):
    "`FlatteningCollator` from `workbench/packing.py` at git revision `rev`, imported inside the `workbench` package."
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:workbench/packing.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "packing_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("workbench.packing_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.FlatteningCollator


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="main", help="git revision of the 'before' collator")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds (best kept)")
    p.add_argument("--tokens", type=int, default=2_000_000, help="tokens per batch size")
    p.add_argument("--mask", action="store_true", help="labels and a completion_mask on "
                                                       "every example (old vs new only)")
    a = p.parse_args()
    if a.mask: return main_masked(a)
    old = old_collator(a.rev)(train_all_tokens=True)
    new = FlatteningCollator(train_all_tokens=True)
    ref = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rows = []
    for bs in (8, 32, 128):
        batches = flan_batches(bs, max(1, a.tokens // (bs * 196)))
        tokens = sum(len(x) for b in batches for x in b)
        for b in batches[:3]:
            r, o, n = ref(_features(b)), old(_features(b)), new(_features(b))
            assert all(torch.equal(torch.as_tensor(n[k]), torch.as_tensor(r[k])) for k in r), (
                "new differs from transformers")
            assert n.keys() == o.keys() and all(torch.equal(torch.as_tensor(n[k]), torch.as_tensor(o[k])) for k in o), (
                "new differs from old")
        fns = [lambda: time_collator(ref, batches), lambda: time_collator(old, batches),
               lambda: time_collator(new, batches)]
        t_ref, t_old, t_new = best_times(fns, a.rounds)
        rows.append({"batch": bs, "tokens": tokens, "transformers M tok/s": tokens / t_ref / 1e6,
                     "before M tok/s": tokens / t_old / 1e6, "after M tok/s": tokens / t_new / 1e6,
                     "before ×": t_ref / t_old, "after ×": t_ref / t_new, "after/before speed": t_old / t_new})
    print_table(rows, f"Collation: transformers, {a.rev} and this checkout, best of {a.rounds} interleaved rounds")


def main_masked(a):
    old, new = old_collator(a.rev)(), FlatteningCollator()
    rows = []
    for bs in (8, 32, 128):
        batches = flan_batches(bs, max(1, a.tokens // (bs * 196)))
        tokens = sum(len(x) for b in batches for x in b)
        for b in batches[:3]:
            o, n = old(masked_features(b)), new(masked_features(b))
            assert n.keys() == o.keys() and all(torch.equal(torch.as_tensor(n[k]), torch.as_tensor(o[k])) for k in o), (
                "new differs from old")
        t_old, t_new = best_times([lambda: time_collator(old, batches, masked_features),
                                   lambda: time_collator(new, batches, masked_features)], a.rounds)
        rows.append({"batch": bs, "tokens": tokens, "before M tok/s": tokens / t_old / 1e6,
                     "after M tok/s": tokens / t_new / 1e6, "after/before speed": t_old / t_new})
    print_table(rows, f"Collation with labels and completion_mask: {a.rev} and "
                      f"this checkout, best of {a.rounds} interleaved rounds")


if __name__ == "__main__": main()
