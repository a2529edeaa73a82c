"""P1, P2, P2b against the real aphrodite-engine modules (CPU).

On 0.20.0/0.21.0 each test first reproduces the upstream failure on the unpatched code, then
shows the overlay removes it; on 0.24.1 the overlay must leave every fixed target untouched.
"""

from __future__ import annotations

import pytest
import torch

from helpers import APHRODITE_VERSION, NO_KERNELS, exl3_param, needs_aphrodite, needs_buggy, needs_fixed

pytestmark = needs_aphrodite

GDN_PREFIX = "language_model.model.layers.0.linear_attn.in_proj_qkv"
# Bug 1's message as seen on the H200 (FACTS.md), for the shard ids [0, 1, 2].
BUG1_MESSAGE = (
    f"Missing EXL3 tensors for {GDN_PREFIX}: suh[0], suh[1], suh[2], svh[0], svh[1], svh[2], "
    "trellis[0], trellis[1], trellis[2]"
)


def gdn_in_proj_qkv(exl3, method):
    """A LoRA-path GDN in_proj_qkv as create_weights + qwen3_5.load_weights leave it (TP=1).

    create_weights itself refuses to run without CUDA, so its bookkeeping is replayed here with
    the method's own _shard_ids_for_layer; the tensors are loaded through the real weight loader
    with the shard id qwen3_5.py uses under enable_lora: (0, 1, 2).
    """
    layer = torch.nn.Module()
    layer.prefix = GDN_PREFIX
    sizes = [256, 256, 512]  # key_dim, key_dim, value_dim
    layer.exl3_tp_rank, layer.exl3_tp_size = 0, 1
    layer.exl3_parallel_mode = "column"
    layer.input_size_per_partition = 256
    layer.exl3_shard_ids = method._shard_ids_for_layer(layer, sizes)
    for name in ("suh", "svh", "trellis", "mcg", "mul1"):
        layer.register_parameter(name, exl3_param(exl3))
    shapes = {"suh": (256,), "svh": (1024,), "trellis": (16, 64, 64)}
    for name, shape in shapes.items():
        exl3._exl3_weight_loader(getattr(layer, name), torch.zeros(shape), (0, 1, 2))
    return layer


def exl3_base_layer():
    """A loaded EXL3 linear as the LoRA wrapper sees it (fake input: placeholders + one shard)."""
    from hybrid_exl3_fixes.shared import fake_exl3_layer

    layer = fake_exl3_layer()
    layer.input_size, layer.tp_size, layer.tp_rank = 256, 1, 0
    return layer


# -- P1 -------------------------------------------------------------------------------------


@needs_buggy
def test_p1_unpatched_fails_with_upstream_error(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = gdn_in_proj_qkv(exl3, method)
    assert layer.exl3_shard_ids == [0, 1, 2]
    with pytest.raises(ValueError) as err:
        method.process_weights_after_loading(layer)
    assert str(err.value) == BUG1_MESSAGE


@needs_buggy
def test_p1_patched_loads_the_fused_shard(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    results = {r.patch.id: r for r in overlay.apply_all()}
    assert results["P1"].status.value == "APPLIED"
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))
    layer = gdn_in_proj_qkv(exl3, method)
    assert layer.exl3_shard_ids == [(0, 1, 2)]
    # Past the missing-tensor check; without CUDA the next step (moving shards to the current
    # CUDA device) is the first thing that may fail, and it is not bug 1.
    try:
        method.process_weights_after_loading(layer)
    except (AssertionError, RuntimeError) as exc:
        assert not torch.cuda.is_available() and "Missing EXL3 tensors" not in str(exc)
    # Other projections keep their upstream answers.
    for prefix, sizes, expected in [
        ("model.layers.3.self_attn.qkv_proj", [512, 256, 256], ["q", "k", "v"]),
        ("model.layers.0.mlp.gate_up_proj", [512, 512], [0, 1]),
        ("model.layers.0.linear_attn.in_proj_qkvz", [256, 256, 512, 512], [(0, 1, 2), 3]),
        ("model.layers.0.linear_attn.in_proj_qkv", [1024], [None]),
        ("model.layers.0.linear_attn.out_proj", [256, 256], [0, 1]),
    ]:
        layer = torch.nn.Module()
        layer.prefix = prefix
        assert method._shard_ids_for_layer(layer, sizes) == expected, prefix


@needs_buggy
def test_p1_patches_the_class_so_existing_instances_see_it(overlay):
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    before = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0))  # made before the plugin ran
    overlay.apply_all()
    layer = torch.nn.Module()
    layer.prefix = GDN_PREFIX
    assert before._shard_ids_for_layer(layer, [256, 256, 512]) == [(0, 1, 2)]
    assert isinstance(vars(exl3.Exl3LinearMethod)["_shard_ids_for_layer"], staticmethod)


# -- P2 / P2b -------------------------------------------------------------------------------


@needs_buggy
def test_p2_unpatched_fails_with_upstream_error(overlay):
    from aphrodite.lora.layers.base_linear import BaseLinearLayerWithLoRA

    with pytest.raises(ValueError, match=r"^Unsupported base layer: "):
        BaseLinearLayerWithLoRA(exl3_base_layer())


@needs_buggy
def test_p2_patched_lora_wrapper_takes_the_exl3_device(overlay):
    from aphrodite.lora.layers import base_linear, fused_moe, utils

    overlay.apply_all()
    layer = exl3_base_layer()
    wrapper = base_linear.BaseLinearLayerWithLoRA(layer)
    assert wrapper.device == layer.trellis.exl3_tensors[(0, 1, 2)].device
    # every binding site answers, the MoE one for an EXL3 MoE layer too
    moe = torch.nn.Module()
    moe.w2_trellis = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    moe.w2_trellis.exl3_tensors = {(0, "w2"): torch.zeros(2)}
    for site in (utils, base_linear, fused_moe):
        assert site._get_lora_device(layer) == torch.device("cpu")
        assert site._get_lora_device(moe) == torch.device("cpu")
    # non-EXL3 layers keep the upstream answers and errors
    dense = torch.nn.Linear(4, 4)
    assert utils._get_lora_device(dense) == dense.weight.device
    with pytest.raises(ValueError, match="Unsupported base layer"):
        utils._get_lora_device(torch.nn.Module())


@needs_buggy
def test_p2b_weight_property(overlay):
    from aphrodite.lora.layers.base_linear import BaseLinearLayerWithLoRA

    overlay.apply_all()
    layer = exl3_base_layer()
    wrapper = BaseLinearLayerWithLoRA(layer)
    assert wrapper.weight is layer.trellis
    wrapper_dense = BaseLinearLayerWithLoRA(_dense_base())
    assert wrapper_dense.weight is wrapper_dense.base_layer.weight


def _dense_base():
    layer = torch.nn.Linear(4, 4)
    layer.input_size, layer.tp_size, layer.tp_rank = 4, 1, 0
    return layer


# -- registry behaviour on the real modules -------------------------------------------------


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
        ("P14", "APPLIED"),  # the MoE-LoRA align kernel of 0.20/0.21 (test_p14_moe_lora_align.py)
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

    assert overlay.undo_all() == ["P14", "P11", "P7"] + (["P6"] if APHRODITE_VERSION != "0.20.0" else []) + [
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
    applied = 7 + padding_ids + skips_idle
    assert f"hybrid-exl3-fixes: applied={applied} upstream_fixed=2 drifted=0" in overlay.summary(list(results.values()))
    assert f"(aphrodite {APHRODITE_VERSION})" in overlay.summary(list(results.values()))


@needs_fixed
def test_fixed_release_still_rejects_exl3_moe_for_lora():
    """Evidence for docs/upstream/exl3-moe-lora-device.md: #1712 checks ``trellis`` only, while
    Exl3MoEMethod registers ``w13_trellis``/``w2_trellis``. When this starts failing, upstream
    fixed it: update the write-up."""
    from aphrodite.lora.layers.utils import _get_lora_device

    moe = torch.nn.Module()
    moe.w2_trellis = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    moe.w2_trellis.exl3_tensors = {(0, "w2"): torch.zeros(2)}
    with pytest.raises(ValueError, match="^Unsupported base layer"):
        _get_lora_device(moe)


@needs_aphrodite
@pytest.mark.parametrize("routed_experts", [False, True], ids=["flat (0.20/0.21)", "routed_experts (0.22+)"])
def test_p2_gives_exl3_moe_layers_their_device_on_every_release(overlay, routed_experts):
    """The MoE branch the upstream fix lacks: with P2, an EXL3 MoE layer in either form gets the device
    its expert tensors live on, at every site that bound the function, on every release."""
    from aphrodite.lora.layers import base_linear, fused_moe, utils

    from hybrid_exl3_fixes.aphrodite.lora.layers.utils import PATCH
    from hybrid_exl3_fixes.shared import fake_exl3_moe_layer

    layer = fake_exl3_moe_layer("meta", routed_experts=routed_experts)
    with pytest.raises(ValueError, match="^Unsupported base layer"):  # unpatched: every release rejects it
        utils._get_lora_device(layer)
    assert overlay.REGISTRY.apply(PATCH).status.value == "APPLIED"
    for site in (utils, base_linear, fused_moe):
        assert site._get_lora_device(layer) == torch.device("meta")


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


def test_the_patches_that_check_a_tag_after_apply_say_so():
    """P3, P8, P9, P10, P12, P13 and P14 recognise themselves after apply by the tag on the replaced function (their
    bug is in a GPU kernel's inputs); their APPLIED result says that the check read a tag, not behaviour."""
    import hybrid_exl3_fixes as overlay
    from helpers import stand_in_patch
    from hybrid_exl3_fixes.registry import Registry

    assert {p.id for p in overlay.PATCHES if p.checks_tag_after_apply} == {"P3", "P8", "P9", "P10", "P12", "P13", "P14"}
    patch, _ = stand_in_patch(globals(), "TagOwner", id="PT", checks_tag_after_apply=True)
    result = Registry([patch]).apply(patch)
    assert result.status.value == "APPLIED" and "checked after apply by its tag, not by behaviour" in result.reason
