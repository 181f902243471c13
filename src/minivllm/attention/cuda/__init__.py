"""Chapter 08's CUDA paged attention (numba-cuda): kernels, their launcher and the engine backend.

Importing this package first imports `simulator`, which switches numba's CUDA simulator on when
torch sees no GPU. That must happen before anything imports `numba.cuda`, so every module here is
reached through this package.
"""

from minivllm.attention.cuda import simulator  # noqa: F401  (first: it sets NUMBA_ENABLE_CUDASIM)
