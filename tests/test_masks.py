"""The drawn mask is the model's mask: `effective_mask` against
perturbation probes of real tiny models, for every layout and trap."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import workbench.attention  # noqa: F401 (registers "workbench_varlen" with transformers)
from workbench.samples import load_sample
from workbench.tiny_models import tiny_model
from workbench.masks import (MaskSpec, attention_leakage, effective_mask, evaluate, mask_report, off_diagonal,
                             probe_mask)
from workbench.packing import FlatteningCollator, NaiveConcatCollator, PaddingCollator


pytestmark = pytest.mark.usefixtures("one_thread")  # every test here probes with many tiny forwards (conftest.py)


@pytest.fixture(scope="module")
def features():
    """The three shortest shipped examples (18-23 tokens): each
    longer than Mistral's window of 16, and few tokens to probe."""
    feats = [f for f in load_sample("flan_like", limit=400) if 18 <= len(f["input_ids"]) <= 23]
    assert len(feats) == 3 and len({len(f["input_ids"]) for f in feats}) == 3  # ragged: the padded layouts pad
    return feats


def layouts(features):
    flat = FlatteningCollator()(features)
    padded_flat = FlatteningCollator(pad_to_multiple_of=32)(features)
    ones = {**flat, "attention_mask": torch.ones_like(flat["input_ids"])}
    return {"flattened": (flat, False), "flattened + dummy padding": (padded_flat, False),
            "trap: cache active": (flat, True), "trap: all-ones attention_mask": (ones, False),
            "trap: both": (ones, True), "naive concatenation": (NaiveConcatCollator()(features), False),
            "padded": (PaddingCollator()(features), False), "padded, cache on": (PaddingCollator()(features), True)}


MODELS = [("llama", "sdpa"), ("llama", "eager"), ("llama", "workbench_varlen"),
          ("mistral", "sdpa"), ("mistral", "eager"), ("mistral", "workbench_varlen")]


@pytest.mark.parametrize("family,impl", MODELS, ids=[f"{f}-{i}" for f, i in MODELS])
def test_effective_mask_matches_model(features, family, impl):
    model = tiny_model(family, attn_implementation=impl)
    window = getattr(model.config, "sliding_window", None)
    for name, (batch, cache) in layouts(features).items():
        drawn = effective_mask(batch, impl, use_cache=cache, sliding_window=window)
        seen = probe_mask(model, batch, use_cache=cache)
        wrong = np.argwhere(seen != off_diagonal(drawn))
        assert len(wrong) == 0, (f"{family}/{impl}/{name}: {len(wrong)} pairs "
                                 f"differ, first (row, q, kv) {wrong[:3].tolist()}")


def test_sliding_window_is_visible(features):
    "Mistral's window really cuts long examples (the probe would also pass if the window never mattered)."
    batch = FlatteningCollator()(features)
    full, windowed = effective_mask(batch), effective_mask(batch, sliding_window=16)
    assert (full & ~windowed).sum() > 0
    model = tiny_model("mistral", attn_implementation="sdpa")
    assert np.array_equal(probe_mask(model, batch), off_diagonal(windowed))


def test_traps_contaminate(features):
    lengths = [len(f["input_ids"]) for f in features]
    for name, (batch, cache) in layouts(features).items():
        r = mask_report(batch, lengths if name == "naive concatenation" else None, use_cache=cache)
        expected_leaky = name.startswith("trap") or name == "naive concatenation"
        assert (r.cross_pairs > 0) == expected_leaky, (name, r)


def test_leakage_mass(features):
    model = tiny_model("llama", attn_implementation="sdpa")
    batch = FlatteningCollator()(features)
    ones = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    assert attention_leakage(model, batch).max() == 0
    assert attention_leakage(model, PaddingCollator()(features)).max() == 0
    for leaky in (attention_leakage(model, batch, use_cache=True), attention_leakage(model, ones)):
        assert leaky.shape == (2, 4) and leaky.min() > 0.1
    # the leaked mass is read from the weights: zero exactly where the mask forbids, so it is bounded by the pairs
    assert model.config._attn_implementation == "sdpa"
    lengths = [len(f["input_ids"]) for f in features]
    example = np.repeat(np.arange(len(lengths)), lengths)
    cross = example[:, None] != example[None, :]  # [T, T]: query and key in different examples
    eager = tiny_model("llama", attn_implementation="eager")  # the same weights, its own eager forward
    for b, cache in ((batch, False), (batch, True), (ones, False)):
        inputs = {k: b[k] for k in ("input_ids", "position_ids", "attention_mask") if k in b}
        with torch.no_grad(): attentions = eager(**inputs, use_cache=cache, output_attentions=True).attentions
        weights = torch.stack([a[0] for a in attentions]).numpy()  # [layers, heads, T, T]
        allowed = effective_mask(b, "eager", use_cache=cache)[0]
        assert ((weights > 0) == allowed).all()  # zero exactly where the mask forbids
        per_query = (weights * cross).sum(-1)  # [layers, heads, T]: each query's mass on other examples
        leaks = (allowed & cross).any(-1)  # queries allowed to see another example
        assert (per_query[..., ~leaks] == 0).all()
        leakage = attention_leakage(model, b, use_cache=cache)
        assert np.abs(leakage - per_query.mean(-1)).max() <= 1e-6  # measured 1.2e-7: one float32 ulp of ~0.55
        assert (leakage <= leaks.mean()).all()  # bounded by the pairs: at most 1 per query that may leak



@pytest.mark.parametrize("config_cache", [True, False])
def test_use_cache_none_means_the_config_default(features, config_cache):
    "transformers reads use_cache=None as config.use_cache (True by default): the drawn mask must follow the model."
    model = tiny_model("llama", attn_implementation="sdpa", use_cache=config_cache)
    batch = FlatteningCollator()(features)
    drawn = effective_mask(batch, use_cache=None, config=model.config)
    assert np.array_equal(probe_mask(model, batch, use_cache=None), off_diagonal(drawn))
    assert np.array_equal(drawn, effective_mask(batch, use_cache=config_cache))
    assert (mask_report(batch, use_cache=None, config=model.config).cross_pairs > 0) == config_cache

@st.composite
def specs(draw):
    T = draw(st.integers(1, 40))
    seg = np.cumsum(draw(st.lists(st.booleans(), min_size=T, max_size=T)))[None]
    key_ok = np.array(draw(st.lists(st.booleans(), min_size=T, max_size=T)))[None]
    query_ok = np.array(draw(st.lists(st.booleans(), min_size=T, max_size=T)))[None]
    return MaskSpec(seg, key_ok, query_ok, draw(st.one_of(st.none(), st.integers(1, 12))),
                    empty_sees_all=draw(st.booleans()))


@settings(max_examples=200, deadline=None)
@given(specs(), specs(), st.integers(1, 9))
def test_block_counts_equal_dense(a, b, block):
    "The exact block aggregation (used for 32K-token views) equals summing the dense function grid."
    T = a.shape[1]
    if b.shape != a.shape: b = MaskSpec(np.zeros((1, T)), np.ones((1, T)), np.ones((1, T)))
    edges = np.r_[np.arange(0, T, block), T]
    a_only = MaskSpec(a.segment, a.key_ok, a.query_ok, a.window)  # without eager's see-all rows, so it intersects
    for spec in (a, a_only & MaskSpec(b.segment, b.key_ok, b.query_ok, b.window)):
        dense = evaluate(spec.function, 1, T)[0].astype(np.int64)
        by_block = np.add.reduceat(np.add.reduceat(dense, edges[:-1], 0), edges[:-1], 1)
        assert np.array_equal(spec.block_counts(edges, edges), by_block)
        assert spec.count() == dense.sum()
    b_only = MaskSpec(b.segment, b.key_ok, b.query_ok, b.window)
    assert np.array_equal((a_only & b_only).dense(), a_only.dense() & b_only.dense())
    if a.empty_sees_all:  # an active query with no allowed key sees every key of the row
        dense = a.dense()[0]
        rows = a.empty_queries()
        assert dense[rows].all() and (a_only.dense()[0][rows].sum() == 0)
