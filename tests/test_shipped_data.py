"The shipped data is found from the package, never from the working directory: a planted data_samples/ changes nothing."
import json
from pathlib import Path

import workbench
from workbench.samples import data_dir, load_tokenizer
from workbench.tiny_models import model_families, tiny_config


def test_planted_data_samples_in_a_parent_dir_is_ignored(tmp_path, monkeypatch):
    fake = tmp_path / "data_samples"
    (fake / "tokenizer").mkdir(parents=True)
    (fake / "tokenizer" / "tokenizer.json").write_text("{}")
    (fake / "configs" / "llama").mkdir(parents=True)
    (fake / "configs" / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 7}))
    (tmp_path / "project" / "notebooks").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "project" / "notebooks")  # the planted folder is two levels up
    shipped = Path(workbench.__file__).resolve().parent.parent / "data_samples"  # this checkout's (editable install)
    assert data_dir() == shipped and data_dir() != fake
    assert len(load_tokenizer()) == 8192 and tiny_config("llama").vocab_size == 8192
    assert len(model_families()) > 1  # the fake one ships only llama
