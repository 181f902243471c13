"""numba's thread pool, shared by the CPU loops of the model (`cpu_kernels.py`) and the attention
kernel (`attention/numba_cpu.py`): which threading layer runs their parallel loops, how its
threads wait, how the pool starts without changing torch's thread count, and the lock that lets
one parallel loop run at a time in a process. Imported before either compiles a parallel loop:
numba reads the layer's setting when it first launches one.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading

import numba
import torch

# numba's threading layer (`attention/numba_cpu.py`'s docstring says why): OpenMP where its threads
# sleep between kernels -- OMP_WAIT_POLICY=PASSIVE, which minivllm sets on import -- and the
# workqueue otherwise, or where numba finds no libgomp. A choice made in the environment wins. Set
# there as well, so a later `numba.config.reload_config()` keeps it.
if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
    _passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    # (numba wants all three named; the workqueue always loads, so TBB's place never matters)
    _layers = ["omp", "workqueue", "tbb"] if _passive else ["workqueue", "omp", "tbb"]
    numba.config.THREADING_LAYER_PRIORITY = _layers
    os.environ.setdefault(
        "NUMBA_THREADING_LAYER_PRIORITY", " ".join(numba.config.THREADING_LAYER_PRIORITY)
    )


def _load_openmp_sleeping() -> None:
    """Load numba's OpenMP layer with a libgomp of its own, if it gets one, sleeping at once.

    torch's OpenMP threads may be given a short spin (GOMP_SPINCOUNT, minivllm's default: the
    package's `__init__`), to bridge the gap between two torch ops. A libgomp numba loaded for
    itself would read the same setting as it loads -- but between two attention kernels lies a
    layer of matmuls, longer than any spin, and a numba thread spinning there would hold a core
    torch's threads need. So, under the passive policy, numba's layer loads without the spin count
    in the environment, which is then put back (for torch in child processes).

    With torch's pip wheels numba gets no runtime of its own: torch has loaded its `libgomp.so.1`
    first, and the dynamic linker binds numba's OpenMP calls (`GOMP_parallel`, ...) to that one
    (`LD_DEBUG=bindings` shows it; the system's libgomp that numba names is mapped, its threads
    never start). numba's parallel loops then run on torch's own OpenMP threads, with torch's short
    spin: one pool, one thread per extra core, no two spinning for the same core -- and a kernel
    launched right after a matmul finds that thread still awake (issue 32: on the book's 2-core
    AMD EPYC, one worker thread ran both torch's parallel ops and the attention kernel's shares).
    Then this function changes nothing: a loaded libgomp keeps what it read."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    if spin is None or os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        return
    del os.environ["GOMP_SPINCOUNT"]
    try:
        importlib.import_module("numba.np.ufunc.omppool")
    except ImportError:
        pass  # no libgomp numba can load: the workqueue layer runs the kernels (`openmp_layer`)
    finally:
        os.environ["GOMP_SPINCOUNT"] = spin


_load_openmp_sleeping()
# One parallel kernel at a time in a process: the workqueue layer aborts the process if two threads
# launch at once, so engines stepping in different threads (a server each) take turns here.
LAUNCH = threading.Lock()


def openmp_layer() -> bool:
    """Whether numba's parallel kernels run on its OpenMP layer: first in the priority set above,
    with a libgomp numba can load (or named in NUMBA_THREADING_LAYER)."""
    if numba.config.THREADING_LAYER != "default":
        return numba.config.THREADING_LAYER == "omp"
    for layer in numba.config.THREADING_LAYER_PRIORITY:
        module = {"omp": "omppool", "workqueue": "workqueue", "tbb": "tbbpool"}[layer]
        try:
            importlib.import_module(f"numba.np.ufunc.{module}")
        except ImportError:
            continue  # numba skips a layer it cannot load, as here
        return layer == "omp"
    return False


@functools.cache
def start_thread_pool() -> None:
    """Start numba's thread pool (once a process), leaving torch's thread count as it was.

    numba's OpenMP layer starts its pool by setting the calling thread's OpenMP thread count to
    NUMBA_NUM_THREADS -- every core, unless set -- and torch reads its own count from that same
    setting. On a machine with more cores than torch was told to use, every torch op after the
    first parallel kernel would run on every core: the 16-core host of a lent GPU went from 2 to
    16, where some op splits its work otherwise (the fused model's logits then move by float32
    rounding, model/fused.py).
    Every start of the pool goes through here."""
    torch_threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def default_threads() -> int:
    """numba's thread setting -- but 1, without starting numba's thread pool, in a process that
    allows no more (a forward worker, `NUMBA_NUM_THREADS=1`)."""
    if numba.config.NUMBA_NUM_THREADS == 1:
        return 1
    start_thread_pool()
    return numba.get_num_threads()


def loop_threads() -> int:
    """The threads a parallel loop of this process may take: torch's count (the engine's; a forward
    worker's is 1), at most numba's."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def use_threads(threads: int) -> None:
    """numba's next parallel loops on this thread run on `threads` threads (2 or more), its pool
    started first where it has not been (`start_thread_pool`). numba's count is the calling
    thread's own."""
    start_thread_pool()
    numba.set_num_threads(threads)
