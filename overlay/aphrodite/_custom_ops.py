"""P14: the MoE-LoRA align kernel of 0.20 - 0.21 skips the last adapter slot of a batch that holds base tokens.

Target: ``aphrodite/_custom_ops.py`` ``moe_lora_align_block_size`` (the kernel: ``csrc/moe/moe_align_sum_kernels.cu``).

Why:     The punica wrapper hands the op ``lora_ids``: ``LoRAKernelMeta.active_lora_ids``, max_loras + 1 entries, the
         batch's distinct slots sorted (-1 for base-model tokens first), -1 after. The 0.20 - 0.21 kernel library
         launches one block (two in its large-batch form, one sort row) for each of the first ``max_loras`` entries
         only. A batch holding base-model tokens and ``max_loras`` adapters (with ``--max-loras 1``: any adapter beside
         base requests) has the ids [-1, 0, ..., max_loras - 1]: the last slot is never aligned, its rows of
         ``sorted_token_ids`` / ``expert_ids`` / ``num_tokens_post_pad`` stay as ``torch.empty`` left them, and the
         fused MoE-LoRA kernels, which walk every active id, read them: that adapter's expert deltas are dropped or
         read at garbage expert ids, wrong tokens or an illegal memory access (docs/upstream/moe-lora-align-grid.md).
         vLLM #32235, fixed there by #40131 (grid ``max_loras + 1``); aphrodite 0.22.0+ build their MoE ops from
         ``csrc/libtorch_stable`` (``_moe_C_stable_libtorch``, dphnAI/sonar 9163801a7, 2026-07-03), launched so.
How:     the op is given ``lora_ids`` with the active slots first, in their order, and every -1 after (a stable sort
         on the device: no host sync, so CUDA graphs capture it and replay it on each batch's ids). The first
         ``max_loras`` entries then hold every slot the batch uses; the kernels after the op read the original ids.
         Neutral for a kernel that reads all entries.
Probe:   the launch is compiled, but which library holds it is plain source: the CUDA platform's ``import_kernels``
         loads ``aphrodite._moe_C_stable_libtorch`` (0.22+: UPSTREAM_FIXED) or ``aphrodite._moe_C`` (0.20 - 0.21:
         buggy); anything else is drift. Read from the platform modules' files, which cannot be imported without
         the compiled kernels.
Upstream: fixed in 0.22.0; the backport for 0.20 - 0.21 is patches/0014-moe-lora-align-grid.patch.
Retire when: 0.22.0 is the oldest supported release.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from hybrid_exl3_fixes.registry import Drift, Live, Patch, Target, tag, tags_of

PARAMS = (
    "topk_ids",
    "token_lora_mapping",
    "num_experts",
    "block_size",
    "max_loras",
    "max_num_tokens_padded",
    "max_num_m_blocks",
    "sorted_token_ids",
    "experts_ids",
    "num_tokens_post_pad",
    "adapter_enabled",
    "lora_ids",
    "expert_map",
)
ALIGN = Target("aphrodite._custom_ops", "moe_lora_align_block_size", params=PARAMS)
LORA_IDS = PARAMS.index("lora_ids")

# the extension each kernel library is loaded as (CudaPlatform.import_kernels, or Platform's where CUDA has none)
FIXED_LIBRARY = "aphrodite._moe_C_stable_libtorch"  # 0.22+: launches max_loras + 1 blocks
OLD_LIBRARY = "aphrodite._moe_C"  # 0.20 - 0.21: max_loras blocks
PLATFORM_MODULES = ("aphrodite.platforms.cuda", "aphrodite.platforms.interface")


def moe_kernel_library() -> str | None:
    """The extension aphrodite's CUDA platform loads its MoE ops from, as its source names it; None if none."""
    for module in PLATFORM_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            continue
        try:
            text = Path(spec.origin).read_text(encoding="utf-8")
        except OSError:
            continue
        names = re.findall(r"^\s*import (aphrodite\._moe_C\w*)", text, re.MULTILINE)
        if names:
            return names[0]
    return None


def active_slots_first(lora_ids):
    """``lora_ids`` with its non-negative entries first, in order, and its -1 entries after (same length, device and
    dtype; a new tensor)."""
    import torch

    order = torch.sort((lora_ids < 0).to(torch.int8), stable=True).indices
    return lora_ids.index_select(0, order)


def probe_align_grid(live: dict[str, Live]) -> bool:
    """True = the installed kernel library launches the align kernel over the first ``max_loras`` ids only."""
    if "P14" in tags_of(live[ALIGN.key].raw):
        return False
    library = moe_kernel_library()
    if library == FIXED_LIBRARY:
        return False
    if library == OLD_LIBRARY:
        return True
    raise Drift(f"the CUDA platform loads its MoE ops from {library or 'no extension it names'}, neither "
                f"{OLD_LIBRARY} (0.20 - 0.21) nor {FIXED_LIBRARY} (0.22+)")  # fmt: skip


def build_align(original: Any) -> Any:
    """``moe_lora_align_block_size`` that hands the kernel every active slot within its first ``max_loras`` ids."""

    def moe_lora_align_block_size(*args, **kwargs):
        if "lora_ids" in kwargs:
            kwargs["lora_ids"] = active_slots_first(kwargs["lora_ids"])
        elif len(args) > LORA_IDS:
            args = (*args[:LORA_IDS], active_slots_first(args[LORA_IDS]), *args[LORA_IDS + 1 :])
        return original(*args, **kwargs)

    return tag("P14", moe_lora_align_block_size, original)


PATCH = Patch(
    id="P14",
    slug="moe-lora-align-grid",
    title="MoE LoRA (0.20 - 0.21 kernels): the align kernel given every active adapter slot within its max_loras "
    "blocks, so the last slot of a batch with base-model tokens keeps its expert deltas",
    upstream="fixed in 0.22.0 (vLLM #40131, in dphnAI/sonar 9163801a7); backport: "
    "patches/0014-moe-lora-align-grid.patch",
    fixed_in="0.22.0",
    retire_when="0.22.0 is the oldest supported release",
    targets=(ALIGN,),
    probe=probe_align_grid,
    build=lambda live: {ALIGN.key: build_align(live[ALIGN.key].function)},
    checks_tag_after_apply=True,
    symptom="MoE LoRA beside base-model requests: the last adapter slot's expert deltas dropped or read at wrong "
    "expert ids",
)
