"""Registers per thread of the v3 and v4 decode kernels, from the compiler, without a GPU.

    python tools/kernel_registers.py [--cc 9.0] [--write]

numba-cuda compiles a kernel to PTX with libNVVM, and `ptxas -v` (the assembler the driver would
run) reports the registers, spills and stack of each kernel for a chosen compute capability: the
numbers Nsight Compute shows in its launch statistics (`ptxas` for sm_90 gave v3 the 128 registers
the H100 run recorded). This needs a CUDA toolkit (`ptxas`, `libnvvm.so`, `libdevice.10.bc`;
found under `$CUDA_HOME`, else /usr/local/cuda), not a GPU: numba's simulator is kept off with
`MINIVLLM_CUDA_COMPILE_ONLY=1`. A toolkit without NVRTC (numba asks it only which architectures
exist) is told the list below. Also counted, from the PTX: global loads by width (static
instructions, not executions: v4's 2-byte loads are its queries, once per block) and 64-bit integer
instructions, the address arithmetic that wide loads save. These are compiler counts, not
measurements: occupancy and bandwidth come from the GPU run (`benchmarks/paged_attention.py`).

The shape is the benchmark's: head_dim 128, 32 query heads over 8 K/V heads (group 4), block size
16, 128 threads a block (256 where named). `--write` records the table in
`benchmarks/results/kernel_registers.json`.
"""

from __future__ import annotations

import os

os.environ["MINIVLLM_CUDA_COMPILE_ONLY"] = "1"  # before numba is imported: its real CUDA target
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

# isort: split
import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "kernel_registers.json"
HEAD_DIM, GROUP, BLOCK_SIZE, THREADS = 128, 4, 16, 128
KNOWN_CCS = ((7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0))


def cuda_home() -> Path:
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "nvvm" / "libdevice").is_dir():
        ptxas = shutil.which("ptxas")
        if ptxas is None:
            raise SystemExit(f"no CUDA toolkit: neither {home}/nvvm nor ptxas on PATH")
        home = Path(ptxas).resolve().parent.parent
    return home


def prepare_numba(home: Path) -> None:
    """numba-cuda finds libNVVM and libdevice through its path search, which also looks for NVRTC
    and fails where a toolkit has none: point it at the toolkit's files directly."""
    from numba.cuda.cudadrv import libs, nvrtc, nvvm

    try:
        nvrtc.get_supported_ccs()
    except Exception:  # no NVRTC: numba only wanted the list of architectures from it
        nvrtc.get_supported_ccs = lambda: KNOWN_CCS
    libdevice = next((home / "nvvm" / "libdevice").glob("libdevice*.bc"))

    def open_libdevice() -> bytes:
        return libdevice.read_bytes()

    nvvm.get_libdevice = libs.get_libdevice = lambda: str(libdevice)
    nvvm.open_libdevice = libs.open_libdevice = open_libdevice


def signature(dtype):
    from numba import types

    return (
        dtype[:, :, :, ::1],  # partial_out (the output itself with one partition)
        types.float32[:, :, ::1],
        types.float32[:, :, ::1],
        dtype[:, :, ::1],  # q
        dtype[::1],  # the caches, flattened
        dtype[::1],
        types.int32[:, ::1],
        types.int32[::1],
        types.int64,
        types.float64,
        types.int64,
    )


def kernels() -> dict[str, tuple]:
    """name -> (python function, numba dtype, register cap, v4 layout) for each kernel compiled
    here: the variants `benchmarks/paged_attention.py` times, in both cache dtypes."""
    from numba import types

    from minivllm.attention.cuda.grouped import default_lanes_per_token, grouped_decode_kernel
    from minivllm.attention.cuda.tiled import tiled_decode_kernel, tiled_layout

    found = {}
    lanes = default_lanes_per_token(HEAD_DIM)
    v3 = grouped_decode_kernel(HEAD_DIM, GROUP, lanes, BLOCK_SIZE).py_func
    for dtype, name in ((types.float16, "float16"), (types.float32, "float32")):
        found[f"v3 {name}"] = (v3, dtype, None, None)
        found[f"v3 regs<=64 {name}"] = (v3, dtype, 64, None)
        for variant, knobs, threads, cap in (
            ("v4", {}, THREADS, None),
            ("v4 regs<=64", {}, THREADS, 64),
            ("v4 no prefetch", {"prefetch": False}, THREADS, None),
            ("v4 256 threads regs<=64", {}, 256, 64),
        ):
            layout = tiled_layout(HEAD_DIM, dtype.bitwidth // 8, threads, **knobs)
            v4 = tiled_decode_kernel(HEAD_DIM, GROUP, BLOCK_SIZE, layout)
            found[f"{variant} {name}"] = (v4.py_func, dtype, cap, layout)
    return found


def ptx_counts(ptx: str) -> dict[str, int]:
    """Instruction counts in the PTX text that tell where registers and issue slots go."""
    ops = Counter(m.group(1) for m in re.finditer(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, re.M))
    return {
        "ptx_instructions": sum(ops.values()),
        "global_loads": {op: n for op, n in sorted(ops.items()) if op.startswith("ld.global")},
        "int64_instructions": sum(n for op, n in ops.items() if re.search(r"\.[sub]64$", op)),
        "local_declarations": len(re.findall(r"\.local\s", ptx)),
    }


def ptxas(
    ptx: str, cc: tuple[int, int], home: Path, max_registers: int | None = None
) -> dict[str, int]:
    """`ptxas -v` of the PTX (with the cap the driver would be given, if any): registers, spill
    bytes and stack per thread."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run(
            [
                str(home / "bin" / "ptxas"),
                f"-arch=sm_{cc[0]}{cc[1]}",
                "-v",
                str(source),
                "-o",
                str(Path(folder) / "kernel.cubin"),
                *([f"-maxrregcount={max_registers}"] if max_registers else []),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    numbers = {
        "registers": r"Used (\d+) registers",
        "stack_bytes": r"(\d+) bytes stack frame",
        "spill_store_bytes": r"(\d+) bytes spill stores",
        "spill_load_bytes": r"(\d+) bytes spill loads",
    }
    return {key: int(re.search(pattern, report).group(1)) for key, pattern in numbers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, like 9.0 (H100)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {RESULTS}")
    args = parser.parse_args()
    cc = tuple(int(part) for part in args.cc.split("."))
    home = cuda_home()
    sys.path.insert(0, str(ROOT / "src"))
    prepare_numba(home)
    from numba import cuda

    rows = {}
    print(
        f"{'kernel':<32} {'registers':>9} {'stack':>5} {'spills':>6} {'vector loads':>12} "
        f"{'2-byte loads':>12} {'int64 ops':>9}"
    )
    for name, (function, dtype, cap, layout) in kernels().items():
        ptx, _ = cuda.compile_ptx(function, signature(dtype), cc=cc)
        row = ptxas(ptx, cc, home, cap) | ptx_counts(ptx)
        row["max_registers"] = cap
        if layout is not None:
            row["layout"] = vars(layout)
        rows[name] = row
        loads = row["global_loads"]
        vector_loads = sum(n for op, n in loads.items() if ".v2." in op or ".v4." in op)
        print(
            f"{name:<32} {row['registers']:>9} {row['stack_bytes']:>5} "
            f"{row['spill_store_bytes'] + row['spill_load_bytes']:>6} {vector_loads:>12} "
            f"{loads.get('ld.global.u16', 0):>12} {row['int64_instructions']:>9}"
        )
    if args.write:
        ptxas_version = (
            subprocess.run(
                [str(home / "bin" / "ptxas"), "--version"], capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        record = {
            "tool": "tools/kernel_registers.py",
            "what": "compiler counts (ptxas -v), not GPU measurements",
            "compute_capability": f"{cc[0]}.{cc[1]}",
            "ptxas": ptxas_version,
            "shape": {
                "head_dim": HEAD_DIM,
                "group": GROUP,
                "block_size": BLOCK_SIZE,
                "threads": THREADS,
            },
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "kernels": rows,
        }
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
