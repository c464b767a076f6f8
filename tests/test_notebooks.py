"""Every notebook in nbs/ executed as the documentation site executes it (docs/build.py: a fresh python3 kernel from the
notebook's folder, skipping the cells nbdev_test skips), one pytest item each. The executed copy lands in the site's
cache, so `make test` runs each notebook once for both the proof and the pages (tests/test_docs.py builds from it)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
docs_build = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(docs_build)
NBS = docs_build.notebooks()


CELL_TIMEOUT_S = 540  # under pytest-timeout's 600 s per item: a cell that hangs is named by nbclient, not killed unnamed


@pytest.mark.parametrize("nb", NBS, ids=[str(p.relative_to(ROOT / "nbs")) for p in NBS])
def test_notebook(nb):
    nb_out, _ = docs_build.executed(nb, docs_build.skip_flags(), CELL_TIMEOUT_S)  # raises nbclient's error with the cell and traceback
    errors = [o for c in nb_out.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{nb.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
