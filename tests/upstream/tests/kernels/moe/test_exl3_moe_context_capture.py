# SPDX-License-Identifier: Apache-2.0
"""EXL3 routed experts can be captured in a CUDA graph when every eager call before it was padding (drop-in for
aphrodite's tests/kernels/moe/).

Since 0.23.0 every row of a warm-up or profiling batch carries expert id -1 (APHRODITE_MOE_SKIP_PADDING), and
since 0.24.0 ops.exl3_moe returns before it prepares exllamav3's device context when no expert has work
(``num_active == 0``, exl3_moe.cu). A process whose only eager exllamav3 calls were padded EXL3 MoE calls
therefore allocates that context (cudaMalloc + cudaMemset of the kernel's locks, shared with exl3_gemm /
exl3_gemv) inside the first capture, which invalidates it: "operation failed due to a previous error during
capture ... exl3_moe.cu" (0.24.1 on an H200). aphrodite's warm-ups and captures are padded exactly so; in a served
model the dense EXL3 layers' GEMM usually allocates the context first, and this case isolates the experts from
that. The device context is per process: each case runs in a fresh one, loaded and called as the engine's worker
does (plugins loaded, ``process_weights_after_loading``, a padded warm-up, then the capture), and the captured
graph, replayed on real routing, must give the eager answer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exl3_moe_layer import routers_mark_padding

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="EXL3 MoE kernels and CUDA graphs need CUDA"),
    pytest.mark.skipif(
        not routers_mark_padding(),
        reason="this release's warm-up batches route real experts (padding rows get expert id -1 from 0.23.0)",
    ),
]

CASE = r"""
import json, sys
import torch
from aphrodite.plugins import load_general_plugins
load_general_plugins()  # as every worker does before it loads the model
sys.path.insert(0, sys.argv[1])
from exl3_moe_layer import EXPERTS, HIDDEN, TOP_K, exl3_moe_apply

rows = int(sys.argv[2])
apply = exl3_moe_apply()
g = torch.Generator(device="cuda").manual_seed(3)
x = torch.randn(rows, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
weights = torch.rand(rows, TOP_K, generator=g, device="cuda")
real = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:TOP_K] for _ in range(rows)])
ids = torch.full_like(real, -1)  # the static routing buffer, all padding as aphrodite captures it
result = {}
try:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply(x, weights, ids)  # aphrodite's warm-up pass: padding rows only
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = apply(x, weights, ids)
    ids.copy_(real)
    graph.replay()
    torch.cuda.synchronize()
    eager = apply(x, weights, real).float()  # only now: an eager call with work would prepare the context
    result["error"] = float((captured.float() - eager).norm() / eager.norm())
except Exception as exc:
    result["raised"] = f"{type(exc).__name__}: {exc}"[:600]
print("RESULT " + json.dumps(result))
"""


def _run_case(rows: int) -> dict:
    """The case in a fresh process (exllamav3's device context is per process)."""
    here = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-c", CASE, str(here), str(rows)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise AssertionError(f"the case process ended with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][7:])


@pytest.mark.parametrize("rows", [200])
def test_exl3_moe_captures_after_padded_warmups_only(rows):
    """200 rows: the batched path (the fused kernel), the size of a prefill batch aphrodite captures."""
    result = _run_case(rows)
    assert "raised" not in result, f"capturing after padded warm-ups only: {result['raised']}"
    assert result["error"] < 2e-2, f"{rows} rows: the replayed graph is {result['error']:.3f} away from eager"
