"""Every notebook in nbs/ executed as the documentation site executes it (docs/build.py: a fresh python3 kernel from the
notebook's folder, skipping the cells nbdev_test skips), one pytest item each. The executed copy lands in the site's
cache, so `make test` runs each notebook once for both the proof and the pages (tests/test_docs.py builds from it)."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
docs_build = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(docs_build)
NBS = docs_build.notebooks()


# under pytest-timeout's 600 s per item: a cell that hangs is named by nbclient, not killed unnamed
CELL_TIMEOUT_S = 540


@pytest.mark.parametrize("nb", NBS, ids=[str(p.relative_to(ROOT / "nbs")) for p in NBS])
def test_notebook(nb):
    # raises nbclient's error with the cell and traceback
    nb_out, _ = docs_build.executed(nb, docs_build.skip_flags(), CELL_TIMEOUT_S)
    errors = [o for c in nb_out.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{nb.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    if nb.parent.name == "tutorials": assert not third_party_warnings(nb_out), third_party_warnings(nb_out)


def third_party_warnings(nb) -> list[str]:
    """Warning lines a notebook printed from an installed package (site-packages): a newcomer's tutorial shows none (the
    workbench's own warnings, which a tutorial provokes on purpose, come from workbench/)."""
    streams = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream"]
    return [line for o in streams if o.get("name") == "stderr" for line in o["text"].splitlines()
            if "Warning" in line and "site-packages" in line]


def test_cache_key_follows_installed_versions(monkeypatch):
    "An upgrade in place (same notebook, same workbench source) executes the notebooks again, not passed from cache."
    nb, real = NBS[0], docs_build.installed_version
    before = docs_build.cache_key(nb, set())
    assert {"torch", "transformers", "trl", "accelerate", "datasets", "peft", "deepspeed", "plotly", "ipywidgets",
            "nbdev", "numpy"} <= set(docs_build.keyed_packages())
    monkeypatch.setattr(docs_build, "installed_version", lambda name: "5.99" if name == "transformers" else real(name))
    upgraded = docs_build.cache_key(nb, set())
    monkeypatch.setattr(docs_build, "installed_version", real)
    assert upgraded != before and docs_build.cache_key(nb, set()) == before


def test_notebook_outputs_are_stripped_on_commit(tmp_path):
    """The install's `make git-filter` makes git read every notebook through .ci/strip_outputs.py (.gitattributes): a
    tutorial run and saved with its outputs leaves `git diff` empty and commits nothing, and the file keeps them."""
    repo, nb = tmp_path / "clone", ROOT / "nbs" / "tutorials" / "pack_a_dataset.ipynb"
    (repo / ".ci").mkdir(parents=True)
    for name in (".gitattributes", "settings.ini", ".ci/strip_outputs.py", nb.name):
        shutil.copy(ROOT / name if name != nb.name else nb, repo / name)

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                               *args], capture_output=True, text=True, check=True).stdout
    git("init", "-q")
    subprocess.run(["make", "-s", "-C", str(repo), "-f", str(ROOT / "Makefile"), "git-filter", f"VENV={sys.prefix}"],
                   check=True, timeout=60)
    assert git("config", "filter.nbstrip.clean") == f"{sys.prefix}/bin/python .ci/strip_outputs.py\n"
    git("add", "."); git("commit", "-qm", "as committed")
    ran = nbformat.read(repo / nb.name, as_version=4)  # as JupyterLab saves it after a run
    for i, cell in enumerate(c for c in ran.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"cell {i}\n")]
    ran.metadata.update(language_info={"name": "python"}, widgets={"application/vnd.jupyter.widget-state+json": {}})
    nbformat.write(ran, repo / nb.name)
    assert git("diff") == ""
    git("add", "-A")  # `git status` lists it until then (the index remembers the file's size), but nothing is staged:
    assert git("status", "--porcelain") == "" and git("diff", "--cached") == ""
    assert "cell 0" in (repo / nb.name).read_text()  # the outputs stay in the file
