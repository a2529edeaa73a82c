"""The registry (overlay/registry.py) on the real aphrodite-engine modules and on stand-in patches (CPU): probes
before and after apply, apply twice, undo last in first out, the off switch, releases with the fix left alone, the
apply order ``Patch.after`` declares, and the tag a probe reads."""

from __future__ import annotations

import pytest

from helpers import APHRODITE_VERSION, NO_KERNELS, needs_aphrodite, needs_buggy, needs_fixed


@needs_buggy
def test_probes_report_the_bugs_and_apply_clears_them(overlay):
    # P3 and P8: test_p3_gemm_cache.py, test_p8_kernel_choice.py
    results = [r for r in overlay.apply_all() if r.patch.id not in ("P3", "P8")]
    assert [(r.patch.id, r.status.value) for r in results] == [
        ("P1", "APPLIED"),
        ("P2", "APPLIED"),
        ("P2b", "APPLIED"),
        ("P4", "APPLIED"),
        ("P5", "APPLIED"),
        ("P6", "UPSTREAM_FIXED" if APHRODITE_VERSION == "0.20.0" else "APPLIED"),
        ("P9", "NOT_APPLICABLE"),  # 0.20/0.21 never give padding rows expert id -1; applied before P7 (it wraps P9)
        ("P7", "APPLIED"),
        ("P10", "NOT_APPLICABLE"),  # 0.20/0.21 route every warm-up row to a real expert
        ("P11", "APPLIED"),
        ("P12", "NOT_APPLICABLE"),  # 0.20/0.21 rebuild above 32 rows (test_p12_mid_batch.py)
        ("P13", "NOT_APPLICABLE"),  # an opt-in (test_p13_moe_expert_lora.py)
        ("P14", "APPLIED"),  # the MoE-LoRA align kernel of 0.20/0.21 (test_p14_custom_ops.py)
        ("P15", "APPLIED"),  # prompt logprobs before the GPU drafter, every release (test_p15_gpu_model_runner.py)
        ("P16", "APPLIED"),  # the EXL3 MoE small-batch loop over tokens, every release (test_p16_moe_small_batch.py)
    ]
    results = [r for r in results if r.status.value == "APPLIED"]
    # the registry re-probes after patching; here the probes are asked directly as well
    from hybrid_exl3_fixes.registry import Registry

    for result in results:
        live = {t.key: Registry._resolve(t) for t in result.patch.targets}
        assert result.patch.probe(live) is False


@needs_buggy
def test_second_apply_changes_nothing_and_undo_restores_originals(overlay):
    from aphrodite.lora.layers import base_linear, fused_moe, utils
    from aphrodite.model_executor.layers.quantization import exl3

    originals = {
        "shard_ids": vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"],
        "utils": utils._get_lora_device,
        "base_linear": base_linear._get_lora_device,
        "fused_moe": fused_moe._get_lora_device,
        "weight": vars(base_linear.BaseLinearLayerWithLoRA)["weight"],
    }

    def current():
        return {
            "shard_ids": vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"],
            "utils": utils._get_lora_device,
            "base_linear": base_linear._get_lora_device,
            "fused_moe": fused_moe._get_lora_device,
            "weight": vars(base_linear.BaseLinearLayerWithLoRA)["weight"],
        }

    overlay.apply_all()
    first = current()
    assert all(first[k] is not originals[k] for k in originals)
    assert first["utils"] is first["base_linear"] is first["fused_moe"]
    overlay.apply_all()
    assert current() == first and all(current()[k] is first[k] for k in first)
    # a fresh registry in the same process (module reloaded, state lost) sees the tags
    from hybrid_exl3_fixes.registry import Registry

    fresh = Registry(overlay.PATCHES)
    # (P3 and P8 have nothing to patch in this CI tree: no compiled kernels; see test_p3_gemm_cache.py)
    applied = overlay.REGISTRY.applied_ids()
    again = {fresh.apply(p).reason for p in overlay.PATCHES if p.id not in ("P3", "P8") and p.id in applied}
    assert again == {"already patched in this process"}
    assert all(current()[k] is first[k] for k in first)

    newest = ["P16", "P15", "P14", "P11", "P7"]
    assert overlay.undo_all() == newest + (["P6"] if APHRODITE_VERSION != "0.20.0" else []) + [
        "P5",
        "P4",
        "P2b",
        "P2",
        "P1",
    ]
    assert all(current()[k] is originals[k] for k in originals)
    assert overlay.undo_all() == []


@needs_buggy
def test_disable_switch(overlay, monkeypatch):
    from aphrodite.model_executor.layers.quantization import exl3

    original = vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"]
    monkeypatch.setenv("HYBRID_EXL3_FIXES_DISABLE", "P1")
    results = {r.patch.id: r.status.value for r in overlay.apply_all()}
    assert results == {
        "P1": "DISABLED",
        "P2": "APPLIED",
        "P2b": "APPLIED",
        "P3": NO_KERNELS,
        "P8": NO_KERNELS,
        "P12": "NOT_APPLICABLE",  # 0.20/0.21 have no 144-row threshold
        "P4": "APPLIED",
        "P5": "APPLIED",
        "P6": "UPSTREAM_FIXED" if APHRODITE_VERSION == "0.20.0" else "APPLIED",
        "P7": "APPLIED",
        "P9": "NOT_APPLICABLE",  # 0.20/0.21 never give padding rows expert id -1
        "P10": "NOT_APPLICABLE",  # nor do they skip idle exl3_moe launches
        "P13": "NOT_APPLICABLE",  # an opt-in
        "P11": "APPLIED",
        "P14": "APPLIED",
        "P15": "APPLIED",
        "P16": "APPLIED",
    }
    assert vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"] is original
    overlay.undo_all()
    overlay.REGISTRY.results.clear()
    monkeypatch.setenv("HYBRID_EXL3_FIXES_DISABLE", "1")
    assert {r.status.value for r in overlay.apply_all()} == {"DISABLED"}


@needs_fixed
def test_fixed_release_is_left_alone(overlay):
    from aphrodite.lora.layers import base_linear, fused_moe, utils
    from aphrodite.model_executor.layers.quantization import exl3

    before = (
        vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"],
        utils._get_lora_device,
        base_linear._get_lora_device,
        fused_moe._get_lora_device,
    )
    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P1"].status.value == "UPSTREAM_FIXED", results["P1"].reason
    assert results["P1"].replaced == []
    assert vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"] is before[0]
    # P2 stays for EXL3 MoE layers (#1712 fixed dense ones only), at all three binding sites; a dense
    # layer still gets upstream's own answer
    assert results["P2"].status.value == "APPLIED", results["P2"].reason
    assert utils._get_lora_device is base_linear._get_lora_device is fused_moe._get_lora_device is not before[1]
    from hybrid_exl3_fixes.shared import fake_exl3_layer

    def outcome(fn, layer):
        try:
            return fn(layer)
        except Exception as exc:  # noqa: BLE001 - compared below
            return f"{type(exc).__name__}: {exc}"

    assert outcome(before[1], fake_exl3_layer()) == outcome(utils._get_lora_device, fake_exl3_layer())
    # P2b, P4, P5, P6 and P7 are still needed there (0.24.1 has the same weight property, apply, MoE LoRA
    # wrapper, shared-expert stream choice and capture shortcut in the EXL3 MoE apply)
    assert {results[p].status.value for p in ("P2b", "P4", "P5", "P6", "P7")} == {"APPLIED"}
    # P9 from 0.23.0 (padding rows' expert id -1); 0.22.0's routers do not give it
    padding_ids = APHRODITE_VERSION != "0.22.0"
    assert results["P9"].status.value == ("APPLIED" if padding_ids else "NOT_APPLICABLE"), results["P9"].reason
    # P10 from 0.24.0 (exl3_moe skips idle launches); 0.22/0.23 launch the kernel whatever the rows
    skips_idle = APHRODITE_VERSION not in ("0.22.0", "0.23.0")
    assert results["P10"].status.value == ("APPLIED" if skips_idle else "NOT_APPLICABLE"), results["P10"].reason
    # P11 on every release (each reads lm_head.weight; 0.24+ reach it for Qwen3.5/3.6)
    assert results["P11"].status.value == "APPLIED", results["P11"].reason
    # P12: an opt-in until measured end to end (test_p12_mid_batch.py: applied on 0.24+ when opted in)
    assert results["P12"].status.value == "NOT_APPLICABLE" and "opt-in" in results["P12"].reason
    # P13: an experimental opt-in (test_p13_moe_expert_lora.py: applied on 0.21+ when opted in)
    assert results["P13"].status.value == "NOT_APPLICABLE" and "opt-in" in results["P13"].reason
    # P14: 0.22+ load the MoE kernels built from csrc/libtorch_stable, which align every active LoRA slot
    assert results["P14"].status.value == "UPSTREAM_FIXED", results["P14"].reason
    # P15 on every release (the GPU drafter runs before the prompt logprobs are read)
    assert results["P15"].status.value == "APPLIED", results["P15"].reason
    # P16 on every release (the small-batch path loops over the tokens)
    assert results["P16"].status.value == "APPLIED", results["P16"].reason
    applied = 9 + padding_ids + skips_idle
    assert f"hybrid-exl3-fixes: applied={applied} upstream_fixed=2 drifted=0" in overlay.summary(list(results.values()))
    assert f"(aphrodite {APHRODITE_VERSION})" in overlay.summary(list(results.values()))


def test_undo_is_last_in_first_out(overlay):
    """One undo stack across patches: a patch under later ones is not undone (UndoOrder, nothing changed), and
    undo_all restores them newest first."""
    from hybrid_exl3_fixes.registry import UndoOrder

    overlay.apply_all()
    applied = overlay.REGISTRY.applied_ids()
    if len(applied) < 2:
        pytest.skip(f"aphrodite {APHRODITE_VERSION}: fewer than two patches applied ({applied})")
    first = next(p for p in overlay.PATCHES if p.id == applied[0])
    with pytest.raises(UndoOrder, match=f"{first.id} cannot be undone while"):
        overlay.REGISTRY.undo(first)
    assert overlay.REGISTRY.applied_ids() == applied
    assert overlay.undo_all() == applied[::-1]
    assert overlay.REGISTRY.applied_ids() == []


@needs_aphrodite  # the registry applies nothing where aphrodite is not installed (NOT_APPLICABLE)
def test_the_patches_that_check_a_tag_after_apply_say_so():
    """P3, P8, P9, P10, P12, P13, P14, P15 and P16 recognise themselves after apply by the tag on the replaced function
    (their bug is in a GPU kernel's inputs, P15's in CUDA graph memory); their APPLIED result says that the check read
    a tag, not behaviour."""
    import hybrid_exl3_fixes as overlay
    from helpers import stand_in_patch
    from hybrid_exl3_fixes.registry import Registry

    tagged = {"P3", "P8", "P9", "P10", "P12", "P13", "P14", "P15", "P16"}
    assert {p.id for p in overlay.PATCHES if p.checks_tag_after_apply} == tagged
    patch, _ = stand_in_patch(globals(), "TagOwner", id="PT", checks_tag_after_apply=True)
    result = Registry([patch]).apply(patch)
    assert result.status.value == "APPLIED" and "checked after apply by its tag, not by behaviour" in result.reason


def test_the_apply_order_is_patch_id_order_but_where_after_says_otherwise():
    import hybrid_exl3_fixes as overlay
    from hybrid_exl3_fixes.registry import patch_number

    ids = [p.id for p in overlay.PATCHES]
    for patch in overlay.PATCHES:
        assert all(ids.index(a) < ids.index(patch.id) for a in patch.after), (patch.id, patch.after)
    # the patches that share a target with an earlier one name it, and no other reorders the list
    assert {p.id: p.after for p in overlay.PATCHES if p.after} == {
        "P7": ("P9",),
        "P8": ("P3",),
        "P12": ("P3", "P8"),
        "P13": ("P10",),
    }
    moved = [i for i in ids if overlay.PATCHES[ids.index(i)].after]
    rest = [i for i in ids if i not in moved]
    assert rest == sorted(rest, key=patch_number)


def test_in_apply_order_refuses_an_unknown_or_circular_after():
    from helpers import stand_in_patch
    from hybrid_exl3_fixes.registry import in_apply_order

    a, _ = stand_in_patch(globals(), "OrderA", id="PA", after=("PB",))
    b, _ = stand_in_patch(globals(), "OrderB", id="PB")
    assert [p.id for p in in_apply_order([a, b])] == ["PB", "PA"]
    with pytest.raises(ValueError, match="names no known patch: PB"):
        in_apply_order([a])
    c, _ = stand_in_patch(globals(), "OrderC", id="PB", after=("PA",))
    with pytest.raises(ValueError, match="cycle"):
        in_apply_order([a, c])


def test_a_probe_reads_its_tag_through_the_public_tags_of():
    """tags_of reads the patch ids on a replacement and on every function it wraps, whatever its kind."""
    from hybrid_exl3_fixes.registry import tag, tags_of

    def original():
        pass

    inner = tag("PI", lambda: None, original)
    outer = tag("PO", lambda: None, inner)
    assert tags_of(outer) == {"PO", "PI"} and tags_of(staticmethod(outer)) == {"PO", "PI"}
    assert tags_of(property(inner)) == {"PI"} and tags_of(original) == set()


def test_every_patch_that_changes_load_time_state_gives_it_back_on_undo():
    """P3, P8, P12 and P13 change layers and methods after load (routes, instance methods, kept weights, a LoRA
    kernel): each has an on_undo. P10 only launches a kernel once at load: nothing of Python's to give back."""
    import hybrid_exl3_fixes as overlay

    assert {p.id for p in overlay.PATCHES if p.on_undo is not None} == {"P3", "P8", "P12", "P13"}
