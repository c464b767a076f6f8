"""A user's own rows (issue 47, "data"): token-id files keep the masks that say what trains, in every format and every
reader (load_features, run_features, a Dataset's plan, the mask explorer); a bad mask is refused with its row."""
import json

import pytest
from datasets import Dataset

from workbench.config import TrainConfig
from workbench.samples import load_tokenizer
from workbench.data import check_token_ids, load_features, run_examples, run_features
from workbench.packing import FlatteningCollator, plan_bins

ROWS = [{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
        {"input_ids": [9, 8, 7, 6], "completion_mask": [0, 0, 0, 1]}]
NAMED = 6  # the ones of the masks: every first token is masked, so each is a trained target


def _write(path, rows):
    "`rows` as a JSON-lines, JSON or Parquet file, by the suffix of `path`."
    if path.suffix == ".jsonl": path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json": path.write_text(json.dumps(rows))
    else: Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _trained(features) -> int:
    "Targets the collator trains on `features` (training's collator: train_all_tokens, the reader decided the masks)."
    return int((FlatteningCollator(train_all_tokens=True)(features)["labels"] != -100).sum())


def _labels(r: dict) -> list[int]: return [t if m else -100 for t, m in zip(r["input_ids"], r["completion_mask"])]


VARIANTS = {"completion_mask": ROWS,
            "completion_mask as strings": [{**r, "completion_mask": [*map(str, r["completion_mask"])]} for r in ROWS],
            "assistant_masks": [{"input_ids": r["input_ids"], "assistant_masks": r["completion_mask"]} for r in ROWS],
            "labels": [{"input_ids": r["input_ids"], "labels": _labels(r)} for r in ROWS]}


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_token_id_rows_keep_their_masks_in_every_format(tmp_path, suffix, variant):
    path = _write(tmp_path / f"rows.{suffix}", VARIANTS[variant])
    features = load_features(path)
    column = next(c for c in VARIANTS[variant][0] if c != "input_ids")
    assert [sorted(f) for f in features] == [sorted(["input_ids", column])] * len(ROWS)
    assert _trained(features) == NAMED  # was 9: every token but each row's first, prompts included
    assert int(plan_bins(features, 16).trained.sum()) == NAMED
    assert run_features(TrainConfig(data=path))[0] == features  # the CLI's and evaluation's reader


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_each_rows_own_id_comes_back_beside_its_features_in_every_format(tmp_path, suffix):
    """The first of id/uid/uuid/example_id the rows carry comes back from the read that tokenized them, beside the
    features (which stay those of the rows without it: collators and the planner never see it); a row without one:
    None."""
    rows = [{"example_id": f"ex-{i}", **r} for i, r in enumerate(ROWS)]
    rows[1]["example_id"] = None  # a row without an id of its own
    features, _, ids = run_examples(TrainConfig(model="llama", data=_write(tmp_path / f"rows.{suffix}", rows)))
    assert features == load_features(_write(tmp_path / f"plain.{suffix}", ROWS))
    assert ids == {"example_id": ["ex-0", None, "ex-2"]}
    assert run_examples(TrainConfig(model="llama", data="orca_like"))[2] == {}  # a shipped sample carries none


def test_a_dataset_of_string_masks_is_refused_by_the_plan_not_read_as_all_ones():
    "Arrow's fast path compared the strings '0' / '1' with 0: every token counted as trained. Now the row is named."
    ds = Dataset.from_list(VARIANTS["completion_mask as strings"])
    with pytest.raises(ValueError, match="example 0: completion_mask must hold integers"): plan_bins(ds, 16)
    assert int(plan_bins(Dataset.from_list(ROWS), 16).trained.sum()) == NAMED  # integer masks: read in Arrow


BAD = {  # name: (rows, words of the error)
    "labels longer than input_ids": ([{"input_ids": [1, 2], "labels": [-100, 2]},
                                      {"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4]}],
                                     "row 2: labels has 4 values but input_ids has 3 tokens"),
    "a mask shorter": ([ROWS[0], {"input_ids": [1, 2, 3], "completion_mask": [0, 1]}],
                       "row 2: completion_mask has 2 values but input_ids has 3 tokens"),
    "a mask value of 2": ([ROWS[0], {"input_ids": [1, 2, 3], "completion_mask": [0, 2, 1]}],
                          "row 2: completion_mask holds 2 at token 1"),
    "a mask string 'yes'": ([ROWS[0], {"input_ids": [1, 2, 3], "completion_mask": ["0", "yes", "1"]}],
                            "row 2: completion_mask holds 'yes' at token 1"),
    "a negative label": ([{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [1, 2], "labels": [-100, -5]}],
                         "row 2: labels holds -5 at token 1: each value must be -100 (not trained) or a token id"),
    "a mask on some rows only": ([ROWS[0], {"input_ids": [1, 2, 3]}],
                                 "row 2: no completion_mask, which other rows have"),
    "a mask beside text": ([{"prompt": "a", "completion": "b", "completion_mask": [0, 1]}],
                           "a per-token column cannot align"),
    "ids as a CSV cell": (None, "row 1: input_ids is the text '[1, 2, 3]', not a list of token ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_mask_is_refused_with_its_row(tmp_path, case):
    rows, words = BAD[case]
    if rows is None:
        path = tmp_path / "ids.csv"
        path.write_text('input_ids,completion_mask\n"[1, 2, 3]","[0, 1, 1]"\n')
    else: path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as e: load_features(str(path))
    assert words in str(e.value), str(e.value)


def test_a_parquet_row_is_named_too(tmp_path):
    path = _write(tmp_path / "bad.parquet", [ROWS[0], {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1, 1]}])
    with pytest.raises(ValueError, match="row 2: completion_mask has 4 values but input_ids has 3 tokens"):
        load_features(path)


def test_a_label_outside_the_vocabulary_is_refused():
    check_token_ids([{"input_ids": [1, 2], "labels": [-100, 2]}], 8, "d")
    with pytest.raises(ValueError, match="d row 1: label 9 is outside the model's vocabulary of 8"):
        check_token_ids([{"input_ids": [1, 2], "labels": [-100, 9]}], 8, "d")


# --- the mask explorer reads a user's data as training does --------------------------------------------------------
def test_the_explorer_reads_a_chat_file_as_training_does(tmp_path):
    from workbench.explorer import MaskExplorer, explorer_data
    turn = lambda role, content: {"role": role, "content": content}
    convs = [[turn("system", "Be brief."), turn("user", "What is 2 + 2?"), turn("assistant", "4.")],
             [turn("user", "Name a colour."), turn("assistant", "Blue."), turn("user", "Another?"),
              turn("assistant", "Red.")]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    trained, _ = run_features(TrainConfig(data=str(path)))  # what `python -m workbench.train --data chat.jsonl` reads
    ex = MaskExplorer(data=str(path), size=2)  # refused before: "data is a str: pass a datasets.Dataset..."
    assert ex._sources["your data"][0] == trained
    tok = load_tokenizer()
    for data in (path, Dataset.from_json(str(path)), [{"messages": c} for c in convs]):  # refused before too
        assert explorer_data(data, tokenizer=tok) == trained, type(data)
    batch = ex.batch
    assert batch["input_ids"][0].tolist() == [t for f in trained for t in f["input_ids"]]
    answers = sum(len(tok(t["content"], add_special_tokens=False)["input_ids"]) + 1  # each turn's tokens and its </s>
                  for c in convs for t in c if t["role"] == "assistant")
    assert int((batch["labels"] != -100).sum()) == answers  # only the assistant turns train, as in training


def test_the_explorer_names_a_missing_tokenizer_for_text(tmp_path):
    from workbench.explorer import explorer_data
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="holds text and no tokenizer was given: pass tokenizer="): explorer_data(path)
    with pytest.raises(ValueError, match="rows of messages and no tokenizer was given"):
        explorer_data([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps(ROWS[0]) + "\n")
    assert explorer_data(ids) == [ROWS[0]]  # token ids need no tokenizer, and keep their mask
