"""The suite's time, read from the JUnit XML files pytest wrote (`--junitxml`): `python .ci/durations.py N FILE...`
prints the N slowest items over every file and the summed and per-file totals, so a change that breaks the budget
(tests/README.md) is seen when it lands."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def items(path: Path) -> list[tuple[float, str]]:
    "(seconds, node id) of every test case in one JUnit XML file."
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time", 0))
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out.append((seconds, name))
    return out


def main(n: int, paths: list[Path]) -> None:
    everything = []
    for path in paths:
        found = items(path)
        total = sum(s for s, _ in found)
        print(f"{path.name}: {len(found)} items, {total:.0f} s summed over workers")
        everything += found
    everything.sort(reverse=True)
    print(f"\nthe {n} slowest items:")
    for seconds, name in everything[:n]:
        print(f"{seconds:8.1f} s  {name}")
    print(f"\ntotal: {len(everything)} items, {sum(s for s, _ in everything):.0f} s summed over workers")


if __name__ == "__main__":
    main(int(sys.argv[1]), [Path(p) for p in sys.argv[2:] if Path(p).exists()])
