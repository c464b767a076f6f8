"workbench.train from the command line: one step of every shipped family (sdpa and workbench_varlen), and a clear error for every misuse."
import contextlib
import io
import json

import pytest

from workbench.core import model_families
from workbench.train import main

# the (family, attention) pairs the model itself cannot run, and the words of the refusal each gets
REFUSED = {("gemma2", "sdpa"): "does not support", ("gemma2", "workbench_varlen"): "softcapping",
           ("falcon", "workbench_varlen"): "AttentionInterface"}


def _main(*argv) -> tuple[list | None, str, str]:
    "Run the CLI in-process: (losses or None, stdout, the usage error or the failing rank's error)."
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): return main(list(argv)), out.getvalue(), ""
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
