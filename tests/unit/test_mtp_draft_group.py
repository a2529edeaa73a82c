"""docs/upstream/mtp-hybrid-draft-group.md on each release's real KV cache grouping (CPU): with method=mtp on a
Qwen3.5/3.6 hybrid, the MTP head's attention layer shares the target's attention group and no group is flagged as
the draft's (the coordinator's fallback that then flags every group, the GDN groups included, is read from its source
in the write-up, not run here). A release that flags the right group fails here: the write-up must then say which
release fixed it."""

from __future__ import annotations

import pytest

from helpers import needs_aphrodite, upstream_repro


def repro():
    return upstream_repro("mtp_hybrid_draft_group")


@needs_aphrodite
@pytest.mark.parametrize("layers, attention_width", [(4, 2), (64, 17)])
def test_no_group_is_the_mtp_draft_s_so_the_gdn_groups_lose_their_hits(layers, attention_width):
    groups = repro().groups(layers)
    assert [flagged for _, _, flagged, _ in groups] == [False] * len(groups)
    mamba = [g for g in groups if g[0] == "MambaSpec"]
    holding = [g for g in groups if g[3]]
    assert mamba and len(holding) == 1
    kind, count, _, mtp = holding[0]
    # beside the target's own attention layers: only this group needs the draft's block drop
    assert kind == "FullAttentionSpec" and count == attention_width and mtp == ["mtp.layers.0.self_attn.attn"]
