"""P3's decisions, torch-free: which layer owns each small-batch EXL3 GEMM cache key, and what the runtime probe's
relative errors say about the installed kernel (docs/upstream/exl3-gemm-codebook-cache.md). The kernel facts they
rest on are in exl3_kernels.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from .exl3_kernels import SAME, GemmKey

# a wrong codebook gives a relative error of about 1.4 (3INST) to 1.6 (mul1): anything above this is the other answer
DIFFERENT = 0.5


@dataclass
class Planner:
    """Which codebook owns each exl3_gemm cache key in this process.

    The first layer (or the probe) that claims a key owns it and keeps the native, cached path;
    a later layer with the same key and another codebook is routed around the cache. Since only
    owners ever call the cached path, the cache entry is the owner's whatever order the layers
    first run in."""

    owners: dict[GemmKey, tuple[str, str]] = field(default_factory=dict)  # key -> (codebook, owner)
    routed: list[str] = field(default_factory=list)

    def conflicts_with(self, key: GemmKey, codebook: str) -> tuple[str, str] | None:
        owner = self.owners.get(key)
        return owner if owner is not None and owner[0] != codebook else None

    def claim(self, key: GemmKey, codebook: str, name: str) -> tuple[str, str] | None:
        """Claim ``key`` for ``codebook``; returns the conflicting owner, or None (owner now or before)."""
        conflict = self.conflicts_with(key, codebook)
        if conflict is None:
            self.owners.setdefault(key, (codebook, name))
        else:
            self.routed.append(name)
        return conflict


@dataclass(frozen=True)
class ProbeVerdict:
    codebook_blind: bool | None  # None: the kernels answered neither way; route nothing
    forced_ok: bool
    detail: str


def read_probe(errors: dict[str, float]) -> ProbeVerdict:
    """Decide from the probe's relative errors (all at <= 32 rows, one key, run in this order:
    ``first`` (mcg), then ``second`` (mul1) against its own and against the first codebook's
    reference, then ``forced_<codebook>`` for each codebook through the uncached path)."""
    detail = ", ".join(f"{k}={v:.3g}" for k, v in errors.items())
    forced_ok = all(v < SAME for k, v in errors.items() if k.startswith("forced_")) and any(
        k.startswith("forced_") for k in errors
    )
    if errors["first"] >= SAME:
        return ProbeVerdict(
            None, forced_ok, "the first small-batch GEMM already disagrees with the reconstruct path: " + detail
        )
    if errors["second"] < SAME:
        return ProbeVerdict(False, forced_ok, detail)
    if errors["second"] > DIFFERENT and errors["second_vs_first"] < SAME:
        return ProbeVerdict(True, forced_ok, detail)
    return ProbeVerdict(None, forced_ok, "the second codebook matched neither reference: " + detail)
