"""workbench.hf: Trainer / SFTTrainer with default arguments equal a padded, correctly masked reference; check_trainer;
packed eval split == unpacked eval; token-budget resume is exact; 2-process DDP."""
import json
import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer

from workbench.core import IGNORE_INDEX
from workbench.samples import load_sample
from workbench.tiny_models import tiny_config, tiny_model
from workbench.hf import (PackedSFTTrainer, PackedTrainer, check_trainer, fold_example, prepare_dataset,
                          split_packed)
from workbench.launch import launch
from workbench.packing import FlatteningCollator, PaddingCollator, plan_bins
from workbench.data import load_features

N, STEPS = 32, 2


@pytest.fixture(scope="module")
def flan():
    return load_sample("flan_like", limit=2 * N)


def chat_features(flan):
    "Two-turn chats from pairs of FLAN examples: assistant_masks 1 on each assistant turn only (non-contiguous)."
    out = []
    for a, b in zip(flan[0::2], flan[1::2]):
        ids, mask = [], []
        for f in (a, b):
            ids += f["input_ids"]; mask += f["completion_mask"]
        out.append({"input_ids": ids, "assistant_masks": mask})
    return out


def masked(f):
    "The reference labels of one raw feature: -100 wherever any loss mask is 0."
    m = np.ones(len(f["input_ids"]), dtype=bool)
    for k in ("completion_mask", "assistant_masks"):
        if k in f: m &= np.asarray(f[k], dtype=bool)
    return [t if k else IGNORE_INDEX for t, k in zip(f["input_ids"], m)]


class Recorder:
    "A collator that records the input_ids of every batch it collates (the steps the trainer took)."
    def __init__(self, collator=None): self.collator, self.batches = collator or FlatteningCollator(), []
    def __call__(self, features, *a, **k):
        self.batches.append([list(map(int, f["input_ids"])) for f in features])
        return self.collator(features, *a, **k)


def args(tmp_path, cls=TrainingArguments, **kw):
    """Default arguments apart from what a test must set: logging every step (to compare per-step losses), and for
    SFTConfig fp32 (its default is bf16, which no 1e-5 comparison survives)."""
    fp32 = dict(bf16=False) if cls is SFTConfig else {}
    return cls(**{**dict(output_dir=str(tmp_path), max_steps=STEPS, report_to=[], use_cpu=True, save_strategy="no",
                         logging_steps=1, disable_tqdm=True), **fp32, **kw})


def losses(trainer): return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def llama(): return tiny_model("llama").train()


def lora():
    """A tiny Llama inside a PeftModel, LoRA on every linear layer,
    B random too (a zero B would hide a wrong first step)."""
    from peft import LoraConfig, get_peft_model
    model = llama()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def reference(steps, raw, n_steps, lr=5e-5, max_grad_norm=1.0, make=llama):  # Trainer's defaults (SFTConfig: lr 2e-5)
    "Per-step losses of a hand loop on padded batches with correct masks; `steps` are the examples of each step."
    by_ids = {tuple(f["input_ids"]): masked(f) for f in raw}
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)  # Trainer's default optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (n_steps - s) / n_steps))  # linear to 0
    out = []
    for exs in steps:
        batch = PaddingCollator()([{"input_ids": ids, "labels": by_ids[tuple(ids)]} for ids in exs])
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step(); sched.step(); opt.zero_grad()
        out.append(loss.item())
    return out


def run(kind, raw, tmp_path, max_tokens=None, make=llama, **kw):
    "Train STEPS steps with default arguments; return (trainer, logged losses, examples of each step)."
    rec, ds = Recorder(), Dataset.from_list(raw)
    model = make()
    if kind == "Trainer+prepare_dataset":  # the plain drop-in: no subclass
        t = Trainer(model=model, args=args(tmp_path, **kw), train_dataset=prepare_dataset(ds), data_collator=rec)
    elif kind in ("PackedTrainer", "PackedTrainer+stream"):
        d = ds.to_iterable_dataset() if kind.endswith("stream") else ds  # a stream is packed online (PackedStream)
        t = PackedTrainer(model=model, args=args(tmp_path, **kw), train_dataset=d, data_collator=rec,
                          max_tokens=max_tokens)
    else:
        from workbench.samples import load_tokenizer
        t = PackedSFTTrainer(model=model, args=args(tmp_path, SFTConfig, **kw), train_dataset=ds, data_collator=rec,
                             processing_class=load_tokenizer(), max_tokens=max_tokens)
    t.train()
    # accelerate's loader collates one batch ahead (to know the last one): keep the batches the steps consumed
    return t, losses(t), rec.batches[:STEPS * t.args.gradient_accumulation_steps]


# ---------------------------------------------------------------- the trap, measured
def test_default_trainer_drops_masks_and_the_collator_says_so_once(flan, tmp_path):
    """The trap: plain Trainer with default arguments removes completion_mask,
    so its loss covers the prompt too; FlatteningCollator says so, once."""
    raw = flan[:N]
    rec = Recorder()
    t = Trainer(model=tiny_model("llama").train(), args=args(tmp_path), train_dataset=Dataset.from_list(raw),
                data_collator=rec)
    with pytest.warns(UserWarning, match="every token is trained") as caught:
        t.train()
    said = [w for w in caught if "every token is trained" in str(w.message)]
    assert (len(said) == 1
            and "remove_unused_columns removed them: use prepare_dataset or PackedTrainer" in str(said[0].message))
    assert len(rec.batches) > 1  # several batches collated, one warning
    ref = reference(rec.batches[:STEPS], raw, STEPS)
    assert abs(losses(t)[0] - ref[0]) > 1e-3  # trained on prompt tokens
    meant = Trainer(model=t.model, args=args(tmp_path), train_dataset=Dataset.from_list(raw),
                    data_collator=FlatteningCollator(train_all_tokens=True))
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        # the same columns removed, the same collator: all tokens, by intent
        batches = list(meant.get_train_dataloader())
    assert len(batches) == N // 8 and not [w for w in quiet if "every token is trained" in str(w.message)]


# ---------------------------------------------------------------- default arguments == padded, masked reference
CASES = [("completion", "Trainer+prepare_dataset", None), ("completion", "PackedTrainer", None),
         ("completion", "PackedTrainer", 1024), ("completion", "PackedSFTTrainer", None),
         ("completion", "PackedSFTTrainer", 1024), ("chat", "PackedTrainer", 2048), ("chat", "PackedSFTTrainer", None),
         ("completion", "PackedTrainer+stream", 1024)]


@pytest.mark.parametrize("data,kind,max_tokens", CASES)
def test_losses_equal_padded_reference(flan, tmp_path, data, kind, max_tokens):
    raw = flan[:N] if data == "completion" else chat_features(flan)
    t, got, steps = run(kind, raw, tmp_path, max_tokens)
    assert len(got) == STEPS and len(steps) == STEPS
    if not max_tokens: assert all(len(s) == 8 for s in steps)
    else: assert all(sum(map(len, s)) <= max_tokens for s in steps)
    if max_tokens and t.plan: assert len(t.get_train_dataloader()) == len(t.plan.bins)
    np.testing.assert_allclose(got, reference(steps, raw, STEPS, t.args.learning_rate), atol=1e-5, rtol=0)


def test_gradient_accumulation_is_token_weighted(flan, tmp_path):
    "Two micro-batches of different token counts per step: the loss is sum of token losses / trained tokens of both."
    raw = flan[:N]
    t, got, steps = run("PackedTrainer", raw, tmp_path, 600, gradient_accumulation_steps=2)
    merged = [steps[0] + steps[1], steps[2] + steps[3]]
    assert sum(map(len, steps[0])) != sum(map(len, steps[1]))
    np.testing.assert_allclose(got, reference(merged, raw, STEPS), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- DDP: 2 forked gloo ranks
def _ddp_rank(raw, out_dir, kind, max_tokens, ga):
    import torch.distributed as dist
    from pathlib import Path
    t, got, steps = run(kind, raw, Path(out_dir) / str(dist.get_rank()), max_tokens, gradient_accumulation_steps=ga)
    return dict(world_size=t.args.world_size, rank=t.args.process_index, losses=got, steps=steps,
                # one epoch's steps (a stream has no len)
                n_steps=sum(1 for _ in t.get_train_dataloader()), lr=t.args.learning_rate)


@pytest.mark.parametrize("data,kind,max_tokens,ga",
                         [("completion", "PackedTrainer", 1024, 1), ("completion", "PackedSFTTrainer", None, 1),
                          ("completion", "PackedTrainer+stream", 1024, 1), ("chat_like", "PackedTrainer", 1024, 2)])
def test_ddp_two_ranks_equal_reference(flan, tmp_path, data, kind, max_tokens, ga):
    "chat_like: the shipped chat sample (its template's assistant_masks), with 2 micro-batches per step on each rank."
    raw = (flan[:N] if data == "completion"
           else [f for f in load_features("chat_like") if len(f["input_ids"]) <= 1024][:N])
    res = launch(_ddp_rank, raw, str(tmp_path), kind, max_tokens, ga, num_processes=2, deadline_s=120, quiet=True)
    assert [r["world_size"] for r in res] == [2, 2] and [r["rank"] for r in res] == [0, 1]
    assert res[0]["n_steps"] == res[1]["n_steps"]  # the same step count on every rank
    micro = [a + b for a, b in zip(res[0]["steps"], res[1]["steps"])]  # both ranks' examples of each micro-batch
    steps = [sum(micro[i:i + ga], []) for i in range(0, len(micro), ga)]  # one step = its micro-batches on both ranks
    assert not set(map(tuple, res[0]["steps"][0])) & set(map(tuple, res[1]["steps"][0]))  # each rank its own examples
    np.testing.assert_allclose(res[0]["losses"], reference(steps, raw, STEPS, res[0]["lr"]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(res[0]["losses"], res[1]["losses"], atol=0, rtol=0)


# ---------------------------------------------------------------- resume through Trainer's checkpoints
@pytest.mark.parametrize("n,bins,stream,workers",
                         [(N, None, False, 0), (N, None, False, 2), (6, 2, False, 0), (N, None, True, 0)],
                         ids=["mid-epoch", "mid-epoch-2-workers", "epoch-boundary", "stream"])
def test_token_budget_resume_is_exact(flan, tmp_path, n, bins, stream, workers):
    """Mid-epoch, also with 2 forked workers that prefetch: skip_first_batches re-draws the epoch's order, so the resume
    is still exact; at an epoch boundary; and a stream, re-packed up to the checkpoint's step."""
    ds = Dataset.from_list(flan[:n])
    if stream: ds = ds.to_iterable_dataset()  # resumed by re-packing the stream up to the checkpoint's step
    mk = lambda d, **kw: PackedTrainer(model=tiny_model("llama").train(),
                                       args=args(d, max_steps=4, dataloader_num_workers=workers, **kw),
                                       train_dataset=ds, max_tokens=1024)
    full = mk(tmp_path / "full"); full.train()
    if bins: assert len(full.plan.bins) == bins  # the checkpoint after step 2 ends epoch 0: the resume starts epoch 1
    half = mk(tmp_path / "half", save_strategy="steps", save_steps=2)
    half.train()  # 4 steps, a checkpoint after step 2: as if the run had been killed after it
    resumed = mk(tmp_path / "half"); resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-2"))
    assert len(losses(resumed)) == 4 and losses(resumed) == losses(full)  # steps 1-2 from the checkpoint, 3-4 resumed
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- eval split
def _metrics(p):
    "Token accuracy, trained-token count and the mean logit of each target (a random model's accuracy is about 0)."
    logits, target = p.predictions[:, :-1], p.label_ids[:, 1:]
    keep = target != IGNORE_INDEX
    picked = np.take_along_axis(logits, np.where(keep, target, 0)[..., None], -1)[..., 0]
    return {"accuracy": float((logits.argmax(-1)[keep] == target[keep]).mean()), "n": int(keep.sum()),
            "target_logit": float(picked[keep].mean())}


@pytest.mark.parametrize("cls", [PackedTrainer, PackedSFTTrainer])
# TRL's notice on the logits this test compares
@pytest.mark.filterwarnings("ignore:`return_outputs=True`:FutureWarning")
def test_packed_eval_split_equals_unpacked(flan, tmp_path, cls):
    "PackedSFTTrainer: TRL's prediction_step recomputes the logits its fused loss head does not build; split the same."
    from workbench.samples import load_tokenizer
    ev = prepare_dataset(Dataset.from_list(flan[N:N + 12]))  # eval batches of 8 and 4 (of different lengths)
    kw = dict(model=tiny_model("llama"), args=args(tmp_path), eval_dataset=ev, compute_metrics=_metrics)
    sft = (dict(args=args(tmp_path, SFTConfig), train_dataset=ev, processing_class=load_tokenizer())
           if cls is PackedSFTTrainer else {})
    packed, padded = cls(**{**kw, **sft}), Trainer(**kw, data_collator=PaddingCollator())
    p, q = packed.predict(ev), padded.predict(ev)
    lengths = [len(x) for x in ev["input_ids"]]
    assert p.predictions.shape[:2] == (12, max(lengths)) and p.label_ids.shape == (12, max(lengths))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(p.predictions[i, :n], q.predictions[i, :n], atol=1e-5, rtol=0)
        assert (p.predictions[i, n:] == IGNORE_INDEX).all() and (p.label_ids[i, n:] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(p.label_ids[i, :n], q.label_ids[i, :n])
    assert p.metrics["test_accuracy"] == q.metrics["test_accuracy"] and p.metrics["test_n"] == q.metrics["test_n"]
    assert abs(p.metrics["test_loss"] - q.metrics["test_loss"]) < 1e-6
    assert abs(p.metrics["test_target_logit"] - q.metrics["test_target_logit"]) < 1e-6
    # TRL's own eval metrics (entropy, accuracy over the trained tokens) equal TRL's padded eval
    if cls is PackedSFTTrainer:
        trl = SFTTrainer(model=kw["model"], args=args(tmp_path, SFTConfig), train_dataset=ev, eval_dataset=ev,
                         processing_class=load_tokenizer())
        a, b = packed.evaluate(), trl.evaluate()
        assert (abs(a["eval_entropy"] - b["eval_entropy"]) < 1e-5
                and a["eval_mean_token_accuracy"] == b["eval_mean_token_accuracy"])
        assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-5


def _predict_rank(rows, out_dir):
    import torch.distributed as dist
    from pathlib import Path
    ev = prepare_dataset(Dataset.from_list(rows))
    torch.manual_seed(0)
    t = PackedTrainer(model=tiny_model("llama"),
                      args=args(Path(out_dir) / str(dist.get_rank()), per_device_eval_batch_size=4),
                      eval_dataset=ev, compute_metrics=_metrics)
    p = t.predict(ev)
    return dict(world_size=t.args.world_size, predictions=p.predictions, label_ids=p.label_ids, metrics=p.metrics)


def test_packed_eval_on_two_ranks_equals_one_process_unpacked(flan, tmp_path):
    """DP 2: each rank predicts its own packed batches (4 examples each); Trainer gathers them across the ranks (padding
    each to the longest and dropping the repeats that even out the last batches). Per example, the logits and labels
    equal one process's padded predictions, and so do accuracy, trained tokens and the target logits."""
    rows = flan[N:N + 10]  # 10 examples over 2 ranks × 4: the last round repeats two, which must not be counted
    res = launch(_predict_rank, rows, str(tmp_path), num_processes=2, deadline_s=120, quiet=True)
    assert [r["world_size"] for r in res] == [2, 2]
    torch.manual_seed(0)
    ev = prepare_dataset(Dataset.from_list(rows))
    q = Trainer(model=tiny_model("llama"), args=args(tmp_path / "one"), eval_dataset=ev, compute_metrics=_metrics,
                data_collator=PaddingCollator()).predict(ev)
    lengths = [len(x) for x in ev["input_ids"]]
    for r in res:
        p = r["predictions"]
        assert p.shape[0] == 10, p.shape  # every example once, in the dataset's order
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(p[i, :n], q.predictions[i, :n], atol=1e-5, rtol=0)
            np.testing.assert_array_equal(r["label_ids"][i, :n], q.label_ids[i, :n])
            assert (r["label_ids"][i, n:] == IGNORE_INDEX).all()
        assert (r["metrics"]["test_accuracy"] == q.metrics["test_accuracy"]
                and r["metrics"]["test_n"] == q.metrics["test_n"])
        assert abs(r["metrics"]["test_target_logit"] - q.metrics["test_target_logit"]) < 1e-6


def _alst_predict_rank(train_rows, rows, out_dir, attention, guarded, trl):
    """Two CPU processes under DeepSpeed ALST (SP 2) through accelerate, as for the HF Trainer: two SGD steps on rows of
    one example each (equal lengths: gloo's all_gather in ALST's adapter takes no uneven shards), then predict packed
    evaluation rows. `guarded=False` lets a refused set-up run (the broken case); `trl`: PackedSFTTrainer and
    SFTConfig."""
    import os
    import torch.distributed as dist
    import workbench.hf as hf
    from pathlib import Path
    from accelerate.state import PartialState
    from workbench.engines import ACCELERATE_ENV, _probe_ops_quietly, alst_parallelism_config, trainer_ds_config
    os.environ.update(ACCELERATE_ENV)
    _probe_ops_quietly()
    PartialState(backend="gloo")  # accelerate's state over the launch's gloo group (as engine 'alst_accelerate')
    if not guarded: hf.check_parallelism_args = lambda args: None
    torch.manual_seed(0)
    model = tiny_model("llama", attn_implementation=attention)
    from workbench.samples import load_tokenizer
    a = args(Path(out_dir) / str(dist.get_rank()), SFTConfig if trl else TrainingArguments,
             per_device_train_batch_size=1, per_device_eval_batch_size=4,
             learning_rate=0.1, optim="sgd", use_cpu=False, remove_unused_columns=False, deepspeed=trainer_ds_config(),
             parallelism_config=alst_parallelism_config(2, attention),
             accelerator_config={"use_configured_state": True})
    ev = prepare_dataset(Dataset.from_list(rows))
    trainer = hf.PackedSFTTrainer if trl else hf.PackedTrainer
    t = trainer(model=model, args=a, train_dataset=Dataset.from_list(train_rows), eval_dataset=ev,
                data_collator=FlatteningCollator(return_flash_attn_kwargs=False), compute_metrics=_metrics,
                **(dict(processing_class=load_tokenizer()) if trl else {}))
    t.train()
    p = t.predict(ev)
    weights = {k: v.detach().clone() for k, v in t.model.state_dict().items()} if dist.get_rank() == 0 else None
    return dict(predictions=p.predictions, label_ids=p.label_ids, metrics=p.metrics, weights=weights)


def test_packed_eval_under_alst_equals_one_process_unpacked(flan, tmp_path):
    """PackedTrainer and PackedSFTTrainer under DeepSpeed ALST (SP 2, workbench_varlen): per example, the packed
    predictions of the trained model equal one process's padded predictions of the same weights, and so do accuracy,
    trained tokens and target logits. With sdpa as ALST's inner attention (refused by check_parallelism_args, let
    through here) the same comparison fails: evaluation attends across the documents of each packed row. Before
    accelerate 1.12 (the floors) there is no ALST through accelerate: the recipe's config refuses, naming the
    release."""
    from workbench.tiny_models import release
    from workbench.engines import alst_parallelism_config
    if release("accelerate") < (1, 12):
        with pytest.raises(ImportError, match=r"needs accelerate >= 1.12, installed"): alst_parallelism_config(2)
        pytest.skip(f"accelerate {'.'.join(map(str, release('accelerate')))} < 1.12 refuses ALST (checked above): "
                    "the packed evaluation under ALST needs 1.12")
    train_rows = [dict(input_ids=f["input_ids"][:40]) for f in flan[:4]]  # 2 steps × 2 SP ranks, one example each
    rows = flan[N:N + 10]
    ev = prepare_dataset(Dataset.from_list(rows))
    lengths = [len(x) for x in ev["input_ids"]]
    worst = {}
    for attention, guarded, trl in (("workbench_varlen", True, False), ("workbench_varlen", True, True),
                                    ("sdpa", False, False)):
        res = launch(_alst_predict_rank, train_rows, rows, str(tmp_path / f"{attention}{trl}"), attention, guarded, trl,
                     num_processes=2, deadline_s=240, quiet=True)
        torch.manual_seed(0)
        model = tiny_model("llama")  # the initial weights, then the trained ones (two SGD steps moved them)
        assert any((w != res[0]["weights"][k]).any() for k, w in model.state_dict().items())
        model.load_state_dict(res[0]["weights"])
        q = Trainer(model=model, args=args(tmp_path / "one"), compute_metrics=_metrics,
                    data_collator=PaddingCollator()).predict(ev)
        key = (attention, trl)
        worst[key] = 0.0
        for r in res:
            p = r["predictions"]
            assert p.shape[0] == len(rows), p.shape  # every example once, in the dataset's order
            for i, n in enumerate(lengths):
                worst[key] = max(worst[key], float(np.abs(p[i, :n] - q.predictions[i, :n]).max()))
                np.testing.assert_array_equal(r["label_ids"][i, :n], q.label_ids[i, :n])
        if attention == "workbench_varlen":
            for r in res:
                assert (r["metrics"]["test_accuracy"] == q.metrics["test_accuracy"]
                        and r["metrics"]["test_n"] == q.metrics["test_n"])
                assert abs(r["metrics"]["test_target_logit"] - q.metrics["test_target_logit"]) < 1e-6
    # measured about 3e-7 and 0.7
    assert (max(worst[("workbench_varlen", False)], worst[("workbench_varlen", True)])
            < 1e-5 < 0.1 < worst[("sdpa", False)]), worst


def test_split_packed_by_cu_or_positions():
    batch = FlatteningCollator(train_all_tokens=True)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    for b in (batch["cu_seq_lens_q"], batch["position_ids"]):
        torch.testing.assert_close(split_packed(batch["input_ids"], b), torch.tensor([[1, 2, 3], [4, 5, IGNORE_INDEX]]))
    with pytest.raises(ValueError, match="same packed batch"): split_packed(batch["input_ids"][:, :4],
                                                                            batch["cu_seq_lens_q"])


def test_eval_refuses_padding_dummy(flan, tmp_path):
    ev = Dataset.from_list(flan[:8])
    t = PackedTrainer(model=tiny_model("llama"), args=args(tmp_path), eval_dataset=ev,
                      data_collator=FlatteningCollator(pad_to_multiple_of=64))
    with pytest.raises(ValueError, match="pad_to_multiple_of"): t.predict(ev)


# ---------------------------------------------------------------- check_trainer
class OnesMask(FlatteningCollator):
    "A collator that adds an all-ones attention_mask (as several drop-in recipes do)."
    def __call__(self, features, return_tensors=None):
        b = super().__call__(features)
        return {**b, "attention_mask": torch.ones_like(b["input_ids"])}


def test_check_trainer_flags_the_faults_and_passes_a_correct_setup(flan, tmp_path):
    ds, small = Dataset.from_list(flan[:N]), dict(per_device_train_batch_size=4)  # a smaller batch: a quicker doctor
    plain = lambda **kw: Trainer(model=tiny_model("llama").train(), args=args(tmp_path, **small, **kw.pop("a", {})),
                                 **kw)
    # the collator says it too, once
    with pytest.warns(UserWarning, match="Trainer's remove_unused_columns removed them"):
        dropped = check_trainer(plain(train_dataset=ds, data_collator=FlatteningCollator()), grads=False)
    assert not dropped.clean and "loss masks reach the collator" in dropped.failed()
    assert "prepare_dataset" in dropped["loss masks reach the collator"].fix
    cache = check_trainer(plain(train_dataset=prepare_dataset(ds), data_collator=FlatteningCollator(),
                                a=dict(use_cache=True)), grads=False)
    assert {"use_cache", "contamination probe"} <= set(cache.failed()), cache
    ones = check_trainer(plain(train_dataset=prepare_dataset(ds), data_collator=OnesMask()), grads=False)
    assert {"collator", "contamination probe"} <= set(ones.failed()), ones
    for t in (PackedTrainer(model=tiny_model("llama").train(), args=args(tmp_path, use_cache=True), train_dataset=ds,
                            max_tokens=512),
              plain(train_dataset=prepare_dataset(ds), data_collator=FlatteningCollator())):
        good = check_trainer(t)
        assert good.clean, good
        assert good.doctor.cross_example_effect == 0 and "fix" not in str(good).split("Packing doctor")[0]
        assert good._repr_markdown_().startswith("**Trainer check")


def test_check_trainer_on_other_collators(flan, tmp_path):
    "transformers' and TRL's padding-free collators pass; TRL's padding collator is not packed: a warning, no doctor."
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    ds = prepare_dataset(Dataset.from_list(flan[:N]))
    mk = lambda c: Trainer(model=tiny_model("llama").train(), args=args(tmp_path, per_device_train_batch_size=4),
                           train_dataset=ds, data_collator=c)
    for c in (DataCollatorWithFlattening(), DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)):
        r = check_trainer(mk(c), grads=False)
        assert r.clean and r.doctor.cross_example_effect == 0, r
    r = check_trainer(mk(DataCollatorForLanguageModeling(pad_token_id=0)), grads=False)
    assert r.clean and r["collator"].status == "warn" and r.doctor is None


def test_label_smoothing_packed_equals_padded(flan):
    "Trainer's LabelSmoother skips -100, and every packed example's first label is -100: packed == padded."
    from transformers.trainer_pt_utils import LabelSmoother
    from workbench.doctor import padded_twin
    model, smooth = tiny_model("llama"), LabelSmoother(epsilon=0.1)
    packed = FlatteningCollator(return_flash_attn_kwargs=False)([fold_example(f) for f in flan[:4]])
    padded = padded_twin(packed)
    with torch.no_grad():
        a = smooth(model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False), packed["labels"],
                   shift_labels=True)
        b = smooth(model(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False), padded["labels"],
                   shift_labels=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_check_trainer_reentrant_checkpointing_with_frozen_embeddings(flan, tmp_path):
    model = tiny_model("llama").train()
    model.get_input_embeddings().weight.requires_grad_(False)  # what PEFT does
    t = Trainer(model=model, train_dataset=prepare_dataset(Dataset.from_list(flan[:N])),
                data_collator=FlatteningCollator(),
                args=args(tmp_path, per_device_train_batch_size=4, activation_checkpointing=True,
                          activation_checkpointing_kwargs={"use_reentrant": True}))
    r = check_trainer(t, grads=False)
    assert (r["activation checkpointing"].status == "warn"
            and "use_reentrant': False" in r["activation checkpointing"].fix)


# ---------------------------------------------------------------- what users hand it
def test_prepare_dataset_inputs(flan):
    raw = [dict(f) for f in flan[:4]]
    want = [masked(f) for f in raw]
    ds = prepare_dataset(Dataset.from_list(raw))
    assert ds.column_names == ["input_ids", "labels"] and ds["labels"] == want
    assert prepare_dataset(ds) is ds  # idempotent
    assert [prepare_dataset(raw)[i]["labels"] for i in range(4)] == want  # list of dicts (lazy)
    stream = prepare_dataset(IterableDataset.from_generator(lambda: iter(raw)))
    assert [r["labels"] for r in stream] == want
    packed = prepare_dataset(Dataset.from_list([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}]))
    # both: one survives each trainer
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1] and packed[0]["seq_lengths"] == [3, 2]
    some = prepare_dataset(Dataset.from_list([{"input_ids": [1, 2], "completion_mask": [0, 1]}, {"input_ids": [3, 4]}]))
    assert some["labels"] == [[IGNORE_INDEX, 2], [3, 4]]  # a mask on some rows only: the others train every token
    with pytest.raises(ValueError, match="example 0: completion_mask has 1 entries"):
        prepare_dataset(Dataset.from_list([{"input_ids": [1, 2], "completion_mask": [1]}]))
    with pytest.raises(ValueError, match="seq_lengths"): fold_example({"input_ids": [1, 2], "seq_lengths": [3]})
    both = {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5],
            "completion_mask": [0, 0, 1, 1, 1]}
    for d in (Dataset.from_list([both]), [both]):  # labels and a mask: a token trains only if neither masks it
        assert prepare_dataset(d)[0]["labels"] == [IGNORE_INDEX, IGNORE_INDEX, 3, IGNORE_INDEX, 5]
    dd = prepare_dataset(DatasetDict(train=Dataset.from_list(raw), test=Dataset.from_list(raw[:2])))  # split by split
    assert isinstance(dd, DatasetDict) and dd["train"]["labels"] == want and dd["test"]["labels"] == want[:2]
    idd = prepare_dataset(IterableDatasetDict(train=Dataset.from_list(raw).to_iterable_dataset()))
    assert isinstance(idd, IterableDatasetDict) and [r["labels"] for r in idd["train"]] == want
    with pytest.raises(TypeError, match="cannot prepare"): prepare_dataset(42)
    assert (prepare_dataset(Dataset.from_list([{"prompt": "a", "completion": "b"}]))[0]
            == {"prompt": "a", "completion": "b"})


class TorchFeatures(torch.utils.data.Dataset):
    "A user's torch Dataset: tensors per item, and an index that wraps around (no IndexError ends a loop over it)."
    def __init__(self, features): self.features = features
    def __len__(self): return len(self.features)
    def __getitem__(self, i):
        f = self.features[i % len(self.features)]
        return {k: torch.tensor(v) for k, v in f.items()}


def one_row_each(raw): return Dataset.from_list([{k: [v] for k, v in f.items()} for f in raw])  # [1, T] rows


SOURCES = {"list of dicts": (list, 0), "torch Dataset": (TorchFeatures, 0), "[1,T] rows": (one_row_each, 0),
           "2 workers": (Dataset.from_list, 2)}  # how the data is handed over, dataloader_num_workers


@pytest.mark.parametrize("source", SOURCES)
def test_other_datasets_give_the_same_batches(flan, tmp_path, source):
    raw, (wrap, workers) = flan[:N], SOURCES[source]
    mk = lambda d, **kw: PackedTrainer(model=tiny_model("llama"), args=args(tmp_path, **kw), train_dataset=d,
                                       max_tokens=1024)
    want, got = mk(Dataset.from_list(raw)), mk(wrap(raw), dataloader_num_workers=workers)
    assert got.get_train_dataloader().num_workers == workers
    assert got.plan.bins and all((a == b).all() for a, b in zip(want.plan.bins, got.plan.bins))
    for a, b in zip(want.get_train_dataloader(), got.get_train_dataloader()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))


class NoLabelsLlama(LlamaForCausalLM):
    "A model whose forward names no labels: Trainer's column removal drops them."
    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)


class StrictLlama(LlamaForCausalLM):
    "A model whose forward has no **kwargs: it rejects the collator's varlen keys."
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               labels=labels, use_cache=use_cache)


def test_check_trainer_flags_varlen_keys_a_strict_forward_rejects(flan, tmp_path):
    torch.manual_seed(0)
    model = StrictLlama(tiny_config("llama")).train()
    ds = prepare_dataset(Dataset.from_list(flan[:N]))
    mk = lambda c: Trainer(model=model, args=args(tmp_path, per_device_train_batch_size=4), train_dataset=ds,
                           data_collator=c)
    r = check_trainer(mk(FlatteningCollator()), grads=False)
    assert r["forward takes the varlen keys"].fix == "FlatteningCollator(return_flash_attn_kwargs=False)"
    assert "model runs on the packed batch" in r.failed()  # the doctor's run meets the same TypeError
    assert check_trainer(mk(FlatteningCollator(return_flash_attn_kwargs=False)), grads=False).clean  # the fix works


def test_guard_refuses_removed_labels(flan, tmp_path):
    torch.manual_seed(0)
    model = NoLabelsLlama(tiny_config("llama")).train()
    ds = Dataset.from_list(flan[:N])
    t = PackedTrainer(model=model, args=args(tmp_path), train_dataset=ds)
    with pytest.raises(ValueError, match="label_names"): t.train()
    PackedTrainer(model=model, args=args(tmp_path, label_names=["labels"]), train_dataset=ds).train()  # the fix works


def test_overlong_and_streams(flan, tmp_path):
    ds = Dataset.from_list(flan[:N])
    longest = max(len(f["input_ids"]) for f in flan[:N])
    mk = lambda d, **kw: PackedTrainer(model=tiny_model("llama").train(), args=args(tmp_path), train_dataset=d, **kw)
    with pytest.raises(ValueError, match="overlong="): mk(ds, max_tokens=longest - 1)
    with pytest.warns(UserWarning, match=r"1 examples truncated, 0 split, 0 dropped \(1 tokens lost\) of 32"):
        t = mk(ds, max_tokens=longest - 1, overlong="truncate")
    assert t.plan.truncated == 1
    with pytest.raises(ValueError, match="overlong must be one of"): mk(ds, max_tokens=256, overlong="cut")
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        PackedTrainer(model=tiny_model("llama"), args=args(tmp_path, train_sampling_strategy="group_by_length"),
                      train_dataset=ds, max_tokens=1024)
    with pytest.raises(ValueError, match="pass a train_dataset"): mk(None, max_tokens=1024)
    t = PackedTrainer(model=tiny_model("llama"), args=args(tmp_path, per_device_train_batch_size=1), train_dataset=ds,
                      max_tokens=1024)
    # max_tokens rules: a step is a bin, not per_device_train_batch_size examples
    first = next(iter(t.get_train_dataloader()))
    assert len(first["cu_seq_lens_q"]) - 1 in {len(b)
                                               for b in t.plan.bins} - {1} and first["input_ids"].shape[1] <= 1024
    with pytest.warns(UserWarning, match="dataloader_num_workers=2 is not used for a streamed"):
        PackedTrainer(model=tiny_model("llama"), args=args(tmp_path, dataloader_num_workers=2),
                      train_dataset=ds.to_iterable_dataset(), max_tokens=1024)


def _raw_jsonl(tmp_path) -> str:
    "N FLAN-like prompt/completion rows as a JSON-lines file, untokenized."
    from workbench.samples import load_records
    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in load_records("flan_like")[:N]))
    return str(path)


def test_split_pieces_that_train_nothing_are_left_out(flan, tmp_path):
    """PackedTrainer plans, deals and streams with untrained='drop':
    every step it serves trains a token, and it says what it left out."""
    ds = Dataset.from_list(flan[:N])
    mk = lambda d, **kw: PackedTrainer(model=tiny_model("llama").train(), args=args(tmp_path), train_dataset=d,
                                       max_tokens=64, overlong="split", **kw)
    with pytest.warns(UserWarning, match=r"0 dropped \(0 tokens lost\) of 32; (\d+) pieces that "
                                         r"train no token left out \((\d+) tokens, untrained='drop'\)") as w:
        t = mk(ds)
    p = t.plan
    assert p.untrained > 0 and (f"; {p.untrained} pieces that train no token "
                                f"left out ({p.untrained_tokens} tokens") in str(w[-1].message)
    trains = lambda batch: bool((batch["labels"][0, 1:] != IGNORE_INDEX).any())
    assert p.bin_trained.min() >= 1 and all(trains(b) for b in t.get_train_dataloader())
    with pytest.warns(UserWarning): keep = mk(ds, untrained="keep")
    assert keep.plan.untrained == 0 and (keep.plan.bin_trained == 0).sum() > 0 and len(keep.plan.bins) > len(p.bins)
    with pytest.warns(UserWarning): cost = mk(ds, balance="cost")
    assert (cost.plan.untrained, len(cost.plan.bins)) == (p.untrained, len(p.bins))
    stream = mk(ds.to_iterable_dataset())
    assert all(trains(b) for b in stream.get_train_dataloader())
    assert (stream.stream.report.untrained, stream.stream.report.untrained_tokens) == (p.untrained, p.untrained_tokens)
    with pytest.raises(ValueError, match=r"untrained must be one of \('drop', 'keep'\)"): mk(ds, untrained="skip")


def test_packed_trainer_on_raw_prompt_completion_rows_trains_the_masked_loss(tmp_path):
    """Raw JSONL rows and a tokenizer: tokenized by load_features' own
    code, and the masked loss trained (padded reference, 1e-5)."""
    from workbench.samples import load_tokenizer
    path = _raw_jsonl(tmp_path)
    features = load_features(path)  # what `python -m workbench.train --data raw.jsonl` trains
    rec = Recorder()
    t = PackedTrainer(model=llama(), args=args(tmp_path), train_dataset=Dataset.from_json(path),
                      processing_class=load_tokenizer(), data_collator=rec)
    assert [r["input_ids"] for r in t.train_dataset] == [f["input_ids"] for f in features]
    # prompts masked, completions trained
    assert [r["labels"] for r in t.train_dataset] == [masked(f) for f in features]
    t.train()
    ref = reference(rec.batches[:STEPS], features, STEPS)
    assert len(losses(t)) == STEPS and max(abs(a - b) for a, b in zip(losses(t), ref)) <= 1e-5, (losses(t), ref)
    with pytest.raises(ValueError, match="raw prompt \\+ completion rows: pass the tokenizer as processing_class="):
        PackedTrainer(model=llama(), args=args(tmp_path), train_dataset=Dataset.from_json(path))


def test_sft_on_raw_rows_tokenizes_as_load_features(tmp_path):
    """PackedSFTTrainer: raw prompt/completion rows become load_features'
    features (not TRL's tokenization); the labels mask the prompt."""
    from workbench.samples import load_tokenizer
    path = _raw_jsonl(tmp_path)
    t = PackedSFTTrainer(model=tiny_model("llama"), args=args(tmp_path, SFTConfig),
                         train_dataset=Dataset.from_json(path), processing_class=load_tokenizer(), max_tokens=1024)
    features = load_features(path)
    assert [r["labels"] for r in t.train_dataset] == [masked(f) for f in features]
    by_ids = {tuple(r["input_ids"]): r["labels"] for r in t.train_dataset}
    batch = next(iter(t.get_train_dataloader()))
    cu, ids, labels = batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        want = by_ids[tuple(ids[a:b])]
        assert labels[a:b] == [IGNORE_INDEX] + want[1:] and IGNORE_INDEX in want[1:]  # the prompt masked
    with pytest.raises(ValueError, match="completion_only_loss=False asks to train the prompts too"):
        PackedSFTTrainer(model=tiny_model("llama"), args=args(tmp_path, SFTConfig, completion_only_loss=False),
                         train_dataset=Dataset.from_json(path), processing_class=load_tokenizer())


def test_sft_padding_free_flag_is_refused_with_the_reason(flan, tmp_path):
    from workbench.samples import load_tokenizer
    for flag in (dict(padding_free=True), dict(packing=True)):
        with pytest.raises(ValueError, match="padding-free by itself"):
            PackedSFTTrainer(model=tiny_model("llama"), args=args(tmp_path, SFTConfig, **flag),
                             train_dataset=Dataset.from_list(flan[:N]), processing_class=load_tokenizer())


def test_check_trainer_on_sft_and_padding_collators(flan, tmp_path):
    "A plain SFTTrainer with TRL's padding collator: the doctor is skipped with a warning that names the fix."
    from workbench.samples import load_tokenizer
    t = SFTTrainer(model=tiny_model("llama").train(), args=args(tmp_path, SFTConfig),
                   train_dataset=Dataset.from_list(flan[:N]), processing_class=load_tokenizer())
    r = check_trainer(t)
    assert r["collator"].status == "warn" and "FlatteningCollator" in r["collator"].fix and r.doctor is None
    assert r["use_cache"].status == "pass"  # TRL passes use_cache=False on every forward


# ---------------------------------------------------------------- adapters, epochs, eval in training, other setups
@pytest.mark.parametrize("kind,max_tokens", [("PackedTrainer", 1024), ("PackedSFTTrainer", None)])
def test_lora_equals_padded_reference(flan, tmp_path, kind, max_tokens):
    """A PeftModel (LoRA) with a PEFT recipe's use_cache=True: the padded reference of the same LoRA init (step 2's loss
    equal proves step 1's gradients of the adapters equal); check_trainer through it."""
    raw = flan[:N]
    t, got, steps = run(kind, raw, tmp_path, max_tokens, make=lora, use_cache=True)
    assert type(t.model).__name__ == "PeftModel" and t.model.config.use_cache
    np.testing.assert_allclose(got, reference(steps, raw, STEPS, t.args.learning_rate, make=lora), atol=1e-5, rtol=0)
    r = check_trainer(t, grads=False)
    assert r.clean and r.doctor.cross_example_effect == 0 and "PeftModel" in r["model"].detail, r
    # a plain Trainer on the same PeftModel and use_cache=True: the cache trap, seen through PeftModel
    if kind == "PackedTrainer":
        plain = Trainer(model=t.model, args=args(tmp_path, use_cache=True, per_device_train_batch_size=2),
                        train_dataset=t.train_dataset, data_collator=FlatteningCollator())
        assert {"use_cache", "contamination probe"} <= set(check_trainer(plain, grads=False).failed())


def test_epochs_reshuffle_and_eval_during_training(flan, tmp_path):
    """max_steps=-1 and 2 epochs of token-budget bins: every bin once per epoch, in a new order in epoch 2 (set_epoch);
    a dict of eval datasets evaluated during training (eval_strategy='steps') equals a padded evaluation."""
    ds, rec = Dataset.from_list(flan[:N // 2]), Recorder()
    k = len(plan_bins(ds, 1024, seed=42).bins)  # Trainer's default seed
    ev = {"a": Dataset.from_list(flan[N:N + 6]), "b": flan[N + 6:N + 12]}  # a datasets one and a list of dicts
    t = PackedTrainer(model=llama(),
                      args=args(tmp_path, max_steps=-1, num_train_epochs=2, eval_strategy="steps", eval_steps=2 * k),
                      train_dataset=ds, eval_dataset=ev, data_collator=rec, max_tokens=1024)
    t.train()
    assert t.state.global_step == 2 * k and t.state.epoch == 2 and len(losses(t)) == 2 * k
    epochs = [[frozenset(map(tuple, b)) for b in rec.batches[e * k:(e + 1) * k]] for e in (0, 1)]
    assert set(epochs[0]) == set(epochs[1]) and len(set(epochs[0])) == k and epochs[0] != epochs[1]
    # the final model's evals (a log each)
    logged = {key: v for h in t.state.log_history if h["step"] == 2 * k for key, v in h.items()}
    padded = Trainer(model=t.model, args=args(tmp_path), data_collator=PaddingCollator())
    for name, d in ev.items():
        # fp32: 2 ulp at 9
        assert abs(logged[f"eval_{name}_loss"] - padded.evaluate(prepare_dataset(d))["eval_loss"]) < 1e-5


def test_check_trainer_needs_a_train_dataset(flan, tmp_path):
    t = PackedTrainer(model=llama(), args=args(tmp_path), eval_dataset=Dataset.from_list(flan[:4]))
    with pytest.raises(ValueError, match="has no train_dataset"): check_trainer(t)


def test_check_trainer_on_trls_own_padding_free(flan, tmp_path):
    """TRL's own padding_free collator packs cleanly, but by default (completion_only_loss=None on token data) TRL's
    labels ignore a completion_mask: check_trainer fails it, measured on the rows; completion_only_loss=True passes."""
    from workbench.samples import load_tokenizer
    mk = lambda **kw: SFTTrainer(model=llama(), train_dataset=Dataset.from_list(flan[:N]),
                                 processing_class=load_tokenizer(),
                                 args=args(tmp_path, SFTConfig, padding_free=True, max_length=None,
                                           per_device_train_batch_size=4, **kw))
    r = check_trainer(mk(), grads=False)
    assert (r.failed() == ["loss masks reach the collator"]
            and "completion_only_loss=True" in r["loss masks reach the collator"].fix), r
    assert r.doctor.cross_example_effect == 0  # its packing is clean: only the labels are wrong
    good = check_trainer(mk(completion_only_loss=True), grads=False)
    assert good.clean and good["loss masks reach the collator"].status == "pass", good
    with pytest.raises(KeyError): good["prompt masked"]


def test_check_trainer_on_trls_own_packing(flan, tmp_path):
    """TRL's packing=True drops completion_mask after building labels:
    without completion_only_loss every token trains (a warning)."""
    from workbench.samples import load_tokenizer
    mk = lambda **kw: SFTTrainer(model=llama(), train_dataset=Dataset.from_list(flan[:N]),
                                 processing_class=load_tokenizer(),
                                 args=args(tmp_path, SFTConfig, packing=True, max_length=512,
                                           per_device_train_batch_size=2, **kw))
    r = check_trainer(mk(), grads=False)
    assert r.clean and r["prompt masked"].status == "warn" and "completion_only_loss=True" in r["prompt masked"].fix, r
    assert r.doctor.cross_example_effect == 0
    good = check_trainer(mk(completion_only_loss=True), grads=False)
    assert good.verdict == "clean", good


@pytest.mark.parametrize("attn,dtype",
                         [("eager", torch.float32), ("flex_attention", torch.float32), ("sdpa", torch.bfloat16)],
                         ids=["eager", "flex_attention", "sdpa-bf16"])
def test_check_trainer_attention_and_dtype(flan, tmp_path, attn, dtype):
    """grads=False: flex_attention has no backward on CPU (grads=True
    fails it, naming workbench_varlen); bf16 at bf16 tolerance."""
    t = PackedTrainer(model=tiny_model("llama", attn_implementation=attn, dtype=dtype).train(),
                      args=args(tmp_path, per_device_train_batch_size=2), train_dataset=Dataset.from_list(flan[:N]))
    r = check_trainer(t, grads=False)
    assert r.clean and r.doctor.cross_example_effect == 0 and repr(attn) in r["model"].detail, r
