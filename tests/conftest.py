import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest
import torch


@pytest.fixture
def one_thread():
    "One OpenMP thread for a test of many tiny forwards: on a shared 2-core box two threads spin (a probe: 4.7 s -> 0.2 s)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
