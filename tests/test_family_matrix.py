"""The family matrix: every shipped family x CPU attention implementation, packed == padded (logits, loss, gradients).

Recomputed here, asserted cell by cell, and checked against the committed page docs/family_matrix.md
(regenerate it with `python -m workbench.doctor --matrix --flex --out docs/family_matrix.md`).
"""
from pathlib import Path

import pytest

from workbench.tiny_models import model_families, release
from workbench.doctor import FORWARD_ONLY, KNOWN_LIMITS, MATRIX_IMPLS, family_row, matrix_examples

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "family_matrix.md"
TOLERANCE = 1e-5  # max |difference| for logits, loss and every gradient, float32
ANNOUNCED = {"llama", "llama3", "mistral", "mixtral", "granite", "dbrx", "falcon", "gemma", "olmo", "phi", "phi3",
             # the padding-free announcement's families (Llama 2 = llama)
             "qwen2", "qwen2_moe", "stablelm", "starcoder2"}
CURRENT = {"qwen3", "gemma2", "gemma3", "olmo2"}


def _page_rows() -> dict:
    """(family, implementation) -> 'pass' / 'FAIL', read from the
    committed page (measured with the installed transformers)."""
    installed = ".".join(map(str, release()))
    assert f"with transformers {installed} " in PAGE.read_text(), (
        f"{PAGE.name} was not generated with the installed transformers {installed}: regenerate it with "
        f"python -m workbench.doctor --matrix --flex --out docs/family_matrix.md")
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[5] in ("pass", "FAIL"): rows[(cells[0], cells[1])] = cells[5]
    return rows


@pytest.fixture(scope="module")
def examples():
    return matrix_examples()


def test_all_families_shipped():
    assert ANNOUNCED | CURRENT <= set(model_families())


@pytest.mark.parametrize("family", model_families())
def test_family(family, examples):
    page = _page_rows()
    for impl in MATRIX_IMPLS:
        row = family_row(family, impl, examples, TOLERANCE)
        expected = KNOWN_LIMITS.get((family, impl))
        if expected is None:
            assert row.passed, f"{family} x {impl}: {row.reason}"
            assert row.logits <= TOLERANCE and row.loss <= TOLERANCE and row.grads <= TOLERANCE
        else:
            assert not row.passed and expected in row.reason, (f"{family} x {impl}: expected a refusal "
                                                               f"naming {expected!r}, got {row}")
        assert page.get((family, impl)) == ("pass" if row.passed else "FAIL"), (
            f"{PAGE.name} is stale for {family} x {impl}")


def test_flex_forward_one_family(examples):
    "flex_attention on CPU: forward only (no backward), one family here because every model compiles (~20 s)."
    row = family_row("qwen3", FORWARD_ONLY[0], examples, TOLERANCE)
    assert row.passed and row.grads is None and row.logits <= TOLERANCE, row


def test_page_covers_every_cell():
    page = _page_rows()
    cells = {(f, i) for f in model_families() for i in MATRIX_IMPLS + FORWARD_ONLY}
    assert cells <= set(page), f"missing from {PAGE.name}: {sorted(cells - set(page))}"
    fails = {cell for cell, verdict in page.items() if verdict == "FAIL"}
    assert fails == set(KNOWN_LIMITS), f"unexpected failures in {PAGE.name}: {sorted(fails ^ set(KNOWN_LIMITS))}"
