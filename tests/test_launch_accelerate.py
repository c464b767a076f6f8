"""A user's own accelerate loop under `workbench.launch` (a plain `Accelerator()` sees the launch and its DDP step is
the one-process full-batch step), and accelerate's own `notebook_launcher` running the workbench's Ulysses exactly."""
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import datasets  # noqa: F401  accelerate's prepare() imports it: once here, not in each forked rank
from accelerate import Accelerator, notebook_launcher
from accelerate.state import AcceleratorState, GradientState, PartialState
from torch.utils.data import DataLoader, TensorDataset

from workbench.launch import free_port, launch
from workbench.sp_proofs import Case, equivalence_worker, one_process


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _accelerate_step():
    "A user's own loop, untouched: a plain Accelerator(), its sharded DataLoader, DDP, one SGD step."
    acc = Accelerator()
    x, y = _data()
    model = _model()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                     DataLoader(TensorDataset(x, y), batch_size=4))
    for xb, yb in loader:  # one batch of 4 per process
        acc.backward(F.mse_loss(model(xb), yb))
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    seen = (acc.num_processes, acc.process_index, acc.device.type, acc.distributed_type.value, type(model).__name__)
    return dict(seen=seen, grads=grads, weights=[p.detach().clone() for p in model.parameters()])


def test_plain_accelerator_inside_launch_is_ddp_and_steps_as_one_process():
    x, y = _data()
    model = _model()
    F.mse_loss(model(x), y).backward()  # one process, the full batch of 8
    full = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # (first: the ranks fork with torch's optimizer imports done)
    half = _model()
    F.mse_loss(half(x[:4]), y[:4]).backward()  # what an un-synced rank 0 would hold: the test can tell them apart
    assert max((p.grad - g).abs().max().item() for p, g in zip(half.parameters(), full)) > 1e-2
    ranks = launch(_accelerate_step, num_processes=2, cpu=True, quiet=True)
    assert [r["seen"] for r in ranks] == [(2, 0, "cpu", "MULTI_CPU", "DistributedDataParallel"),
                                          (2, 1, "cpu", "MULTI_CPU", "DistributedDataParallel")]
    for r in ranks:
        assert max((a - b).abs().max().item() for a, b in zip(r["grads"], full)) <= 1e-6
        assert max((a - b.detach()).abs().max().item() for a, b in zip(r["weights"], model.parameters())) <= 1e-6


CASE = Case("llama", "sdpa")  # a packed FLAN-like row of 203 tokens (padded to 2 shards), fp32


def _ulysses_under_notebook_launcher(out: str, references: list):
    """What a notebook user writes for accelerate's notebook_launcher:
    open the group through accelerate, run the workbench's SP."""
    torch.set_num_threads(1)  # a forked process cannot use the parent's OpenMP pool (see workbench.launch)
    # notebook_launcher sets RANK/WORLD_SIZE/MASTER_*; on CPU accelerate needs cpu=True to read them
    Accelerator(cpu=True)
    result = equivalence_worker([CASE], 2, references)  # Ulysses SP=2 against one process: logits, loss, every gradient
    Path(out, f"rank{dist.get_rank()}.pkl").write_bytes(pickle.dumps(result))  # notebook_launcher returns nothing


def test_notebook_launcher_runs_the_workbench_ulysses_as_one_process(tmp_path):
    references = [one_process(CASE)]
    states = (AcceleratorState, PartialState, GradientState)
    # notebook_launcher refuses a process that holds an accelerate state
    kept = [dict(cls._shared_state) for cls in states]
    for cls in states: cls._shared_state.clear()     # (an earlier test's Trainer): it runs as in a fresh kernel
    try:
        notebook_launcher(_ulysses_under_notebook_launcher, (str(tmp_path), references), num_processes=2,
                          use_port=str(free_port()))
    finally:
        for cls, state in zip(states, kept): cls._shared_state.update(state)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes())[0] for r in (0, 1)]
    for r in results:
        assert (r["sp"], r["dp"], r["n_params"]) == (2, 1, 21)
        assert max(r["logits"], r["loss"], r["grads"]) <= 1e-5, r
    assert references[0]["loss"] > 1  # a real loss: a random tiny model on real tokens
