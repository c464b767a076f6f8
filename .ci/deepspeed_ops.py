"""Build DeepSpeed's CPU communication op (`deepspeed_shm_comm`) once, at install time.

On a CPU-only machine DeepSpeed compiles this op with ninja the first time a process sets up its communication
(`deepspeed.init_distributed`): about 100-190 s on 2 cores, paid otherwise by whichever test or notebook first starts
DeepSpeed. The build lands in torch's extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), keyed by
the venv's paths, so a new venv builds it again. Builds only what DeepSpeed itself would: nothing where its accelerator
has no such op (CUDA) or its probe says the op cannot build here.
"""
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the tests run it: told the device, DeepSpeed does not guess
from deepspeed.accelerator import get_accelerator  # noqa: E402
import deepspeed.ops  # noqa: E402

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is None: sys.exit(0)
sys.stderr.flush()
saved = os.dup(2)
with open(os.devnull, "w") as null:  # the probe links a test program per op and prints the linker's complaints
    os.dup2(null.fileno(), 2)
    compatible = deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
os.dup2(saved, 2)
if compatible:
    builder.load(verbose=False)
    print(f"built {builder.absolute_name()}")
