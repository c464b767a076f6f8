"""The mask explorer on anything (issue 15): the block rule against full-resolution masks, the legend, range clamping
and zoom through plotly's relayout path, your own model / tokenizer / data, and every bad input named with its fix."""
import numpy as np
import pytest
import torch

from workbench.samples import load_sample, load_tokenizer
from workbench.tiny_models import tiny_config
from workbench.masks import attention_leakage, mask_report
from workbench.packing import FlatteningCollator, NaiveConcatCollator, PaddingCollator
from workbench.sp.ranks import rank_view
from workbench.explorer import MaskExplorer, attention_kinds, explorer_data, explorer_model, explorer_tokenizer
from workbench.viz import (CATEGORIES, CATEGORY_COLORS, MASK_COLORSCALE, clamp_range, mask_blocks, mask_traces,
                           readable_tokens, view_edges)

TOK = load_tokenizer()
FEATS = load_sample("flan_like", TOK, limit=40)
LEAK, ALLOWED, PADDING, MASKED = (CATEGORIES.index(c) for c in ("leak", "allowed", "padding", "masked"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    "A random tiny Llama with its tokenizer, saved the way a user's model is (not a shipped sample)."
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("models") / "my-llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(d)
    TOK.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def dataset():
    import datasets
    texts = ["one two three four", "a much longer second example of text", "short", "the end\nof it"]
    return datasets.Dataset.from_dict({"input_ids": [TOK(t)["input_ids"] for t in texts], "text": texts})


# --- the block rule ------------------------------------------------------------------------------------------------
def dense_codes(report, row):
    "Every pair's category from the dense masks: leak (allowed, not meant, real), allowed (meant), padding, masked."
    eff, meant = report.effective.dense()[row], (report.effective & report.intended).dense()[row]
    real = report.examples[row] >= 0
    pad = ~(real[:, None] & real[None, :])
    return np.select([eff & ~meant & ~pad, meant, pad], [LEAK, ALLOWED, PADDING], MASKED)


def rule(cells):
    "A block shows the first category present among leak, allowed, padding; masked only when every pair is."
    return next((c for c in (LEAK, ALLOWED, PADDING) if (cells == c).any()), MASKED)


REPORTS = {
    "padded sdpa": lambda: (mask_report(PaddingCollator()(FEATS[:4])), 2),
    "padded flash": lambda: (mask_report(PaddingCollator()(FEATS[:4]), attn_implementation="flash_attention_2"), 1),
    "padded eager": lambda: (mask_report(PaddingCollator()(FEATS[:4]), attn_implementation="eager", sliding_window=8),
                             3),
    "naive": lambda: (mask_report(*[NaiveConcatCollator()(FEATS[:4]), [len(f["input_ids"]) for f in FEATS[:4]]]), 0),
    "cache trap window": lambda: (mask_report(FlatteningCollator()(FEATS[:4]), use_cache=True, sliding_window=16), 0),
    "flattened padded to 64": lambda: (mask_report(FlatteningCollator(pad_to_multiple_of=64)(FEATS[:3])), 0),
}


@pytest.mark.parametrize("name", REPORTS)
def test_block_rule_matches_full_resolution(name):
    report, row = REPORTS[name]()
    T, dense = report.examples.shape[1], dense_codes(report, row)
    assert (mask_blocks(report, np.arange(T + 1), np.arange(T + 1), row)[0] == dense).all()
    rng = np.random.default_rng(1)
    for _ in range(20):
        eq = np.unique(rng.integers(0, T + 1, rng.integers(2, 9)))
        ek = np.unique(rng.integers(0, T + 1, rng.integers(2, 9)))
        if len(eq) < 2 or len(ek) < 2: continue
        code, n = mask_blocks(report, eq, ek, row)
        for i in range(len(eq) - 1):
            for j in range(len(ek) - 1):
                cells = dense[eq[i]:eq[i + 1], ek[j]:ek[j + 1]]
                assert code[i, j] == rule(cells), (name, eq, ek, i, j)
                assert (n["leak"][i, j], n["allowed"][i, j], n["padding"][i, j]) == \
                       ((cells == LEAK).sum(), (cells == ALLOWED).sum(), (cells == PADDING).sum())


def test_one_leaking_pair_makes_the_block_a_leak():
    "Naive concatenation of a 1-token example after a long one: a single leaking pair per query block."
    feats = [{"input_ids": list(range(1, 300))}, {"input_ids": [7]}]
    batch = NaiveConcatCollator()(feats)
    report = mask_report(batch, [299, 1])
    code, n = mask_blocks(report, np.array([0, 299, 300]), np.array([0, 150, 300]))
    assert n["leak"][1].tolist() == [150, 149] and code[1].tolist() == [LEAK, LEAK]
    assert report.cross_pairs == 299


def test_legend_is_four_named_categories():
    short = int(np.argmin([len(f["input_ids"]) for f in FEATS[:3]]))
    heat = mask_traces(mask_report(PaddingCollator()(FEATS[:3])), row=short)[0]
    assert set(CATEGORIES) == {"allowed", "masked", "leak", "padding"}
    assert heat["colorbar"]["ticktext"] == list(CATEGORIES) and heat["colorbar"]["tickvals"] == [0, 1, 2, 3]
    for code, color in enumerate(CATEGORY_COLORS):  # each code's normalised z falls inside a flat stretch of its colour
        z = (code - heat["zmin"]) / (heat["zmax"] - heat["zmin"])
        flat = [(a, b) for (a, ca), (b, cb) in zip(MASK_COLORSCALE, MASK_COLORSCALE[1:]) if ca == cb == color]
        assert any(a < z - 0.1 and z + 0.1 < b for a, b in flat), (code, z, flat)
    assert PADDING in heat["z"] and LEAK not in heat["z"]  # a padded row's padding is padding, never "allowed"


# --- ranges and zoom -----------------------------------------------------------------------------------------------
def test_clamp_range_stays_inside_the_row():
    rng = np.random.default_rng(0)
    for _ in range(500):
        T = int(rng.integers(1, 5000))
        a, b = rng.uniform(-2 * T, 3 * T, 2)
        lo, hi = clamp_range((a, b), T)
        assert 0 <= lo < hi <= T
        if 0 <= min(a, b) and max(a, b) <= T and max(a, b) - min(a, b) >= 1: assert lo <= min(a, b) and hi >= max(a, b)
    assert clamp_range((3.5, 3.6), 10) == (3, 4) and clamp_range(None, 7) == (0, 7)


def test_view_edges_never_exceed_max_cells():
    for lo, hi in [(0, 16384), (5, 6), (100, 357), (0, 129)]:
        e = view_edges(lo, hi, 128)
        assert e[0] == lo and e[-1] == hi and len(e) - 1 <= 128 and (np.diff(e) > 0).all()
    assert (np.diff(view_edges(1000, 1128, 128)) == 1).all()


def test_zoom_through_plotly_relayout_reaches_single_tokens(dataset):
    "The page's box zoom arrives as relayout event data; past the edge it is clamped; single tokens carry their text."
    ex = MaskExplorer(data=dataset, tokenizer=TOK, use_cache=True, max_cells=32)
    T = ex.report.examples.shape[1]
    fig = ex.mask_fig
    assert np.asarray(fig.data[0].z).shape[0] <= 32
    ex.mask_view.relayout = {"xaxis.range[0]": -40.0, "xaxis.range[1]": 12.3, "yaxis.range[0]": 15.2,
                             "yaxis.range[1]": -9.0}
    assert fig.layout.yaxis.range == (16, 0) and fig.layout.xaxis.range == (0, 13)
    assert np.asarray(fig.data[0].z).shape == (16, 13)
    ids = dataset[0]["input_ids"]
    assert list(fig.layout.xaxis.ticktext[:len(ids)]) == readable_tokens(ids, TOK)
    assert all("Ġ" not in t and "Ċ" not in t for t in fig.layout.xaxis.ticktext)
    assert fig.data[0].text[len(ids)][0].endswith("leak")  # example 1's first token reads example 0 (cache trap)
    assert ex.mask_view.figure["layout"]["xaxis"]["range"] == [0, 13]  # what the page draws follows
    ex.mask_view.relayout = {"xaxis.autorange": True, "yaxis.autorange": True}  # double-click: back to the whole row
    assert fig.layout.yaxis.range == (T, 0) and len(fig.layout.xaxis.ticktext) == T  # 17 tokens: all named


def test_long_row_outlines_only_visible_examples():
    ex = MaskExplorer(strategy="token-budget packing", size=16384)
    ex.controls["step"].value = 5  # 129 examples in 16K tokens
    T, starts = ex.report.examples.shape[1], np.flatnonzero(np.diff(ex.report.examples[0])) + 1
    sides = lambda: int(np.isnan(np.asarray(ex.mask_fig.data[1].x, float)).sum())
    block = -(-T // ex.max_cells)
    lengths = np.diff(np.r_[0, starts, T])
    assert len(lengths) == 129 and sides() == 4 * int((lengths >= 2 * block).sum()) == 0  # ~127-token examples: no mesh
    ex.zoom((0, 1024), (0, 1024))  # 8-token cells: every example in view is outlined, each side inside the view once
    inside = int(((np.r_[0, starts] < 1024)).sum())
    assert 2 * inside <= sides() <= 4 * inside, (sides(), inside)
    b = int(starts[len(starts) // 2])
    ex.zoom((b - 20, b + 20), (b - 20, b + 20))
    assert np.asarray(ex.mask_fig.data[0].z).shape == (40, 40) and sides() >= 2  # both sides of the boundary in view


# --- your own model, tokenizer and data ----------------------------------------------------------------------------
def test_explorer_on_a_model_dir_and_a_dataset(model_dir, dataset):
    ex = MaskExplorer(model=model_dir, data=dataset, size=4)
    assert ex.state["sample"] == "your data" and ex.state["family"] == "my-llama (full attention)"
    assert ex.report.stats()["examples"] == 4 and ex.report.cross_pairs == 0
    ex.controls["ones_mask"].value = True
    model = explorer_model(model_dir)[2]()
    mass = attention_leakage(model, ex.batch)
    assert ex.leaked_mass() == f"{mass.mean():.1%} mean, {mass.max():.1%} worst head"  # measured with *this* model
    ex.controls["strategy"].value = "padded"
    assert ex.report.examples.shape[0] == 4 and ex.controls["row"].max == 3


def test_explorer_on_a_model_object_with_alternating_layers():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(tiny_config("gemma2"), attn_implementation="eager").eval()
    ex = MaskExplorer(model=model, data=FEATS[:6])
    assert ex.state["attn_implementation"] == "eager"  # the model's own implementation is the default
    labels = ex.controls["family"].options
    assert labels[:2] == ("Gemma2ForCausalLM (sliding window 16)", "Gemma2ForCausalLM (full attention)")
    assert ex.report.effective.window == 16
    ex.controls["family"].value = labels[1]
    assert ex.report.effective.window is None
    assert attention_kinds(tiny_config("qwen2")) == {"full attention": None}  # sliding_window set but switched off


def test_explorer_on_one_padded_tokenizer_batch():
    "A tokenizer's padded batch (a BatchEncoding with an attention_mask) is drawn as the model reads it."
    enc = TOK(["a short one", "a rather longer example here"], padding=True, return_tensors="pt")
    ex = MaskExplorer(data=enc, tokenizer=TOK)
    assert all(ex.controls[k].disabled for k in ("strategy", "size", "step"))
    assert ex.controls["row"].max == 1
    ex.controls["row"].value = 0
    assert PADDING in np.asarray(ex.mask_fig.data[0].z) and ex.report.cross_pairs == 0


def test_packed_batch_with_an_attention_mask_shows_the_trap():
    batch = FlatteningCollator()(FEATS[:3])
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    ex = MaskExplorer(data=batch)
    assert ex.report.cross_pairs > 0 and "attention_mask given" in ex.report.effective.path
    assert LEAK in np.asarray(ex.mask_fig.data[0].z)


def test_shipped_choices_still_work_beside_yours(dataset):
    ex = MaskExplorer(data=dataset, tokenizer=TOK)
    ex.controls["sample"].value = "orca_like"
    assert not ex.controls["strategy"].disabled and ex.report.stats()["examples"] == 8
    ex.controls["family"].value = "mistral (sliding window 16)"
    assert ex.report.effective.window == 16


def test_the_rank_view_offers_the_gather():
    ex = MaskExplorer(processes="Ulysses 2 x gather 2")  # llama, a flattened row of 8 examples
    view, note = ex.rank_view()
    row = {k: v for k, v in ex.batch.items() if k != "attention_mask"}
    assert view.table.equals(rank_view(row, 2, 1, "balanced", tiny_config("llama"), gather=2).table), note
    assert ex.ranks_table.value.count("<tr>") == 1 + 4  # the header and one row per process, on the page
    assert "data-col='gather bytes'" in ex.ranks_table.value and "pairs skipped" not in ex.ranks_table.value

# --- bad input: a clear error naming what is wrong and the fix -----------------------------------------------------
def bad_inputs(tmp_path):
    import datasets
    (tmp_path / "empty").mkdir()
    return {
        "dataset without input_ids": (dict(data=datasets.Dataset.from_dict({"words": ["hi"]})), ValueError,
                                      "no 'input_ids' column"),
        "empty dataset": (dict(data=datasets.Dataset.from_dict({"input_ids": []})), ValueError, "dataset is empty"),
        "dataset of text ids": (dict(data=datasets.Dataset.from_dict({"input_ids": ["not ids"]})), TypeError,
                                "not token lists"),
        "streaming dataset": (dict(data=datasets.Dataset.from_dict({"input_ids": [[1]]}).to_iterable_dataset()),
                              TypeError, "materialise"),
        "empty list": (dict(data=[]), ValueError, "empty list"),
        "example without input_ids": (dict(data=[{"input_ids": [1, 2]}, {"text": "x"}]), ValueError,
                                      "example 1 has no 'input_ids'"),
        "empty example": (dict(data=[{"input_ids": []}]), ValueError, "example 0 is empty"),
        "float ids": (dict(data=[{"input_ids": torch.rand(5)}]), ValueError, "must hold integers"),
        "negative id": (dict(data=[{"input_ids": [3, -1]}]), ValueError, "negative token id"),
        "ids past the tokenizer": (dict(data=[{"input_ids": [3, 9000]}], tokenizer=TOK), ValueError,
                                   "token id 9000, but the vocabulary has 8192"),
        "1-D batch": (dict(data={"input_ids": torch.arange(5)}), ValueError, "one batch is [B, T]"),
        "ragged batch": (dict(data={"input_ids": [[1, 2], [3]]}), ValueError, "ragged"),
        "batch mask of another shape": (dict(data={"input_ids": torch.ones(1, 4, dtype=torch.long),
                                                   "attention_mask": torch.ones(1, 3)}), ValueError,
                                        "attention_mask has shape [1, 3]"),
        "batch of no tokens": (dict(data={"input_ids": torch.zeros(1, 0, dtype=torch.long)}), ValueError,
                               "input_ids are empty"),
        "float batch": (dict(data={"input_ids": torch.rand(1, 4)}), ValueError, "cast token ids to int64"),
        "batch without input_ids": (dict(data={"labels": torch.ones(1, 3)}), ValueError, "has no input_ids"),
        "a path that is no file": (dict(data="my_dataset.jsonl"), ValueError, "is neither a shipped sample"),
        "a number as data": (dict(data=3), TypeError, "pass a file's path, a datasets.Dataset"),
        "model path that does not exist": (dict(model=tmp_path / "nope"), ValueError, "is not a directory"),
        "model dir without config.json": (dict(model=tmp_path / "empty"), ValueError, "has no config.json"),
        "model that is not a model": (dict(model=object()), TypeError, "pass a transformers model"),
        "tokenizer dir without files": (dict(tokenizer=tmp_path / "empty"), ValueError, "no tokenizer could be loaded"),
        "tokenizer that is not one": (dict(tokenizer=42), TypeError, "pass a transformers tokenizer"),
        "data named like a sample": (dict(data=[{"input_ids": [1, 2]}], data_name="flan_like"), ValueError,
                                     "choose another"),
        "unknown model name": (dict(family="gpt5"), ValueError, "unknown model 'gpt5'"),
    }


def test_every_bad_input_is_named_with_its_fix(tmp_path, capsys):
    for name, (kw, err, words) in bad_inputs(tmp_path).items():
        with pytest.raises(err) as e: MaskExplorer(**kw)
        assert words in str(e.value), (name, str(e.value))


def test_ids_past_the_models_vocabulary(model_dir):
    with pytest.raises(ValueError, match="token id 8200, but the vocabulary has 8192"):
        MaskExplorer(model=model_dir, tokenizer=None, data=[{"input_ids": [1, 8200]}])


def test_layers_the_explorer_cannot_draw_are_refused():
    cfg = tiny_config("llama")
    cfg.layer_types = ["linear_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="full and sliding-window attention only"): attention_kinds(cfg)


def test_tokenizer_comes_from_the_model_dir(model_dir):
    assert explorer_tokenizer(None, model_dir).convert_ids_to_tokens([300]) == TOK.convert_ids_to_tokens([300])
    assert explorer_tokenizer(None, None) is None and explorer_data([{"input_ids": [1]}]) == [{"input_ids": [1]}]
