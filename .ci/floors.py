"""The dependency floors: the `>=` lower bounds in pyproject.toml, read as exact pins.

`python .ci/floors.py pins` prints them as a pip constraints file (`name==version`, one a line);
`python .ci/floors.py verify` prints each floor beside the installed version and exits 1 unless every one IS the floor.
pyproject.toml stays the only list: `make test-floors` regenerates the pins from it on every install.
"""
import importlib
import importlib.util
import os
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
EXTRAS = ["dev"]  # the optional groups whose floors the fast suite proves (gpu needs CUDA)


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    "Package name -> the version of its `>=` bound, over the dependencies and the `EXTRAS` groups."
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = project["dependencies"] + [r for g in EXTRAS for r in project["optional-dependencies"][g]]
    out = {}
    for req in reqs:
        name, specs = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*).*", req).groups()
        lows = [s.strip()[2:].strip() for s in specs.split(",") if s.strip().startswith(">=")]
        if lows: out[name] = lows[0]
    return out


def bare(v: str) -> str:
    "A version without its local label: torch's CPU wheel installs as `2.13.0+cpu`."
    return v.split("+")[0]


def same(installed: str, floor: str) -> bool:
    "Whether `installed` is release `floor`; a floor written `8` or `1.26` means `8.0.0` / `1.26.0`, as pip reads `==`."
    a, b = (bare(v).split(".") for v in (installed, floor))
    n = max(len(a), len(b))
    return a + ["0"] * (n - len(a)) == b + ["0"] * (n - len(b))


def canon(name: str) -> str: return re.sub(r"[-_.]+", "-", name).lower()


def import_error(name: str) -> str | None:
    "Why distribution `name`'s top-level packages fail to import, or None (a test's `importorskip` would hide it)."
    pkgs = [m for m, ds in packages_distributions().items() if canon(name) in map(canon, ds) and not m.startswith("_")]
    for m in pkgs:  # packages only: a top-level script such as ipykernel_launcher would run on import
        if importlib.util.find_spec(m).submodule_search_locations is None: continue
        try: importlib.import_module(m)
        except Exception as e: return f"import {m}: {type(e).__name__}: {e}"
    return None


def verify() -> int:
    "Print floor and installed version side by side; 1 when any differ, is missing or does not import."
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # told the device, DeepSpeed does not log a guess of it on import
    bad = 0
    for name, floor in floors().items():
        try: got = version(name)
        except PackageNotFoundError: got = "missing"
        why = "not installed" if got == "missing" else None if same(got, floor) else "not the floor"
        why = why or import_error(name)
        bad += why is not None
        print(f"{'ok ' if why is None else 'BAD'} {name:<16} floor {floor:<10} installed {got}"
              + (f"  {why}" if why else ""))
    print(f"{len(floors()) - bad} of {len(floors())} packages installed at their floor")
    return int(bad > 0)


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "pins": print("\n".join(f"{n}=={v}" for n, v in floors().items()))
    elif cmd == "verify": sys.exit(verify())
    else: sys.exit("usage: python .ci/floors.py pins|verify")
