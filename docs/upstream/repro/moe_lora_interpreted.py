"""aphrodite's MoE-LoRA half as P13 calls it, on the CPU: exact for batches that mix adapters?

Runs aphrodite's own ``LoRAExpertsMixin.apply_w13_lora`` / ``apply_w2_lora`` (the calls ``Exl3LoRAExperts.apply``
makes) through its real ``PunicaWrapperGPU``, ``LoRAKernelMeta`` and config lookup, with its MoE-LoRA Triton kernels
(``lora/ops/triton_ops/fused_moe_lora_op.py``) executed by Triton's interpreter (``TRITON_INTERPRET=1``), against the
exact float32 deltas: per (token, expert) assignment ``B A x`` for gate/up (one 2I slice, or gate and up apart) and
the router-weighted ``B A act`` for down. What the CPU lacks is replaced: the compiled ``moe_lora_align_block_size``
op by a port of the 0.22+ kernel (every entry of ``lora_ids``), the device queries by an H100's values, and the
kernels' module is executed again with the real ``triton`` (aphrodite's ``triton_utils`` disables it without a
driver). float16 (the interpreter has no bfloat16 arithmetic).

    PYTHONPATH=.cache/aphrodite/0.24.1 .venv/bin/python docs/upstream/repro/moe_lora_interpreted.py 3,16,65,240

Result (2026-12-08, aphrodite-engine 0.24.1, tiny-moe's shapes: hidden 256, 4 experts, top 2, rank 8, max_loras 2):
relative error 2-3e-4 for both forms and every pattern (tokens of no adapter / slot 0 / slot 1 interleaved, in
request-like runs, one adapter only, both slots with expert weights) at 3, 16, 40, 65, 100 and 240 tokens.
"""

import math
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
import aphrodite  # noqa: E402
import aphrodite.utils.torch_utils as torch_utils  # noqa: E402
import torch  # noqa: E402

torch_utils.PIN_MEMORY = False
KERNELS = Path(aphrodite.__file__).parent / "lora/ops/triton_ops/fused_moe_lora_op.py"


def interpreted_kernels():
    """fused_moe_lora_op.py executed again with the real triton (its custom-op registration left out)."""
    src = KERNELS.read_text()
    src = src.replace("from aphrodite.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
    src = src.replace("from .utils import", "from aphrodite.lora.ops.triton_ops.utils import")
    src = src.replace("direct_register_custom_op(", "(lambda *a, **k: None)(")
    folder = Path(tempfile.mkdtemp())
    (folder / "fmlo_interpreted.py").write_text(src)
    sys.path.insert(0, str(folder))
    import fmlo_interpreted as op

    op.async_tensor_h2d = lambda data, dtype, device: torch.tensor(data, dtype=dtype, device=device)
    op.current_platform.num_compute_units = lambda *a: 132
    op.current_platform.get_device_name = lambda *a: "NVIDIA H100 80GB HBM3"
    op.get_max_shared_memory_bytes = lambda *a: 228 * 1024
    return op


def align_op(topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded,
             max_num_m_blocks, sorted_ids, expert_ids, num_tokens_post_pad, adapter_enabled, lora_ids,
             expert_map=None):  # fmt: skip
    """The 0.22+ align kernel's result: every active slot's (token, expert) pairs, per expert, block-padded."""
    flat, k = topk_ids.reshape(-1).tolist(), topk_ids.shape[1]
    rows, blocks = sorted_ids.view(max_loras, -1), expert_ids.view(max_loras, -1)
    for lora in lora_ids.tolist():
        if lora < 0 or lora >= max_loras or not int(adapter_enabled[lora]):
            continue
        rows[lora].fill_(len(flat))
        blocks[lora].fill_(-1)
        start = 0
        for e in range(num_experts):
            pairs = [i for i, x in enumerate(flat) if x == e and int(token_lora_mapping[i // k]) == lora]
            padded = math.ceil(len(pairs) / block_size) * block_size
            if pairs:
                rows[lora, start : start + len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
            blocks[lora, start // block_size : (start + padded) // block_size] = e
            start += padded
        num_tokens_post_pad[lora] = start


op = interpreted_kernels()
import aphrodite.lora.punica_wrapper.punica_gpu as punica  # noqa: E402
from aphrodite.config.lora import LoRAConfig  # noqa: E402
from aphrodite.lora.layers.utils import LoRAMapping  # noqa: E402
from aphrodite.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta  # noqa: E402
from aphrodite.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext  # noqa: E402
from aphrodite.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin  # noqa: E402

punica.fused_moe_lora = op._fused_moe_lora
punica.LoRAKernelMeta = LoRAKernelMeta
punica.ops.moe_lora_align_block_size = align_op


def case(m, slices, mapping, both, e=4, h=256, i=256, k=2, r=8, dtype=torch.float16):
    """(w13 relative error, w2 relative error) of one batch; mapping: 0 none, 1 slot 0, 2 slot 1."""
    g = torch.Generator().manual_seed(m * 7 + slices)
    x = torch.randn(m, h, generator=g).to(dtype)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    w = torch.softmax(torch.randn(m, k, generator=g), -1)
    n = i if slices == 2 else 2 * i
    a13 = tuple(torch.randn(2, e, r, h, generator=g).to(dtype) * 0.05 for _ in range(slices))
    b13 = tuple(torch.randn(2, e, n, r, generator=g).to(dtype) * 0.2 for _ in range(slices))
    a2, b2 = (torch.randn(2, e, r, i, generator=g).to(dtype) * 0.05,), (torch.randn(2, e, h, r, generator=g) * 0.2,)
    b2 = (b2[0].to(dtype),)
    for t in (*a13, *b13, *a2, *b2) if not both else ():
        t[1].zero_()  # slot 1: an adapter without expert weights
    wrapper = punica.PunicaWrapperGPU(1024, 16, "cpu", lora_config=LoRAConfig(max_lora_rank=r, max_loras=2))
    ids = tuple(int(t) for t in mapping)
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), [1, 2], 2, 1024)
    ctx = MoELoRAContext(
        w13_lora_a_stacked=a13, w13_lora_b_stacked=b13, w2_lora_a_stacked=a2, w2_lora_b_stacked=b2,
        adapter_enabled=torch.tensor([1, 1, 0], dtype=torch.int), max_loras=2, top_k=k, w13_num_slices=slices,
        fully_sharded=False, tp_rank=0, tp_size=1, local_num_experts=e, punica_wrapper=wrapper,
        use_tuned_config=False,
    )  # fmt: skip
    mixin = LoRAExpertsMixin()
    w1, w2 = torch.zeros(1, dtype=dtype).expand(e, 2 * i, h), torch.zeros(1, dtype=dtype).expand(e, h, i)
    gate_up = torch.zeros(m, k, 2 * i, dtype=dtype)
    meta = mixin.apply_w13_lora(
        ctx, y=gate_up, x=x, topk_ids=topk, topk_weights=w, expert_map=None, w1=w1, w2=w2, num_tokens=m, top_k_num=k
    )
    act = torch.randn(m * k, i, generator=g).to(dtype)
    down = torch.zeros(m, k, h, dtype=dtype)
    mixin.apply_w2_lora(
        ctx, y=down, x=act, topk_weights=w, sorted_token_ids_lora=meta[0], expert_ids_lora=meta[1],
        num_tokens_post_padded_lora=meta[2], token_lora_mapping=meta[3], num_tokens=m, w1=w1, w2=w2, top_k_num=k,
    )  # fmt: skip
    want13, want2 = torch.zeros(m, k, 2 * i), torch.zeros(m, k, h)
    for t in range(m):
        slot = ids[t] - 1
        for j in range(k) if slot >= 0 else ():
            ex = int(topk[t, j])
            want13[t, j] = torch.cat(
                [b[slot, ex].float() @ (a[slot, ex].float() @ x[t].float()) for a, b in zip(a13, b13)]
            )
            want2[t, j] = w[t, j] * (b2[0][slot, ex].float() @ (a2[0][slot, ex].float() @ act[t * k + j].float()))
    rel = lambda got, want: round(float((got.float() - want).norm() / want.norm().clamp_min(1e-12)), 5)  # noqa: E731
    return rel(gate_up, want13), rel(down, want2)


PATTERNS = {
    "interleaved": (lambda m: [t % 3 for t in range(m)], False),
    "request runs": (lambda m: [(0, 1, 2, 1, 0, 2)[min(5, 6 * t // m)] for t in range(m)], False),
    "one adapter": (lambda m: [1] * m, False),
    "both slots adapted": (lambda m: [(1, 2, 0, 2, 1, 0)[min(5, 6 * t // m)] for t in range(m)], True),
}
if __name__ == "__main__":
    for m in [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "3,16").split(",")]:
        for slices in (1, 2):
            for name, (pattern, both) in PATTERNS.items():
                print(
                    m, "tokens,", slices, "slice(s),", name, "(w13, w2):", case(m, slices, pattern(m), both), flush=True
                )
