"""The shape of `workbench.sp`: the mechanism never imports the harness or the launcher, and every module imports alone
(no import circle: `workbench.launch` loads no part of `workbench.sp` when imported; it asks `sp.layout` for a run's
checks on demand)."""
import json
import subprocess
import sys

import pytest

MECHANISM = ("grid", "all_to_all", "shard", "loss", "ulysses", "ring", "balance", "gather", "layout")
HARNESS = ("workbench.sp_proofs", "workbench.sp_measure", "workbench.launch")


# One fresh interpreter imports torch (which loads no workbench module), then runs each statement in a fork of itself:
# each statement sees what a fresh interpreter would, and torch is imported once instead of eleven times.
FORKS = r"""
import json, os, sys, traceback
import torch
assert not [m for m in sys.modules if m.startswith("workbench")]
results = {}
for stmt in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            exec(stmt, {})
            loaded = sorted(m for m in sys.modules if m.startswith("workbench"))
        except BaseException:
            loaded = traceback.format_exc()
        with os.fdopen(write, "w") as out: out.write(json.dumps(loaded))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got: results[stmt] = json.loads(got.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""
STATEMENTS = [f"import workbench.sp.{name}" for name in MECHANISM] + ["import workbench.launch",
                                                                      "import workbench.sp_proofs"]


@pytest.fixture(scope="module")
def loaded() -> dict:
    "The workbench modules each of STATEMENTS loads, each in a fork of a fresh interpreter that imported only torch."
    r = subprocess.run([sys.executable, "-c", FORKS, json.dumps(STATEMENTS)], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout)
    failed = {stmt: out for stmt, out in results.items() if isinstance(out, str)}
    assert not failed, failed
    return {stmt: set(modules) for stmt, modules in results.items()}


@pytest.mark.parametrize("name", MECHANISM)
def test_the_mechanism_imports_alone_and_never_the_harness(loaded, name):
    modules = loaded[f"import workbench.sp.{name}"]
    assert f"workbench.sp.{name}" in modules
    assert not modules & set(HARNESS), f"workbench.sp.{name} pulls in {sorted(modules & set(HARNESS))}"


def test_the_launcher_imports_first_and_needs_no_part_of_sp(loaded):
    modules = loaded["import workbench.launch"]
    assert not {m for m in modules if m.startswith("workbench.sp.")}, modules
    assert "workbench.sp_proofs" in loaded["import workbench.sp_proofs"]  # the harness on top of the launcher


def test_one_grid_for_every_layout():
    from workbench.sp.grid import ParallelGrid
    from workbench.sp.ulysses import ulysses_attention
    g = ParallelGrid(ulysses=2, ring=2)
    assert (g.sp_size, g.sp_rank, g.group("ring"), g.rank("ulysses")) == (4, 0, None, 0)
    with pytest.raises(ValueError, match="dimensions"): g.group("sp")
    import torch
    q = torch.zeros(1, 4, 8, 16)
    # Ulysses alone would attend within its block
    with pytest.raises(ValueError, match=r"a ring of 2.*register_ring\(\)"):
        ulysses_attention(None, q, q, q, None, inner="sdpa", sp_grid=g, cu_seq_lens_q=torch.tensor([0, 8]))


def test_a_wheel_carries_every_module(tmp_path):
    """pip install . (not -e) gets what a wheel holds: every module of the source tree, sub-packages included, and the
    shipped data."""
    import shutil, zipfile
    from pathlib import Path
    # a copy: setuptools would reuse a stale build/ here
    root, src = Path(__file__).resolve().parents[1], tmp_path / "src"
    for name in ("workbench", "data_samples"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"): shutil.copy(root / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = set(zipfile.ZipFile(next(tmp_path.glob("workbench-*.whl"))).namelist())
    source = {p.relative_to(root).as_posix() for p in (root / "workbench").rglob("*.py")}
    assert source <= names, sorted(source - names)
    data = {f"workbench/{p.relative_to(root).as_posix()}" for p in (root / "data_samples").rglob("*")
            if p.suffix in (".json", ".jsonl")}
    assert data and data <= names, sorted(data - names)  # where samples.data_dir looks in an installed wheel
