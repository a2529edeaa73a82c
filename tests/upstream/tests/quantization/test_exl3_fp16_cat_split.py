# SPDX-License-Identifier: Apache-2.0
"""Float16 shard outputs of a fused EXL3 projection are not joined by a bare torch.cat
(drop-in for aphrodite's tests/quantization/).

A bare cat followed by the GDN split lets Inductor rewrite split(cat([a, b])) to [a, b], which
changes the strides a piecewise graph hands to the next piece (illegal memory access in the
compiled engine with float16 activations). Runs on the meta device: no GPU needed.
"""

from types import SimpleNamespace

import pytest
import torch
from aphrodite.model_executor.layers.quantization.exl3 import Exl3Config, Exl3LinearMethod
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def fused_in_proj_qkvz():
    def store(make):
        return SimpleNamespace(exl3_tensors={shard: make() for shard in ((0, 1, 2), 3)})

    return SimpleNamespace(
        exl3_can_mgemm=False,
        exl3_shard_ids=[(0, 1, 2), 3],
        mcg=SimpleNamespace(exl3_tensors={}),
        mul1=SimpleNamespace(exl3_tensors={}),
        trellis=store(lambda: torch.empty(16, 8, 64, dtype=torch.int16, device="meta")),
        suh=store(lambda: torch.empty(256, dtype=torch.float16, device="meta")),
        svh=store(lambda: torch.empty(128, dtype=torch.float16, device="meta")),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_shard_outputs_are_not_a_bare_cat(dtype):
    method = Exl3LinearMethod(Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    layer, x = fused_in_proj_qkvz(), torch.empty(4, 256, dtype=dtype, device="meta")
    with RecordOps() as record:
        out = method.apply(layer, x)
    assert out.shape == (4, 256) and out.dtype == dtype
    last_kernel = max(i for i, op in enumerate(record.ops) if "exl3_linear_one" in op)
    produced = [op for op in record.ops[last_kernel + 1 :] if op not in VIEWS]
    assert produced[-1] != "aten.cat.default", record.ops
