"""libcuda stub builder for JIT links on WSL2 and conda CUDA (``make stubs``, ``hybrid-exl3-fixes stubs``).

Why: flashinfer's JIT (0.6.x/0.7.x, ``flashinfer/jit/cpp_ext.py``) links with
``-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda`` plus ``$FLASHINFER_EXTRA_LDFLAGS``.
conda-forge keeps the stub in ``lib/stubs`` or ``targets/x86_64-linux/lib/stubs`` (no lib64), and
WSL2's driver lives in ``/usr/lib/wsl/lib`` where ``ld -l`` never looks: ``cannot find -lcuda``.
How: find a real stub (or generate one from ``cuda.h``) and put it, alone, in a folder of its own
that nothing else uses, with an ``env.sh`` that points ``LIBRARY_PATH`` and
``FLASHINFER_EXTRA_LDFLAGS`` at it. Nothing existing is touched.

Facts relied on (read from flashinfer 0.6/0.7's ``jit/cpp_ext.py``, binutils' ld and the CUDA driver's
``cuInit``; checked on the GPU machine, docs/stubs.md):
- a stub must have SONAME ``libcuda.so.1`` so programs linked against it load the driver at run time;
- the folder must hold only ``libcuda.so`` (no ``.so.1``) and must never be on LD_LIBRARY_PATH: it
  would shadow the driver (cuInit returns 34, CUDA_ERROR_STUB_LIBRARY);
- gcc reads LIBRARY_PATH; conda's cross-built compilers ignore it, hence FLASHINFER_EXTRA_LDFLAGS;
- triton finds WSL's driver via ``ldconfig -p`` or ``TRITON_LIBCUDA_PATH``;
- no pip wheel ships a libcuda stub; the toolkit, the ``nvidia-cuda-runtime`` wheels and triton ship
  ``cuda.h``, from which a stub exporting the driver API (with the ``_v2``/``_ptds`` names) can be made.
"""

from .builder import BuildError, StubResult, build_stubs, cuda_prefixes, find_cuda_headers, find_stub_candidates

__all__ = ["BuildError", "StubResult", "build_stubs", "cuda_prefixes", "find_cuda_headers", "find_stub_candidates"]
