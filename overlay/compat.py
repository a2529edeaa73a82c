"""Where an EXL3 MoE hybrid serves, per aphrodite-engine release, with this overlay installed: the one table that
docs/evidence.md's "Where EXL3 MoE serves" (written from it by ci/readme_tables.py) and doctor's ``moe-release`` check
read. Each entry names the GPU runs that showed it (docs/gpu-runs/, one record per run); a release no GPU run has
served is "not run", never assumed.

Kinds: ``compiled`` (the default compiled mode serves, so eager does too), ``eager`` (only with
``--enforce-eager``), ``none`` (does not start), ``not run`` (no GPU run with this release)."""

from __future__ import annotations

from typing import NamedTuple


class MoeServing(NamedTuple):
    kind: str
    evidence: str
    same_as: str | None = None  # a release whose sources this one shares and whose GPU runs stand for it


MOE_SERVING: dict[str, MoeServing] = {
    "0.20.0": MoeServing("not run", "CPU suite only"),
    "0.21.0": MoeServing(
        "compiled", "LoRA off and on, alone and 16 at once, within 0.003 of HF + PEFT; H200, runs 14 and 16"
    ),
    "0.22.0": MoeServing("not run", "CPU suite only"),
    "0.23.0": MoeServing("not run", "CPU suite only"),
    "0.24.0": MoeServing(
        "compiled", "as 0.24.1, whose Python sources and kernel library it shares; not run itself", same_as="0.24.1"
    ),
    "0.24.1": MoeServing(
        "compiled",
        "LoRA off and on, alone and 16 at once, within 0.032 of HF + PEFT; H200, run 16 (eager within 0.028 on "
        "2026-12-02)",
    ),
}
# the releases a GPU run itself served in the default compiled mode
SERVED = [v for v, s in MOE_SERVING.items() if s.kind == "compiled" and s.same_as is None]


def moe_serving(version: str | None) -> MoeServing | None:
    """The entry for an installed release; None where aphrodite is not installed or the release is not listed."""
    return MOE_SERVING.get(version or "")
