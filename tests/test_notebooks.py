"Every notebook in nbs/ through nbdev's own runner, one pytest item each (cells flagged `cuda` are skipped on CPU)."
from configparser import ConfigParser
from pathlib import Path

import pytest
import torch
from nbdev import test as nbdev_test  # imported as a module so pytest does not collect its test_nb

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted(p for p in (ROOT / "nbs").rglob("*.ipynb")
             if not p.name.startswith("_") and ".ipynb_checkpoints" not in p.parts)
FLAGS = ConfigParser(); FLAGS.read(ROOT / "settings.ini")
SKIP = [f for f in FLAGS["DEFAULT"]["tst_flags"].split() if f == "slow" or (f == "cuda" and not torch.cuda.is_available())]


@pytest.mark.parametrize("nb", NBS, ids=[str(p.relative_to(ROOT / "nbs")) for p in NBS])
def test_notebook(nb, capsys):
    ok, seconds = nbdev_test.test_nb(nb, skip_flags=SKIP)
    assert ok, f"{nb.name} failed after {seconds:.1f}s: its traceback is in the captured stderr above"
