"""Which KV cache groups aphrodite flags as the MTP draft's (``is_eagle_group``) for a Qwen3.5/3.6 hybrid, with the
release's own ``get_kv_cache_groups`` (CPU; the config is a stand-in holding only the fields grouping reads).

    PYTHONPATH=.cache/aphrodite/0.24.1 .venv/bin/python docs/upstream/repro/mtp_hybrid_draft_group.py

It prints each group (its spec, layer count, flag, and the MTP layer where it is) for the tiny layout (3 GDN + 1
full attention) and the 27B's (48 + 16), each with the MTP head's one attention layer registered last, as the
drafter's layers are. No group is flagged; the KV cache coordinator then flags every group, the Mamba groups
included (docs/upstream/mtp-hybrid-draft-group.md)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from aphrodite.v1.core import kv_cache_utils
from aphrodite.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

BLOCK = 544  # an attention block size the engine picks so that one attention page holds one GDN state


def specs(layers: int) -> dict:
    """GDN state pages and attention pages of one padded size, the target's layers then the MTP head's."""
    state = dict(shapes=((3, 256), (4, 32, 32)), dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")
    page = max(MambaSpec(block_size=BLOCK, **state).page_size_bytes, 2 * BLOCK * 64 * 2)
    gdn = MambaSpec(block_size=BLOCK, page_size_padded=page, **state)
    attn = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, page_size_padded=page
    )
    out = {
        f"model.layers.{i}.{'self_attn.attn' if i % 4 == 3 else 'linear_attn'}": attn if i % 4 == 3 else gdn
        for i in range(layers)
    }
    out["mtp.layers.0.self_attn.attn"] = attn
    return out


def groups(layers: int) -> list[tuple[str, int, bool, list[str]]]:
    """The release's groups for ``layers`` target layers and the MTP head: (spec class, layer count, flagged as the
    draft's, the MTP layers in it) each."""
    speculative = SimpleNamespace(method="mtp", use_eagle=lambda: True, use_eagle_block_drop=lambda: True)
    config = SimpleNamespace(
        speculative_config=speculative,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: SimpleNamespace(is_block_outermost=False)),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3_5_moe")),
    )
    return [
        (
            type(group.kv_cache_spec).__name__,
            len(group.layer_names),
            bool(getattr(group, "is_eagle_group", False)),
            [n for n in group.layer_names if n.startswith("mtp.")],
        )
        for group in kv_cache_utils.get_kv_cache_groups(config, specs(layers))
    ]


def main() -> None:
    for layers in (4, 64):
        for i, (kind, count, flagged, mtp) in enumerate(groups(layers)):
            print(f"{layers} layers: group {i} {kind} x{count} {'draft' if flagged else '-'} {mtp}")


if __name__ == "__main__":
    main()
