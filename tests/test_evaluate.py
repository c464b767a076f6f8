"""workbench.evaluate: per-example loss and token accuracy under Ulysses 2, ring 2 and DP 2 (fp32, within 1e-6 relative)
and Ulysses 2 x ring 2 (fp64, within 1e-12) equal one process evaluating each example alone, unpacked (the fp32 2 x 2 is
in nbs/03_runtime/09_evaluate.ipynb); bad input is refused before any process starts; the command line writes
eval.jsonl."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from workbench.config import TrainConfig
from workbench.evaluate import each_alone, evaluate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def held_out():
    "Ten OrcaMath-like examples in rows of 512 tokens: an odd number of bins, so DP 2 repeats one (and must not count it twice)."
    from workbench.core import load_tokenizer
    from workbench.data import load_features
    from workbench.packing import plan_bins
    features = load_features("orca_like", load_tokenizer())[-10:]
    assert len(plan_bins(features, 512, overlong="error", untrained="keep").bins) % 2 == 1
    return features


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    "A run's checkpoint model after 12 steps: a random model's argmax is never the label, so its accuracy proves nothing."
    from workbench.checkpoint import latest_checkpoint
    from workbench.train import run
    out = tmp_path_factory.mktemp("trained")
    run(TrainConfig(model="qwen2", data="orca_like", steps=12, lr=1e-2, max_tokens=512, out=str(out)))
    return str(latest_checkpoint(out, say=lambda _: None)[0] / "model")


def close(got, want, rtol: float) -> bool:
    return bool(np.max(np.abs(got.loss - want.loss) / want.loss) <= rtol and np.array_equal(got.tokens, want.tokens)
                and np.array_equal(got.accuracy, want.accuracy))


def test_every_layout_equals_each_example_alone(held_out, trained):
    base = TrainConfig(model=trained, max_tokens=512)
    reference = each_alone(base, held_out)
    assert reference.tokens.min() > 0 and 0 < reference.mean_accuracy() < 1
    for layout in (dict(sp=2), dict(ring=2), dict(dp=2)):
        got = evaluate(replace(base, **layout), held_out)
        assert close(got, reference, 1e-6), (layout, got, reference)
    f64 = replace(base, dtype="float64")
    assert close(evaluate(replace(f64, sp=2, ring=2), held_out), each_alone(f64, held_out), 1e-12)


def test_bad_input_is_refused_before_any_process_starts(held_out, tmp_path):
    with pytest.raises(ValueError, match=r"max_tokens \(--max-tokens\) 64: .*Evaluation keeps every example whole: raise --max-tokens"):
        evaluate(TrainConfig(model="qwen2", max_tokens=64), held_out)
    with pytest.raises(ValueError, match="sp_size=8 is more than the 4 attention heads"):
        evaluate(TrainConfig(model="qwen2", sp=8), held_out)
    prompts_only = [{"input_ids": f["input_ids"], "labels": [-100] * len(f["input_ids"])} for f in held_out[:2]]
    with pytest.raises(ValueError, match="none of the 2 examples has a trained target"):
        evaluate(TrainConfig(model="qwen2", max_tokens=512), prompts_only)
    cli = subprocess.run([sys.executable, "-m", "workbench.evaluate", "--lr", "0.1", "--steps", "3"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 2 and "--steps, --lr do not apply to evaluation" in cli.stderr, cli.stderr


def test_the_command_line_writes_one_row_per_example(held_out, trained, tmp_path):
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"input_ids": f["input_ids"]}) + "\n" for f in held_out[:4]))
    cli = subprocess.run([sys.executable, "-m", "workbench.evaluate", "--model", trained, "--data", str(data), "--sp", "2",
                          "--nproc", "2", "--max-tokens", "512", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    from workbench.data import load_features
    want = each_alone(TrainConfig(model=trained), load_features(str(data)))
    assert [r["example"] for r in rows] == [0, 1, 2, 3] and [r["tokens"] for r in rows] == want.tokens.tolist()
    assert max(abs(r["loss"] - l) / l for r, l in zip(rows, want.loss)) <= 1e-6
    assert "eval: 4 examples" in cli.stdout
