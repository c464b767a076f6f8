import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `pytest -n N` each worker gets its share of the cores: N workers with every core's thread each oversubscribe the box
# (on 2 cores, one probe took 4.7 s with 2 threads per worker and 0.2 s with 1). Set before torch starts its pool, so the
# processes and notebook kernels a test launches inherit it too; an explicit OMP_NUM_THREADS is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


import pytest
import torch


@pytest.fixture
def one_thread():
    "One OpenMP thread for a test of many tiny forwards: on a shared 2-core box two threads spin (a probe: 4.7 s -> 0.2 s)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """The site test first when it runs in the same session (a plain `pytest -n 2`; `make test` leaves it out and
    `make test-site` runs it alone after): it builds the pages from every notebook's execution, and docs/build.py executes each
    notebook once, whoever asks first (the site test or the notebook's own item; the other waits and reads the cache).
    Started first, its long build overlaps the suite on the other worker; collected last it was the run's tail (a
    fresh-clone run: 129 s with the other worker idle)."""
    site = [item for item in items if item.name == "test_site_reads_offline_in_chromium"]
    items[:] = site + [item for item in items if item not in site]
