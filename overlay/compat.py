"""What each aphrodite-engine release does with an EXL3 hybrid, as doctor and the docs read it: the releases tested,
the activation dtypes EXL3 serves in, and where an EXL3 MoE hybrid serves with this overlay installed (the one table
that docs/evidence.md's "Where EXL3 MoE serves", written from it by ci/readme_tables.py, and doctor's
``moe-release`` check read). Each MoE entry names the GPU runs that showed it (docs/gpu-runs/, one record per run);
a release no GPU run has served is "not run", never assumed.

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


# The releases the CPU suite runs against (ci/test.sh's lanes, 0.24.0 on request) and the overlay's patches were
# written for; doctor warns when it plans for any other.
TESTED_RELEASES = ("0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.24.1")
NEWEST_TESTED = TESTED_RELEASES[-1]

# The activation dtypes an EXL3 checkpoint may be served in: Exl3Config.get_supported_act_dtypes returns
# [torch.half, torch.bfloat16] on every tested release (aphrodite/model_executor/layers/quantization/exl3.py: 0.20.0
# line 336, 0.21.0 line 359, 0.22.0 and 0.23.0 line 365, 0.24.1 line 374), and the engine's config check refuses any
# other at start-up: "torch.float32 is not supported for quantization method exl3. Supported dtypes: [torch.float16,
# torch.bfloat16]" (aphrodite/config/aphrodite.py: 0.20.0 line 530, 0.21.0 539, 0.22.0 660, 0.23.0 689, 0.24.1 775).
# tests/unit/test_compat.py compares it with the installed release's Exl3Config.
EXL3_ACT_DTYPES: dict[str, tuple[str, ...]] = {v: ("float16", "bfloat16") for v in TESTED_RELEASES}


def is_tested(version: str | None) -> bool:
    """Whether ``version`` is a release the overlay is tested against."""
    return version in TESTED_RELEASES


def exl3_act_dtypes(version: str | None) -> tuple[str, ...]:
    """The activation dtypes ``version`` serves EXL3 in (the newest tested release's for one outside the table)."""
    return EXL3_ACT_DTYPES.get(version or "", EXL3_ACT_DTYPES[NEWEST_TESTED])


def moe_serving(version: str | None) -> MoeServing | None:
    """The entry for an installed release; None where aphrodite is not installed or the release is not listed."""
    return MOE_SERVING.get(version or "")
