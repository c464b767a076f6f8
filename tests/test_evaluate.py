"""workbench.evaluate: per-example loss and token accuracy under Ulysses 2, ring 2 and DP 2 (fp32, within 1e-6 relative)
and Ulysses 2 x ring 2 (fp64, within 1e-12) equal one process evaluating each example alone, unpacked (the fp32 2 x 2 is
in nbs/04_runtime/14_evaluate.ipynb); so does evaluation during training (`--eval-data`, Ulysses 2) against each step's
checkpoint; bad input is refused before any process starts; the command line writes eval.jsonl."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from workbench.config import TrainConfig
from workbench.evaluate import each_alone, evaluate, main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def held_out():
    """Ten OrcaMath-like examples in rows of 512 tokens: an odd number
    of bins, so DP 2 repeats one (and must not count it twice)."""
    from workbench.samples import load_tokenizer
    from workbench.data import load_features
    from workbench.packing import plan_bins
    features = load_features("orca_like", load_tokenizer())[-10:]
    assert len(plan_bins(features, 512, overlong="error", untrained="keep").bins) % 2 == 1
    return features


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, held_out) -> Path:
    """A 12-step Ulysses 2 run that evaluates the ten held-out examples (as a file of prompt + completion rows) after
    steps 6 and 12 and keeps the checkpoints of both: a random model's argmax is never the label, so its accuracy proves
    nothing."""
    from workbench.samples import load_tokenizer
    from workbench.data import load_features
    from workbench.train import run
    out = tmp_path_factory.mktemp("trained")
    rows = (ROOT / "data_samples" / "orca_like.jsonl").read_text().splitlines()[-10:]
    (out / "held_out.jsonl").write_text("\n".join(rows) + "\n")
    assert load_features(str(out / "held_out.jsonl"), load_tokenizer()) == held_out
    run(TrainConfig(model="qwen2", data="orca_like", steps=12, lr=1e-2, max_tokens=512, ulysses=2, save_every=6,
                    eval_data=str(out / "held_out.jsonl"), eval_every=6, out=str(out / "run")))
    return out / "run"


@pytest.fixture(scope="module")
def trained(run_dir) -> str:
    "The run's last checkpoint model."
    from workbench.checkpoint import latest_checkpoint
    return str(latest_checkpoint(run_dir, say=lambda _: None)[0] / "model")


def test_evaluation_during_training_equals_each_example_alone_on_the_checkpoint(run_dir, held_out):
    """Evaluated between steps under Ulysses 2, each example's loss equals that step's checkpoint evaluating the example
    alone on one process: after the step's update, before the next (an evaluation a step early or late differs)."""
    from workbench.tracking import EVALUATIONS, read_metrics
    rows = read_metrics(run_dir, EVALUATIONS)
    assert [r["step"] for r in rows] == [5, 11] and all(r["examples"] == 10 for r in rows)
    for r in rows:
        model = run_dir / "checkpoints" / f"step-{r['step'] + 1:06d}" / "model"
        reference = each_alone(TrainConfig(model=str(model), max_tokens=512), held_out)
        assert np.max(np.abs(np.array(r["example_loss"])
                             - reference.loss) / reference.loss) < 1e-6, (r["step"], r, reference)
        assert (abs(r["loss"] - reference.mean_loss()) < 1e-6 * reference.mean_loss()
                and r["accuracy"] == reference.mean_accuracy())
        assert r["tokens"] == int(reference.tokens.sum())
    assert rows[1]["loss"] < rows[0]["loss"]  # the model learned between them


def close(got, want, rtol: float) -> bool:
    return bool(np.max(np.abs(got.loss - want.loss) / want.loss) <= rtol and np.array_equal(got.tokens, want.tokens)
                and np.array_equal(got.accuracy, want.accuracy))


def test_every_layout_equals_each_example_alone(held_out, trained):
    base = TrainConfig(model=trained, max_tokens=512)
    reference = each_alone(base, held_out)
    assert reference.tokens.min() > 0 and 0 < reference.mean_accuracy() < 1
    for layout in (dict(ulysses=2), dict(ring=2), dict(dp=2)):
        got = evaluate(replace(base, **layout), held_out)
        assert close(got, reference, 1e-6), (layout, got, reference)
    f64 = replace(base, dtype="float64")
    assert close(evaluate(replace(f64, ulysses=2, ring=2), held_out), each_alone(f64, held_out), 1e-12)


def test_bad_input_is_refused_before_any_process_starts(held_out, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"max_tokens \(--max-tokens\) 64: .*Evaluation "
                                         r"keeps every example whole: raise --max-tokens"):
        evaluate(TrainConfig(model="qwen2", max_tokens=64), held_out)
    with pytest.raises(ValueError, match="sp_size=8 is more than the 4 attention heads"):
        evaluate(TrainConfig(model="qwen2", ulysses=8), held_out)
    prompts_only = [{"input_ids": f["input_ids"], "labels": [-100] * len(f["input_ids"])} for f in held_out[:2]]
    with pytest.raises(ValueError, match="none of the 2 examples has a trained target"):
        evaluate(TrainConfig(model="qwen2", max_tokens=512), prompts_only)
    with pytest.raises(SystemExit) as e: main(["--lr", "0.1", "--steps", "3"])  # the CLI itself: the test below
    assert e.value.code == 2 and "--steps, --lr do not apply to evaluation" in capsys.readouterr().err
    # evaluation during training: refused when built, or before any process starts
    with pytest.raises(ValueError, match=r"eval_every \(--eval-every\) 2 evaluates "
                                         r"held-out data: name it with eval_data"):
        TrainConfig(eval_every=2)
    with pytest.raises(ValueError, match=r"loss_chunk \(--loss-chunk\) exists to avoid"):
        TrainConfig(eval_data="x.jsonl", loss_chunk=64)
    from workbench.train import preflight_run
    rows = (ROOT / "data_samples" / "orca_like.jsonl").read_text().splitlines()[-2:]
    (tmp_path / "two.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"eval_data \(--eval-data\) .*two.jsonl.*max_tokens "
                                         r"\(--max-tokens\) 64: .*raise --max-tokens"):
        preflight_run(TrainConfig(model="qwen2", data="orca_like", max_tokens=64, eval_data=str(tmp_path / "two.jsonl"),
                                  out=str(tmp_path / "run")))


def test_the_command_line_writes_one_row_per_example(held_out, trained, tmp_path):
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"input_ids": f["input_ids"]}) + "\n" for f in held_out[:4]))
    cli = subprocess.run([sys.executable, "-m", "workbench.evaluate", "--model", trained, "--data", str(data),
                          "--ulysses", "2", "--nproc", "2", "--max-tokens", "512", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    from workbench.data import load_features
    want = each_alone(TrainConfig(model=trained), load_features(str(data)))
    assert [r["example"] for r in rows] == [0, 1, 2, 3] and [r["tokens"] for r in rows] == want.tokens.tolist()
    assert max(abs(r["loss"] - l) / l for r, l in zip(rows, want.loss)) <= 1e-6
    assert "eval: 4 examples" in cli.stdout


def test_a_model_that_is_not_trained_weights_is_refused_or_named(tmp_path):
    """--model: a directory with config.json and a tokenizer but no weights is refused, naming the files transformers
    looks for (it would score a random initialisation); a run directory with no complete checkpoint names what is
    missing; a LoRA run's checkpoint is refused (model/ is the base without the adapter); a shipped family is evaluated
    at random and says so in one line."""
    import contextlib, io
    from workbench.checkpoint import commit_checkpoint
    from workbench.samples import load_tokenizer
    from workbench.tiny_models import tiny_config
    from workbench.evaluate import eval_model
    bare = tmp_path / "bare"
    tiny_config("llama").save_pretrained(bare); load_tokenizer().save_pretrained(bare)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(["--model", str(bare), "--out", str(tmp_path)])
    refused = (f"model (--model) '{bare}' has a config.json but no weights (none of model.safetensors, "
               "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json): evaluating it would "
               "score a random initialisation")
    assert e.value.code == 2 and refused in err.getvalue(), err.getvalue()
    said = []
    assert eval_model("qwen2", seed=3, say=said.append) == "qwen2"
    assert said == ["model (--model) 'qwen2' is a shipped family: evaluating a random initialisation of its tiny "
                    "config (seed 3), a baseline, not a trained model"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "llama", "steps": 10, "plan": "PackingPlan(...)"}))  # a run
    with pytest.raises(ValueError, match=r"run's directory with nothing to evaluate: it has no checkpoints/"):
        eval_model(str(run))
    (run / "checkpoints" / "step-000010").mkdir(parents=True)  # killed in its save: no manifest
    with pytest.raises(ValueError, match=r"checkpoints holds no complete checkpoint \(a step-\* directory with its"):
        eval_model(str(run), say=lambda _: None)

    def lora_dirs(d):  # what a LoRA run's save writes: the frozen base and the adapter
        for sub in ("model", "adapter"): (d / sub).mkdir(); (d / sub / "config.json").write_text("{}")
    commit_checkpoint(run, 10, {}, {"config": {}}, keep=1, write_model=lora_dirs)
    with pytest.raises(ValueError, match=r"step-000010 is a LoRA run's: model/ holds the frozen base and adapter/"):
        eval_model(str(run))


def test_a_run_directory_evaluates_its_newest_checkpoint_with_row_ids(run_dir, trained, tmp_path, capsys):
    "--model RUN evaluates RUN's newest complete checkpoint (named in one line); eval.jsonl keeps each row's own id."
    from workbench.data import load_features, run_tokenizer
    rows = [json.loads(l) for l in (ROOT / "data_samples" / "orca_like.jsonl").read_text().splitlines()[-3:]]
    data = tmp_path / "with_ids.jsonl"
    data.write_text("".join(json.dumps({"id": f"orca-{i}", **r}) + "\n" for i, r in enumerate(rows, 7)))
    main(["--model", str(run_dir), "--data", str(data), "--max-tokens", "512", "--out", str(tmp_path / "eval")])
    assert f"evaluating its newest complete checkpoint, {trained} (step 12)" in capsys.readouterr().out
    got = [json.loads(l) for l in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    want = each_alone(TrainConfig(model=trained), load_features(str(data), run_tokenizer(TrainConfig(model=trained))))
    ids = ["orca-7", "orca-8", "orca-9"]
    assert [(r["example"], r["id"], r["tokens"]) for r in got] == list(zip([0, 1, 2], ids, want.tokens.tolist()))
    assert max(abs(r["loss"] - l) / l for r, l in zip(got, want.loss)) <= 1e-6


def test_flash_attention_without_flash_attn_names_the_fix(held_out, monkeypatch):
    """--attn flash_attention_2 where flash-attn is not installed: an error naming the gpu extra and workbench_varlen
    before any process starts, not an ImportError inside a rank."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as on a machine without flash-attn
    with pytest.raises(ValueError, match=r"flash-attn package, which is not installed here .*pip install -e "
                                         r"'\.\[gpu\]'.*--attn workbench_varlen, the workbench's own varlen attention"):
        evaluate(TrainConfig(model="qwen2", max_tokens=512, attn="flash_attention_2"), held_out)


def test_help_lists_only_the_flags_evaluation_reads(capsys):
    import re
    from workbench.config import RENAMED, flag
    from workbench.evaluate import EVAL_FIELDS
    with pytest.raises(SystemExit) as e: main(["--help"])
    listed = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
    old = {flag(name) for name, field in RENAMED.items() if field in EVAL_FIELDS}  # --sp, the old --ulysses
    assert e.value.code == 0 and listed == {"--help", "--nproc", *map(flag, EVAL_FIELDS), *old}, listed


def test_a_qwen2_checkpoint_tokenizes_as_its_run_did(run_dir, trained, tmp_path):
    """A qwen2 run's checkpoint holds the shipped tokenizer (saved by the generic tokenizers backend): it loads back as
    that tokenizer, not as the Qwen2Tokenizer config.json's model_type would pick, so evaluating the checkpoint counts
    the trained tokens training counted on the same rows, and scores each as training's evaluation of that step did."""
    from workbench.samples import load_tokenizer
    from workbench.data import load_features, run_tokenizer
    from workbench.tracking import EVALUATIONS, read_metrics
    held_out = str(run_dir.parent / "held_out.jsonl")  # what the run evaluated after steps 6 and 12
    assert (load_features(held_out, run_tokenizer(TrainConfig(model=trained)))
            == load_features(held_out, load_tokenizer()))
    main(["--model", trained, "--data", held_out, "--max-tokens", "512", "--out", str(tmp_path)])
    got = [json.loads(l) for l in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # after step 12's update: the model of the checkpoint evaluated here
    during = read_metrics(run_dir, EVALUATIONS)[-1]
    assert sum(r["tokens"] for r in got) == during["tokens"]
    assert max(abs(r["loss"] - l) / l for r, l in zip(got, during["example_loss"], strict=True)) <= 1e-6
