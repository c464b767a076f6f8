"""The suite's time, read from the JUnit XML files pytest wrote (`--junitxml`).

`python .ci/durations.py N FILE...` prints the N slowest items over every file and the totals, so a change that breaks
the budget (tests/README.md) is seen when it lands; `--markdown` prints the same as a table with what each item proves
(the first paragraph of its test's docstring, or of its module's for a notebook item); `--save` also writes the seconds
of each group (`group`: a test module, or one notebook) to tests/durations.json, from which tests/conftest.py starts the
heaviest groups first."""
import ast
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def items(path: Path) -> list[tuple[float, str, str]]:
    "(seconds, test module, test name) of every test case in one JUnit XML file."
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time", 0))
        module = case.get("classname", "").split(".")[-1]
        out.append((seconds, module, case.get("name", "")))
    return out


def proves(module: str, name: str) -> str:
    """The first paragraph of the docstring of the test function `name` in tests/`module`.py (its module's where it has
    none), joined into one line: a docstring wrapped at 120 characters is shown whole."""
    if name.startswith("test_notebook["): return notebook_summary(ROOT / "nbs" / name[len("test_notebook["):-1])
    path = ROOT / "tests" / f"{module}.py"
    if not path.exists(): return ""
    tree = ast.parse(path.read_text())
    function = name.split("[")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function and ast.get_docstring(node):
            return first_paragraph(ast.get_docstring(node))
    return first_paragraph(ast.get_docstring(tree) or "")


def first_paragraph(doc: str) -> str:
    "A docstring's text up to its first blank line, on one line."
    return " ".join(doc.split("\n\n")[0].split())


def notebook_summary(path: Path) -> str:
    "A notebook's title and one-line summary (its first markdown cell), as the suite runs it whole."
    if not path.exists(): return ""
    first = next((c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"), None)
    lines = [l.strip("# >").strip() for l in "".join(first["source"]).splitlines() if l.strip()] if first else []
    return "the notebook, whole: " + ": ".join(lines[:2])


def group(module: str, name: str) -> str:
    """The unit the suite is ordered by (tests/conftest.py): a test module, whose items share its fixtures, or one
    notebook, named without its folder and number so that renumbering keeps its time (`03_runtime/13_train.ipynb` ->
    `train`)."""
    if not name.startswith("test_notebook["): return module
    return "notebook " + Path(name[len("test_notebook["):-1]).stem.lstrip("0123456789_")


def save(everything: list, path: Path) -> None:
    "Write each group's summed seconds, heaviest first."
    totals = {}
    for seconds, module, name in everything:
        key = group(module, name)
        totals[key] = totals.get(key, 0.0) + seconds
    ordered = dict(sorted(((k, round(v, 1)) for k, v in totals.items()), key=lambda kv: -kv[1]))
    path.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"wrote {path} ({len(ordered)} groups)")


def main(n: int, paths: list[Path], markdown: bool, saving: bool) -> None:
    everything = []
    for path in paths:
        found = items(path)
        print(f"{path.name}: {len(found)} items, {sum(s for s, _, _ in found):.0f} s summed over workers")
        everything += found
    everything.sort(reverse=True)
    print(f"\nthe {n} slowest items:")
    if markdown: print("\n| seconds | item | what it proves |\n|---:|---|---|")
    for seconds, module, name in everything[:n]:
        if markdown: print(f"| {seconds:.0f} | `{module}::{name}` | {proves(module, name)} |")
        else: print(f"{seconds:8.1f} s  {module}::{name}")
    print(f"\ntotal: {len(everything)} items, {sum(s for s, _, _ in everything):.0f} s summed over workers")
    if saving: save(everything, ROOT / "tests" / "durations.json")


if __name__ == "__main__":
    args = sys.argv[1:]
    markdown, saving = "--markdown" in args, "--save" in args
    args = [a for a in args if a not in ("--markdown", "--save")]
    main(int(args[0]), [Path(p) for p in args[1:] if Path(p).exists()], markdown, saving)
