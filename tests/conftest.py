import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `pytest -n N` each worker gets its share of the cores: N workers with every core's thread each oversubscribe the
# box (on 2 cores, one probe took 4.7 s with 2 threads per worker and 0.2 s with 1). Set before torch starts its pool,
# so the processes and notebook kernels a test launches inherit it too; an explicit OMP_NUM_THREADS is kept.
# A CPU measurement behind a run's prediction stands an hour, not a minute (`workbench.cost.cpu_max_age_s`): the suite's
# runs share one steady load, and measuring again every minute took a fifth of tests/test_train.py.
os.environ.setdefault("WORKBENCH_CPU_MAX_AGE_S", "3600")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


import importlib.util
import json
from pathlib import Path

import pytest
import torch


@pytest.fixture
def one_thread():
    """One OpenMP thread for a test of many tiny forwards: on a
    shared 2-core box two threads spin (a probe: 4.7 s -> 0.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_spec = importlib.util.spec_from_file_location("durations", Path(__file__).parents[1] / ".ci" / "durations.py")
durations = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(durations)
DURATIONS = Path(__file__).with_name("durations.json")  # seconds per group: `.ci/durations.py N FILE --save`


def order_group(item) -> str:
    "The unit the suite is ordered by: `group` in .ci/durations.py, which writes tests/durations.json by it."
    return durations.group(item.module.__name__.rsplit(".", 1)[-1], item.name)


def pytest_collection_modifyitems(items):
    """The heaviest groups first (tests/durations.json; a new group counts as light), so that the two workers of
    `pytest -n 2 --dist worksteal` end together on light items instead of one idling through another's long notebook:
    worksteal deals each worker a contiguous half and the idle one steals from the end of the other's queue.

    The site test goes before everything when it runs in the same session (a plain `pytest -n 2`; `make test` leaves it
    out and `make test-site` runs it alone after): it builds the pages from every notebook's execution, and
    docs/build.py executes each notebook once, whoever asks first (the site test or the notebook's own item; the other
    waits and reads the cache). Started first, its long build overlaps the suite on the other worker."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    site = [item for item in items if item.name == "test_site_reads_offline_in_chromium"]
    rest = [item for item in items if item not in site]
    first_index = {}
    for i, item in enumerate(rest):
        first_index.setdefault(order_group(item), i)
    heaviest_first = lambda item: (-seconds.get(order_group(item), 0.0), first_index[order_group(item)])
    items[:] = site + sorted(rest, key=heaviest_first)  # a stable sort: a group's items keep their order
