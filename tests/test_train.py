"""workbench.train end to end: the CLI self-launched, under torchrun and FSDP2-sharded agree; checkpoints load.
SP=2 from a real Jupyter kernel equal to one process, with every step on the live dashboard, is asserted by the
tutorial that shows it (nbs/tutorials/launch_sp.ipynb, run by tests/test_notebooks.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from process_utils import run_tree

ROOT = Path(__file__).resolve().parent.parent


def _losses(out: Path) -> list[float]:
    from workbench.dashboard import METRIC_KEYS
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(tuple(r) == METRIC_KEYS for r in rows)  # what the trainer writes is what the dashboard reads
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"]) if r["rank"] == 0]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """One SP=2 run of the CLI each way: self-launched, under torchrun,
    self-launched FSDP2-sharded (the checkpoint tests load)."""
    tmp_path = tmp_path_factory.mktemp("cli")
    args = ["--ulysses", "2", "--steps", "2", "--max-tokens", "256", "--data", "orca_like", "--model", "qwen2"]
    subprocess.run([sys.executable, "-m", "workbench.train", "--nproc", "2", "--out", str(tmp_path / "self"), *args],
                   check=True, cwd=ROOT, timeout=240)
    torchrun = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "-m", "workbench.train", "--out", str(tmp_path / "torchrun"), *args],  # dp from WORLD_SIZE
                        cwd=ROOT, timeout=240)  # a timeout ends torchrun's workers too
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    subprocess.run([sys.executable, "-m", "workbench.train", "--nproc", "2", "--shard", "--out",
                    str(tmp_path / "sharded"), *args], check=True, cwd=ROOT, timeout=240)
    return tmp_path


def test_cli_self_launch_torchrun_and_sharded_agree(cli_runs):
    tmp_path = cli_runs
    a, b, c = _losses(tmp_path / "self"), _losses(tmp_path / "torchrun"), _losses(tmp_path / "sharded")
    assert len(a) == len(b) == len(c) == 2
    assert all(abs(x - y) <= 1e-6 for x, y in zip(a, b)), (a, b)
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(c, a)), (c, a)  # FSDP2-sharded states: the same steps
    from workbench.tiny_models import tiny_config
    for run in ("self", "torchrun"):  # SP=2 checkpoints load with from_pretrained (the sharded one: the test below)
        assert_loads_as_trained(tmp_path / run, tiny_config("qwen2"))


# ---------------------------------------------------------------- checkpoints a user can load with from_pretrained

TEXT = "The quick brown fox jumps over the lazy dog"
# What a user does with the directory afterwards: load model and tokenizer, run them. `python -c LOADER dir out.pt` runs
# it in a fresh interpreter that never imports workbench; `exec` runs it here.
LOADER = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
def load_and_run(model_dir):
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = AutoTokenizer.from_pretrained(model_dir)({TEXT!r}, return_tensors="pt")["input_ids"]
    with torch.no_grad(): logits = model(ids, use_cache=False).logits
    return dict(ids=ids, logits=logits, attn=model.config._attn_implementation,
                tied=model.lm_head.weight is model.get_input_embeddings().weight, workbench="workbench" in sys.modules)
if __name__ == "__main__": torch.save(load_and_run(sys.argv[1]), sys.argv[2])
"""


def assert_loads_as_trained(out: Path, config, fresh: Path | None = None) -> dict:
    """The newest checkpoint's model directory: in its manifest, every weight equal to
    state.pt's, the same logits (in a fresh process when `fresh` is a scratch folder)."""
    import torch
    from transformers import AutoModelForCausalLM
    from workbench.samples import load_tokenizer
    from workbench.checkpoint import latest_checkpoint, MODEL_DIR
    where, manifest = latest_checkpoint(out)
    model_dir = where / MODEL_DIR
    assert ({f"{MODEL_DIR}/{n}" for n in ("config.json", "model.safetensors", "tokenizer.json")}
            <= set(manifest["files"]))
    assert not [k for k in json.loads((model_dir / "config.json").read_text()) if "attn" in k]  # the loader's default
    trained = torch.load(where / "state.pt", weights_only=True)["model"]  # the trained model, as resume restores it
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], v) for k, v in trained.items())
    threads = torch.get_num_threads()
    try:
        if fresh is None:
            scope = {}; exec(LOADER, scope); got = scope["load_and_run"](model_dir)
        else:
            subprocess.run([sys.executable, "-c", LOADER, str(model_dir), str(fresh / "got.pt")], check=True,
                           cwd=fresh, timeout=120)
            got = torch.load(fresh / "got.pt", weights_only=True)
            assert not got["workbench"]
        assert got["attn"] == "sdpa" and torch.equal(got["ids"],
                                                     load_tokenizer()(TEXT, return_tensors="pt")["input_ids"])
        reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        reference.load_state_dict(trained)
        torch.set_num_threads(1)
        with torch.no_grad(): assert torch.equal(reference(got["ids"], use_cache=False).logits, got["logits"])
    finally: torch.set_num_threads(threads)
    return got


def test_sp2_sharded_checkpoint_loads_with_from_pretrained_in_a_fresh_process(cli_runs, tmp_path):
    """The CLI's SP=2 FSDP2-sharded run (sp=2, shard, 2 steps, 256
    tokens, orca_like, qwen2): its checkpoint loads elsewhere."""
    from workbench.tiny_models import tiny_config
    assert_loads_as_trained(cli_runs / "sharded", tiny_config("qwen2"), fresh=tmp_path)


def test_tied_embeddings_from_a_config_directory_save_one_head(tmp_path):
    from safetensors import safe_open
    from workbench.samples import load_tokenizer
    from workbench.tiny_models import tiny_config
    from workbench.checkpoint import latest_checkpoint, MODEL_DIR
    from workbench.config import TrainConfig
    from workbench.train import train_rank
    config = tiny_config("llama", tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "tied")  # a model directory with a config (trained from scratch) and a tokenizer
    load_tokenizer().save_pretrained(tmp_path / "tied")
    train_rank(TrainConfig(model=str(tmp_path / "tied"), steps=2, max_tokens=256, out=str(tmp_path / "run")))
    assert assert_loads_as_trained(tmp_path / "run", config)["tied"]
    with safe_open(latest_checkpoint(tmp_path / "run")[0] / MODEL_DIR / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


def test_the_run_plans_its_features_so_every_step_trains():
    """plan_run gets the features: at 256 tokens on FLAN-like no bin trains
    nothing, with either balance, and the readout counts what was left out."""
    from dataclasses import replace
    from workbench.config import model_config, TrainConfig
    from workbench.data import load_features
    from workbench.readouts import plan_readout
    from workbench.train import plan_run
    cfg = TrainConfig(max_tokens=256, dp=2, grad_accum=2)
    feats = load_features(cfg.data)
    for balance in ("tokens", "cost"):
        plan, sampler, _, _, _ = plan_run(replace(cfg, balance=balance), model_config(cfg), feats, rank=1)
        assert plan.bin_trained.min() >= 1 and plan.untrained > 0
        assert (plan.bin_trained[sampler.epoch_steps()] > 0).all()  # what the ranks are served
    # bare lengths: nothing known, nothing left out
    lengths = plan_run(cfg, model_config(cfg), [len(f["input_ids"]) for f in feats])[0]
    assert (lengths.untrained, lengths.trained) == (0, None) and len(lengths.bins) > len(plan.bins)
    line = plan_readout(plan)
    assert (f"{plan.untrained} pieces ({plan.untrained_tokens} "
            "tokens) train no token (prompt only) and are left out") in line
    assert f"split into {len(plan.length) + plan.untrained - plan.n_examples + plan.split} pieces" in line


def test_a_step_that_trains_nothing_is_refused(tmp_path, monkeypatch):
    """A step with no trained token on any rank stops the run before
    its forward: no 0.0 logged as a loss, no optimizer step."""
    import workbench.train as T
    from workbench.packing import TokenBudgetSampler, plan_bins
    from workbench.train import check_trained
    feats = [{"input_ids": list(range(1, 9)), "completion_mask": [0] * 8}]  # a prompt with nothing to train
    monkeypatch.setattr(T, "run_features", lambda cfg: (feats, None))
    seen = []
    def keep(cfg, config, data, rank=0):  # a plan that keeps what trains nothing (bare lengths or untrained='keep')
        seen.append(data)
        plan = plan_bins(data, cfg.max_tokens, overlong="split", untrained="keep")
        return plan, TokenBudgetSampler(plan), None, None, None
    monkeypatch.setattr(T, "plan_run", keep)
    with pytest.raises(ValueError, match=r"step 0: its bins \(this rank's: \[\[0\]\]\) "
                                         r"train no token on any rank.*untrained='drop'"):
        T.train_rank(T.TrainConfig(steps=2, max_tokens=64, out=str(tmp_path)))
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
    assert seen == [feats]  # train_rank plans the features (their masks), not bare lengths
    check_trained(1, 0, [[0]])  # one trained token anywhere is a step
    monkeypatch.undo()
    # the run's own plan leaves the prompt out: no bins at all
    with pytest.raises(ValueError, match="does none of it train"):
        T.plan_run(T.TrainConfig(max_tokens=64), T.model_config(T.TrainConfig()), feats)


def test_a_run_reads_its_data_once_for_all_its_ranks(tmp_path, monkeypatch):
    """run() reads and tokenizes the data in the parent and hands the
    features to the ranks it forks: one read for SP=2, not three."""
    import os
    import workbench.train as T
    reads, real = tmp_path / "reads", T.run_features
    def counted(cfg):
        with reads.open("a") as f: f.write(f"{os.getpid()}\n")  # a file: the forked ranks' calls count too
        return real(cfg)
    monkeypatch.setattr(T, "run_features", counted)
    losses = T.run(T.TrainConfig(ulysses=2, steps=2, max_tokens=256, data="orca_like", out=str(tmp_path / "run")))
    assert len(losses) == 2 and reads.read_text().split() == [str(os.getpid())]  # the parent's read, none in a rank


# ---------------------------------------------------------------- resume on another layout (issue 29)

def test_a_dp2_checkpoint_resumes_on_ulysses_and_on_a_ring_with_two_micro_steps(tmp_path):
    """A checkpoint written on DP 2 continues on Ulysses 2 and on ring 2, each with 2 micro-steps per step (the same 2
    bins per optimizer step): the remaining losses equal the uninterrupted DP 2 run's. Another global batch is refused
    before any process starts, naming the fields, and leaves the run as it was."""
    import re
    import shutil
    from workbench.checkpoint import latest_checkpoint
    from workbench.config import TrainConfig
    from workbench.train import run
    common = dict(model="qwen2", data="orca_like", max_tokens=256)
    straight = run(TrainConfig(**common, dp=2, steps=4, out=str(tmp_path / "straight")))
    run(TrainConfig(**common, dp=2, steps=2, out=str(tmp_path / "saved")))
    for name, layout in (("ulysses", dict(ulysses=2)), ("ring", dict(ring=2))):
        out = tmp_path / name
        shutil.copytree(tmp_path / "saved", out)
        resumed = run(TrainConfig(**common, dp=1, grad_accum=2, steps=4, resume=True, out=str(out), **layout))
        assert len(resumed) == 2 and max(abs(a - b) / abs(b)
                                         for a, b in zip(resumed, straight[2:])) <= 1e-5, (name, resumed, straight)
        manifest = latest_checkpoint(out, say=lambda _: None)[1]
        kernel = "fused" if name == "ring" else "plain"  # the default kernel on CPU: fused where there is a ring
        assert manifest["step"] == 4 and manifest["layout"] == {"dp": 1, "ulysses": 1, "ring": 1, "gather": 1,
                                                                "grad_accum": 2, **layout,
                                                                     "ring_kernel": kernel}
    before = (tmp_path / "saved" / "metrics.jsonl").read_text()
    words = ("it trained 2 bins per optimizer step (dp x grad_accum = "
             "2 x 1) and this run has 1 x 1 = 1 (--dp, --grad-accum)")
    with pytest.raises(ValueError, match=re.escape(words)):
        run(TrainConfig(**common, ulysses=2, steps=4, resume=True, out=str(tmp_path / "saved")))
    assert (tmp_path / "saved" / "metrics.jsonl").read_text() == before
    assert latest_checkpoint(tmp_path / "saved", say=lambda _: None)[1]["step"] == 2


# ---------------------------------------------------------------- `sp` renamed `ulysses` (issue 49)

def test_a_run_written_before_sp_was_renamed_ulysses_resumes_on_its_own_layout(tmp_path, capsys):
    """A run directory an older workbench wrote names the Ulysses degree "sp" (its config.json and its checkpoints'
    layouts): the dashboard labels it by that degree, and it resumes on its own layout, not as a layout change, to the
    uninterrupted run's losses. The old spellings of the field and the flag are `02_config.ipynb`'s example."""
    from workbench.config import TrainConfig
    from workbench.dashboard import Dashboard
    from workbench.train import train_rank
    small = dict(max_tokens=512, save_every=1)
    straight = train_rank(TrainConfig(steps=3, out=str(tmp_path / "straight"), **small))
    out = tmp_path / "old"
    first = train_rank(TrainConfig(steps=2, out=str(out), **small))
    for f in [out / "config.json", *out.glob("checkpoints/step-*/manifest.json")]:  # as written before the rename
        assert '"ulysses"' in f.read_text(); f.write_text(f.read_text().replace('"ulysses"', '"sp"'))
    assert Dashboard(out).labels() == ["SP=1 DP=1"]
    capsys.readouterr()
    resumed = train_rank(TrainConfig(steps=3, out=str(out), resume=True, **small))
    assert first + resumed == straight and "another layout" not in capsys.readouterr().out
