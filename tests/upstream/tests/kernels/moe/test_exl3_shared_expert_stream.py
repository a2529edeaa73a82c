# SPDX-License-Identifier: Apache-2.0
"""An EXL3 shared expert is not overlapped on the auxiliary stream (drop-in for aphrodite's
tests/kernels/moe/).

EXL3's GEMMs are cooperative kernels that order their split-K partial sums through one lock array per
device (DevCtx::get_locks, barrier_acquire in csrc/quantization/exl3/exllamav3_ext/quant/exl3_gemm_inner.cuh),
so a shared expert's exl3_gemm on the auxiliary stream beside the routed experts' exl3_mgemm spins on the
same locks. Exl3MoEMethod declares supports_shared_expert_overlap = False; since 0.21.0 nothing reads it.
"""

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the auxiliary stream exists on CUDA only")


def _shared_experts():
    from aphrodite.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    shared = object.__new__(SharedExperts)
    expert = torch.nn.Module()
    down = torch.nn.Module()
    # a loaded EXL3 linear as Exl3LinearMethod registers it: its trellis placeholder
    down.trellis = torch.nn.Parameter(torch.empty(0, dtype=torch.int16), requires_grad=False)
    expert.down_proj = down
    config = SimpleNamespace(
        enable_eplb=False,
        all2all_backend="allgather_reducescatter",
        use_fi_nvl_two_sided_kernels=False,
        dp_size=1,
        tp_size=1,
    )
    shared.__dict__.update(
        _layer=expert,
        _moe_config=SimpleNamespace(moe_parallel_config=config, disable_inplace=True),
        # what Exl3MoEMethod answers
        _quant_method=SimpleNamespace(supports_shared_expert_overlap=False, mk_owns_shared_expert=False),
        _mk_can_overlap_shared_experts=lambda: False,
        _stream=torch.cuda.Stream(),
        enable_dbo=False,
    )
    return shared


@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_exl3_shared_expert_runs_on_the_main_stream(tokens):
    from aphrodite.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    hidden = torch.zeros(tokens, 64, device="cuda")
    assert _shared_experts()._determine_shared_experts_order(hidden) == SharedExpertsOrder.NO_OVERLAP
