"""workbench.train from the command line: one step of every shipped family
(sdpa and workbench_varlen), and a clear error for every misuse."""
import contextlib
import io
import json

import pytest

from workbench.tiny_models import model_families
from workbench.doctor import KNOWN_LIMITS
from workbench.train import main

# the (family, attention) pairs the model itself cannot run, and the words of the refusal each gets (the family
# matrix's)
REFUSED = {cell: words for cell, words in KNOWN_LIMITS.items() if cell[1] in ("sdpa", "workbench_varlen")}


def _main(*argv) -> tuple[list | None, str, str]:
    "Run the CLI in-process: (losses or None, stdout, the usage error or the failing rank's error)."
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main(list(argv)), out.getvalue(), ""
    except SystemExit as e:
        assert e.code == 2, (e.code, err.getvalue())
        return None, out.getvalue(), err.getvalue().strip().splitlines()[-1]
    except RuntimeError as e: return None, out.getvalue(), str(e)  # a rank's own error (RankError)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1 + i, 40 + 3 * i))}) + "\n" for i in range(8)))
    return str(path)


@pytest.mark.parametrize("attn", ["sdpa", "workbench_varlen"])
@pytest.mark.parametrize("family", model_families())
def test_one_step_of_every_family(tmp_path, tiny_data, family, attn):
    losses, printed, error = _main("--model", family, "--attn", attn, "--steps", "1", "--max-tokens", "64",
                                   "--data", tiny_data, "--out", str(tmp_path))
    if (family, attn) in REFUSED:
        assert losses is None and REFUSED[family, attn] in error, error
        return
    assert losses is not None, error
    assert len(losses) == 1 and 0 < losses[0] < 20, losses
    readout = [l for l in printed.splitlines() if "memory readout" in l or "expected per-rank peak" in l]
    assert len(readout) == 1, printed  # the planner's peak, or one line saying why there is none


def test_the_gpu_long_preset_trains_a_step(tmp_path):
    "--preset gpu-long (workbench_varlen, checkpointing, tiled loss) with a short row, on the CPU fallback."
    losses, printed, error = _main("--preset", "gpu-long", "--steps", "1", "--max-tokens", "1024", "--out",
                                   str(tmp_path))
    assert losses is not None and len(losses) == 1 and 0 < losses[0] < 20, error


def test_workbench_varlen_needs_no_import_first():
    """A fresh interpreter that never imported workbench.attention can
    still name the key (and import workbench has no side effect)."""
    import subprocess, sys
    code = ("import sys, workbench; assert 'workbench.attention' not in sys.modules and 'transformers' "
            "not in sys.modules\nfrom workbench.sp.ulysses import register_ulysses; assert "
            "'workbench.attention' not in sys.modules\nprint(register_ulysses('workbench_varlen'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ulysses_workbench_varlen", r.stderr[-2000:]


def test_resume_refuses_data_that_changed_under_the_same_name(tmp_path, tiny_data):
    data = tmp_path / "ids.jsonl"
    data.write_text(open(tiny_data).read())
    args = ["--steps", "2", "--max-tokens", "64", "--data", str(data), "--out", str(tmp_path / "run")]
    assert _main(*args)[0] is not None
    data.write_text(open(tiny_data).read() + json.dumps({"input_ids": list(range(1, 60))}) + "\n")
    losses, _, error = _main(*args[:1], "4", *args[2:], "--resume")
    assert losses is None and "packs differently" in error, error


def test_gemma2_trains_with_the_attention_its_refusals_name(tmp_path, tiny_data):
    losses, _, error = _main("--model", "gemma2", "--attn", "eager", "--steps", "1", "--max-tokens", "64",
                             "--data", tiny_data, "--out", str(tmp_path))
    assert losses is not None and 0 < losses[0] < 20, error


def test_a_chat_file_trains_only_its_assistant_turns(tmp_path):
    """--data chat.jsonl: messages rendered with the shipped chat
    template; the step's trained tokens are the assistant turns'."""
    from workbench.samples import load_tokenizer
    from workbench.tracking import read_metrics
    turn = lambda role, content: {"role": role, "content": content}
    convs = [[turn("system", "Be brief."), turn("user", "What is 2 + 2?"), turn("assistant", "4.")],
             [turn("user", "Name a colour."), turn("assistant", "Blue."), turn("user", "Another?"),
              turn("assistant", "Red.")]]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    losses, _, error = _main("--steps", "1", "--max-tokens", "256", "--data", str(data), "--out", str(tmp_path / "run"))
    assert losses is not None and 0 < losses[0] < 20, error
    tok = load_tokenizer()
    answers = sum(len(tok(t["content"], add_special_tokens=False)["input_ids"]) + 1
                  for c in convs for t in c if t["role"] == "assistant")
    assert [r["trained"] for r in read_metrics(tmp_path / "run")] == [answers]  # both conversations fit one row


def test_a_token_id_file_trains_what_its_masks_name(tmp_path):
    """Issue 47: --data of token-id rows with completion_mask trained every token (the masks were dropped); now the
    masks'."""
    from workbench.tracking import read_metrics
    rows = [{"input_ids": list(range(10 + i, 40 + 2 * i)), "completion_mask": [0] * 20 + [1] * (10 + i)}
            for i in range(4)]
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses, _, error = _main("--steps", "1", "--max-tokens", "256", "--data", str(data), "--out", str(tmp_path / "run"))
    assert losses is not None, error
    assert ([r["trained"] for r in read_metrics(tmp_path / "run")]
            == [sum(map(sum, (r["completion_mask"] for r in rows)))])


def test_reading_a_data_file_draws_no_third_party_bar(tmp_path, capfd):
    "datasets draws 'Generating train split' while it reads a file: --data and --eval-data files are read without it."
    from workbench.data import load_features
    (tmp_path / "t.jsonl").write_text('{"text": "a fresh file, so datasets generates its split"}\n')
    assert len(load_features(str(tmp_path / "t.jsonl"))) == 1
    out, err = capfd.readouterr()
    assert "Generating" not in out + err, out + err


def test_load_features_names_the_row_in_every_json_shape(tmp_path):
    "A JSON array, blank lines, an empty CSV cell, booleans for ids: each read or named by its row or line."
    from workbench.data import load_features
    cases = {"arr.json": (json.dumps([{"text": "a"}, 5]), "arr.json row 2: a JSON object is needed, got int"),
             "broken.json": ('[{"text": "a"},\n {"text": "b"\n]', "broken.json line 3: not valid JSON"),
             "gaps.jsonl": ('{"text": "a"}\n\n{"text": 1}\n', "gaps.jsonl row 2: text must be strings"),
             "cells.csv": ("prompt,completion\nhi,there\nyo,\n", "row 2: row 1 has prompt + completion, "
                                                                 "row 2 has columns ['prompt']"),
             "bools.jsonl": ('{"input_ids": [true, false]}\n', "row 1: input_ids must be a "
                                                               "non-empty list of integer token ids")}
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError) as e: load_features(str(tmp_path / name))
        assert words in str(e.value), (name, str(e.value))
    (tmp_path / "ok.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert len(load_features(str(tmp_path / "ok.jsonl"))) == 2


def _word_tokenizer(rows: list[dict]):
    """A whitespace word-level tokenizer over the words of `rows`, ids in reverse
    order of first appearance: no id means what the shipped one's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = list(dict.fromkeys(w for r in rows for w in (r["prompt"] + " " + r["completion"]).split()))
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3}
    for i, w in enumerate(reversed(words)): vocab[w] = 4 + i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def test_a_model_directory_trains_with_its_own_tokenizer_and_saves_it(tmp_path):
    """--model DIR: DIR's tokenizer (a vocabulary unlike the shipped one)
    tokenizes the data and is the checkpoint's; a DIR without one is refused."""
    from transformers import AutoTokenizer
    from workbench.samples import load_records, load_tokenizer, tokenize_records
    from workbench.tiny_models import tiny_config
    from workbench.checkpoint import latest_checkpoint, MODEL_DIR
    from workbench.config import _config, _parser
    from workbench.data import run_features
    from workbench.tracking import read_metrics
    rows = load_records("flan_like")[:4]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _word_tokenizer(rows)
    own, bare = tmp_path / "own", tmp_path / "bare"
    tiny_config("llama").save_pretrained(own); tok.save_pretrained(own)
    tiny_config("llama").save_pretrained(bare)  # a model directory without a tokenizer
    ours, shipped = tokenize_records(rows, tok), tokenize_records(rows, load_tokenizer())
    tokens, trained = sum(len(f["input_ids"]) for f in ours), sum(sum(f["completion_mask"]) for f in ours)
    assert tokens != sum(len(f["input_ids"]) for f in shipped)  # the two tokenizers can be told apart by the counts
    losses, _, error = _main("--model", str(own), "--data", str(data), "--steps", "1", "--max-tokens", "512", "--out",
                             str(tmp_path / "run"))
    assert losses is not None, error
    # the 4 rows fit one step
    assert [(r["tokens"], r["trained"]) for r in read_metrics(tmp_path / "run")] == [(tokens, trained)]
    saved = AutoTokenizer.from_pretrained(latest_checkpoint(tmp_path / "run")[0] / MODEL_DIR)
    assert (saved.get_vocab() == tok.get_vocab()
            and saved(rows[0]["prompt"])["input_ids"] == tok(rows[0]["prompt"])["input_ids"])
    losses, _, error = _main("--model", str(bare), "--data", str(data), "--steps", "1", "--out",
                             str(tmp_path / "refused"))
    assert (losses is None and "has no tokenizer" in error and "--tokenizer PATH" in error
            and "tokenizer.save_pretrained(" in error)
    p = _parser()
    given = _config(p, p.parse_args(["--model", str(bare), "--tokenizer", str(own), "--data", str(data)]), 1)
    assert run_features(given)[0] == ours  # --tokenizer PATH: the fix the refusal names


def test_a_model_directory_without_weights_trains_from_its_config_and_says_so(tmp_path, tiny_data, capsys):
    "--model DIR with a config.json and no weights: no error, one line naming the missing files and the random start."
    from workbench.tiny_models import tiny_config
    from workbench.config import TrainConfig
    from workbench.train import preflight_run
    tiny_config("llama").save_pretrained(tmp_path / "bare")
    preflight_run(TrainConfig(model=str(tmp_path / "bare"), data=tiny_data, max_tokens=64, out=str(tmp_path / "run")))
    assert capsys.readouterr().out.splitlines() == [
        f"model (--model) '{tmp_path / 'bare'}' has a config.json but no weights (none of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json): training starts from a random "
        "initialisation of that config (seed 0)"]


def test_flash_attention_without_flash_attn_is_a_usage_error(tmp_path, tiny_data, monkeypatch):
    "--attn flash_attention_2 where flash-attn is not installed: exit code 2 naming the gpu extra and workbench_varlen."
    import sys
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as on a machine without flash-attn
    losses, _, error = _main("--attn", "flash_attention_2", "--data", tiny_data, "--out", str(tmp_path))
    assert losses is None and "'flash_attention_2' runs the flash-attn package, which is not installed" in error
    assert "pip install -e '.[gpu]'" in error and "--attn workbench_varlen, the workbench's own varlen" in error
