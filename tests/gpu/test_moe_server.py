"""Issue 17 in the user's configuration: the tiny EXL3 MoE hybrid through the real `aphrodite run`.

The checkpoint is make-tiny's ``tiny-moe`` preset (Qwen3_5MoeForConditionalGeneration: GDN and
attention layers, 4 routed experts of which 2 are active, a shared expert; every projection EXL3,
experts in mcg, the codebook Aphrodite's MoE kernel takes; bfloat16 config, as exllamav3 writes
it). Servers run in the default compiled mode and, as twins, in eager mode, reached over HTTP with
the openai client; logprobs are compared with HF transformers + PEFT on the dense twin
(Qwen3_5MoeForConditionalGeneration with transformers' fused experts).

Cells: LoRA off; LoRA on with the two adapters on attention, GDN and shared-expert projections;
both in the default compiled mode and in eager mode (run 11's compiled MoE servers never finished
starting: docs/upstream/exl3-moe-compiled-graph-capture.md); ``lora-experts`` (which also targets the
routed experts) given at start-up, which must be refused with the modules named, and served where P13 is opted
in (``*-lora-experts3d-p13``: PEFT's target_parameters form against HF + PEFT, and far from the same reference
without its expert deltas; the per-expert form refused, or on 0.24+ with ``--enable-mixed-moe-lora-format`` served
against HF with its deltas merged into the fused experts); and the failure
sequence without the overlay, one cell per step (every patch off; P2 and P5 off; P5 off), each
recording the engine's own error. ``moe35-*`` cells serve the same kind of model at the Qwen3.6-35B-A3B
layer dimensions (make-tiny ``qwen3.6-35b-a3b``: 4 layers, 32 of its 256 experts, 8 active), against HF +
PEFT on its own dense twin. The runtime-adapter test uses the eager LoRA server.
Shared deviations from the defaults as in test_server.py (--gpu-memory-utilization 0.03 with a
pinned 2 GiB KV cache so the servers can start at once, --gdn-prefill-backend triton,
--language-model-only); the ``*-defaults-*`` cells leave out the last two (the engine's default backends, the
vision tower loaded), as users start it. The expert-adapter cells also serve the 16 mixed requests one at a time
and the expert adapter 16 at once, each step's worst per model recorded and every answer dumped
(``expert_adapter_steps``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from serving_checks import (
    ENGINE_DEFAULTS,
    TOLERANCE,
    alone_and_mixed,
    answers_dump,
    check,
    client,
    complete,
    gather_completions,
    lora_args,
    prompts,
    ready,
    shared_args,
    start_fleet,
    worst,
    worst_by_model,
)

from harness import Reference

START_TIMEOUT = float(os.environ.get("HXF_SERVER_START_TIMEOUT", "1500"))  # as test_server.py's
BASE_PORT = 8200 + int(os.environ.get("HXF_PORT_OFFSET", "0"))  # two suites at once
SERVED = "tiny-moe"
ADAPTERS = ("lora-a", "lora-b")
REFUSED = "targets the routed experts of EXL3 MoE layers"
P13_ON = "HYBRID_EXL3_FIXES_MOE_EXPERT_LORA"  # P13 module ENABLE_ENV
EXPERTS_3D = ("lora-a", "lora-experts-3d")
# The 35B-A3B-width checkpoint's pinned 2 GiB pool holds 992 Mamba state blocks; 0.24.1's default --max-num-seqs on a
# big GPU is 1024, and it refuses to start with more sequences than blocks ("max_num_seqs (1024) exceeds available
# Mamba cache blocks (992)"; docs/gpu-runs/2026-12-06-run30): the P13 cell pins 256, the default below 70 GiB cards
MOE35_SEQS = ("--max-num-seqs", "256")
EXPERTS_OFF = "expert adapter without its expert deltas"
# A random MoE at the 35B-A3B width is sensitive to the activation dtype itself: HF in bfloat16 is 0.87 from HF in
# float32 over a cell's 19 prompts (make-tiny qwen3.6-35b-a3b, CPU, 2026-12-01; tiny-moe: 0.029), against the
# served model's 0.21 alone and 0.33 mixed in run 13, because 8 of 32 experts are chosen per token and near-ties
# flip. Each cell's tolerance is the larger
# of TOLERANCE and this factor times HF's own bfloat16 spread on the cell's checkpoint and prompts.
SPREAD_FACTOR = 1.5


def aphrodite_minor() -> tuple[int, int]:
    """The installed aphrodite-engine's (major, minor), as the overlay reads it; (0, 0) without it."""
    from hybrid_exl3_fixes import aphrodite_version

    try:
        return tuple(int(part) for part in (aphrodite_version() or "").split(".")[:2])
    except ValueError:
        return (0, 0)


# name: LoRA?, adapters given at start-up, extra args, extra env, what the cell must do (serve; wrong: serve,
# right alone and wrong at once; stall: serve right, or a request never answers (an expected failure); refuse;
# or the text of the upstream error it must stop with, any one of the alternatives)
CELLS = {
    # eager twins first (the cells are tested in this order while all start at once): run 11's and run 12's
    # compiled MoE servers did not finish starting (docs/upstream/exl3-moe-compiled-graph-capture.md); the
    # LoRA loader's behaviour does not depend on the mode
    "moe-eager-bf16-nolora": (False, (), ["--enforce-eager"], {}, "serve"),
    "moe-eager-bf16-lora": (
        True,
        ADAPTERS,
        ["--enforce-eager"],
        {"APHRODITE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        "serve",
    ),
    "moe-eager-bf16-lora-experts": (True, ("lora-a", "lora-experts"), ["--enforce-eager"], {}, "refuse"),
    # P13 opted in (0.21+; docs/drafts/p13-moe-expert-lora.md): an adapter in PEFT's target_parameters form
    # on the fused experts served against HF + PEFT, alone and mixed with the base and lora-a in one batch
    "moe-eager-bf16-lora-experts3d-p13": (True, EXPERTS_3D, ["--enforce-eager"], {P13_ON: "1"}, "serve"),
    "moe-compiled-bf16-lora-experts3d-p13": (True, EXPERTS_3D, [], {P13_ON: "1"}, "serve"),
    "moe35-compiled-bf16-lora-experts3d-p13": (True, EXPERTS_3D, [*MOE35_SEQS], {P13_ON: "1"}, "serve"),
    # the user's configuration: default compiled mode and the engine's default backends (FlashInfer's GDN prefill,
    # the vision tower loaded: no --gdn-prefill-backend triton, no --language-model-only), both adapter forms
    "moe-compiled-defaults-bf16-lora-experts3d-p13": (True, EXPERTS_3D, [ENGINE_DEFAULTS], {P13_ON: "1"}, "serve"),
    "moe35-compiled-defaults-bf16-lora-experts3d-p13": (
        True,
        EXPERTS_3D,
        [ENGINE_DEFAULTS, *MOE35_SEQS],
        {P13_ON: "1"},
        "serve",
    ),
    # the control for the P13 cells: the same adapters on the dense twin, unquantized, through aphrodite's own
    # TritonExperts and MoE-LoRA kernels against the same HF + PEFT reference; where the P13 cells and this one
    # differ from the reference alike, the difference is not P13's (docs/drafts/p13-moe-expert-lora.md, run 30)
    "moe-dense-eager-bf16-lora-experts3d": (True, EXPERTS_3D, ["--enforce-eager", "--dtype", "bfloat16"], {}, "serve"),
    # the per-expert form: Qwen3.5/3.6 MoE models take the fused form (is_3d_moe_weight), so P5 refuses it naming
    # the flag that takes it on 0.24+, where it is then served (against HF with its deltas merged into the experts)
    "moe-eager-bf16-lora-experts-p13": (
        True,
        ("lora-a", "lora-experts"),
        ["--enforce-eager"],
        {P13_ON: "1"},
        ("per-expert form",),
    ),
    **(
        {
            "moe-eager-bf16-lora-experts-mixed-p13": (
                True,
                ("lora-a", "lora-experts"),
                ["--enforce-eager", "--enable-mixed-moe-lora-format"],
                {P13_ON: "1"},
                "serve",
            ),
            "moe-compiled-defaults-bf16-lora-experts-mixed-p13": (
                True,
                ("lora-a", "lora-experts"),
                [ENGINE_DEFAULTS, "--enable-mixed-moe-lora-format"],
                {P13_ON: "1"},
                "serve",
            ),
        }
        if aphrodite_minor() >= (0, 24)
        else {}
    ),
    # P6 off: the EXL3 shared expert on the auxiliary stream beside the routed experts (<= 256 tokens). Runs 12 and
    # 14: the first completion never answered (run 14: 528 s, the server healthy, P6-on servers beside it right);
    # run 13: a 4-token completion answered at once. So the stall is intermittent: "stall" records it as an
    # expected failure when it comes, and fails the cell only on numbers off HF + PEFT when it answers
    "moe-eager-bf16-nolora-noP6": (False, (), ["--enforce-eager"], {"HYBRID_EXL3_FIXES_DISABLE": "P6"}, "stall"),
    "moe-compiled-bf16-nolora": (False, (), [], {}, "serve"),
    # P7 off: CUDA graphs drop an expert with more than 128 of a batch's tokens (run 13: one request alone
    # 0.0025, 16 at once 0.185); the control must be right alone and wrong with requests at once
    "moe-compiled-bf16-nolora-noP7": (False, (), [], {"HYBRID_EXL3_FIXES_DISABLE": "P7"}, "wrong"),
    "moe-compiled-bf16-lora": (True, ADAPTERS, [], {}, "serve"),
    # P10 off, the configuration (LoRA on, default compiled mode): serves on every release. On 0.24+ no
    # warm-up launches the fused kernel with work (every row is padding and the kernel skips idle launches), but
    # the dense EXL3 layers' GEMM allocates exllamav3's device context in the eager warm-ups before the first
    # capture; the method captured alone, with nothing else before it, does fail without P10
    # (tests/upstream/tests/kernels/moe/test_exl3_moe_context_capture.py; docs/upstream/exl3-moe-context-in-capture.md)
    "moe-compiled-bf16-lora-noP10": (True, ADAPTERS, [], {"HYBRID_EXL3_FIXES_DISABLE": "P10"}, "serve"),
    # the checkpoint make-tiny wrote before it set mamba_ssm_dtype (GDN state in bfloat16), beside the float32 cells
    "moebf16-compiled-bf16-lora": (True, ADAPTERS, [], {}, "serve"),
    # the same, capturing piecewise graphs only (the default on 0.21.0 is FULL_AND_PIECEWISE): tells which
    # capture run 11's compiled servers stopped in
    "moe-compiled-piecewise-bf16-nolora": (
        False,
        (),
        ["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'],
        {},
        "serve",
    ),
    # the same model at the Qwen3.6-35B-A3B layer dimensions (make-tiny qwen3.6-35b-a3b: hidden 2048, 32 experts
    # of 512, 8 active): whether what the tiny model does in runs 11-12 belongs to MoE serving or to its tiny
    # dimensions (256 wide, the MoE kernel's small-batch threshold 2)
    "moe35-eager-bf16-nolora": (False, (), ["--enforce-eager"], {}, "serve"),
    "moe35-eager-bf16-lora": (True, ADAPTERS, ["--enforce-eager"], {}, "serve"),
    "moe35-compiled-bf16-nolora": (False, (), [], {}, "serve"),
    "moe35-compiled-bf16-lora": (True, ADAPTERS, [], {}, "serve"),
    # without the overlay's fixes, in the order the failures appear at start-up
    # 0.20-0.21 stop at P1's shard ids; 0.22+ (P1 fixed upstream) at _get_lora_device on the first FusedMoE
    # (docs/upstream/exl3-moe-lora-device.md, read from the 0.24.1 source)
    "moe-lora-unpatched": (
        True,
        ADAPTERS,
        [],
        {"HYBRID_EXL3_FIXES_DISABLE": "1"},
        ("Missing EXL3 tensors",) if aphrodite_minor() < (0, 22) else ("Unsupported base layer: RoutedExperts",),
    ),
    "moe-lora-noP2-noP5": (
        True,
        ADAPTERS,
        [],
        {"HYBRID_EXL3_FIXES_DISABLE": "P2,P5"},
        ("Unsupported base layer",),
    ),
    "moe-lora-noP5": (
        True,
        ADAPTERS,
        [],
        {"HYBRID_EXL3_FIXES_DISABLE": "P5"},
        ("new modular kernel initialization logic", "Old-style modular kernel not supported"),
    ),
}
MAIN = "moe-eager-bf16-lora"  # the runtime-adapter test's server (see the eager twins above)
# each cell's checkpoint: make-tiny preset and folder under the work directory
CHECKPOINTS = {
    "moe": ("tiny-moe", "server-moe", {}),
    "moebf16": ("tiny-moe", "server-moe-bf16state", {"ssm_dtype": None}),
    "moe35": ("qwen3.6-35b-a3b", "server-moe35", {}),
}


def state_dtype(folder: Path) -> str:
    """The GDN recurrent state's dtype the checkpoint asks for (text_config.mamba_ssm_dtype), as aphrodite reads it."""
    import json

    text = json.loads((folder / "exl3" / "config.json").read_text())["text_config"]
    return text.get("mamba_ssm_dtype") or f"{text.get('dtype')} (no mamba_ssm_dtype)"


def checkpoint_of(cell: str) -> str:
    return cell.split("-", 1)[0]


def server_args(cell: str, folder: Path) -> tuple[str, list[str], dict]:
    """A ``*-dense-*`` cell serves the checkpoint's dense twin (the EXL3 weights decoded, the HF reference's own
    model) unquantized, through aphrodite's own MoE kernels; the others serve the EXL3 checkpoint."""
    lora, adapters, extra, env, _ = CELLS[cell]
    args = shared_args(SERVED, ENGINE_DEFAULTS not in extra) + (lora_args(folder, adapters) if lora else [])
    extra = [a for a in extra if a != ENGINE_DEFAULTS]
    return str(folder / ("dense" if "-dense-" in cell else "exl3")), args + extra, env


@pytest.fixture(scope="session")
def moe_models(workdir):
    """checkpoint name -> its folder, written on first use (the 35B-A3B-width one on the GPU)."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    def folder(name: str) -> Path:
        preset, sub, overrides = CHECKPOINTS[name]
        dest = workdir / sub
        if not (dest / "manifest.json").exists():
            write_tiny(dest, TinySpec.preset(preset, **overrides), device="cuda" if name == "moe35" else None)
        return dest

    return folder


@pytest.fixture(scope="session")
def moe(moe_models):
    return moe_models("moe")


@pytest.fixture(scope="session")
def moe_fleet(moe_models, workdir):
    servers = start_fleet(
        list(CELLS), lambda cell: server_args(cell, moe_models(checkpoint_of(cell))), BASE_PORT, workdir
    )
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def references(moe_models):
    """checkpoint name -> HF + PEFT on its dense twin, built on first use."""
    built = {}

    def reference(name: str) -> Reference:
        if name not in built:
            built[name] = Reference(moe_models(name), (*ADAPTERS, "lora-experts", "lora-experts-3d"))
        return built[name]

    return reference


@pytest.fixture(scope="session")
def moe_reference(references):
    return references("moe")


@pytest.mark.parametrize("cell", list(CELLS))
def test_moe_cell(cell, moe_fleet, moe_models, references, record):
    """Start and serve (base and each adapter alone, 16 mixed at once, against HF + PEFT), or the
    refusal / upstream error the cell must stop with, recorded with the engine's own words."""
    lora, adapters, extra, env, expect = CELLS[cell]
    if cell not in moe_fleet:
        pytest.skip(f"{cell} not selected (HXF_SERVER_CELLS)")
    server = moe_fleet[cell]
    up = server.wait_ready(START_TIMEOUT)
    info = {
        "checkpoint": f"bfloat16 ({CHECKPOINTS[checkpoint_of(cell)][0]})",
        "gdn_state": state_dtype(moe_models(checkpoint_of(cell))),
        "mode": "eager" if "--enforce-eager" in extra else " ".join(["compiled", *extra]),
        "lora": lora,
        "adapters": list(adapters),
        "env": " ".join(f"{k}={v}" for k, v in env.items()),
        "started": up,
        "ready_s": server.ready_s,
        "overlay": sorted(set(server.overlay_lines())),
        **server.startup_figures(),
    }
    if expect not in ("serve", "wrong", "stall"):
        text = server.text()
        info["root_error"] = server.root_error()[:600]
        server.stop()
        if expect == "refuse":
            info["names_modules"] = "mlp.experts.0.gate_proj" in text
            record(f"moe {cell}", **info)
            assert not up, f"{cell} started with an adapter on EXL3 experts"
            assert REFUSED in text and info["names_modules"], info
            return
        record(f"moe {cell}", **info)
        assert not up, f"{cell} started without the fix it lacks"
        assert any(alt in text for alt in expect), info
        return
    record(f"moe {cell}", **info)
    if not up:
        raise AssertionError(f"{cell}: {server.root_error()}\n{server.text()[-2000:]}")
    models = {m.id for m in client(server).models.list().data}
    assert models == {SERVED, *adapters}, models
    if lora:
        info["lora_layers_left_unwrapped"] = server.text().count("could not be wrapped by any LoRA layer")
    kept: dict = {}  # the 16 mixed answers, for expert_adapter_steps' dump
    try:
        failed = alone_and_mixed(
            server,
            references(checkpoint_of(cell)),
            [None, *adapters],
            SERVED,
            info,
            lambda: record(f"moe {cell}", **info),
            kept,
        )
    except Exception as exc:  # openai.APITimeoutError where a request never answers
        if expect != "stall" or "Timeout" not in type(exc).__name__:
            raise
        info["stalled"] = f"{type(exc).__name__} after the requests listed before it: {exc}"[:300]
        record(f"moe {cell}", **info)
        server.stop()
        pytest.xfail(f"{cell}: a request never answered without P6 ({type(exc).__name__})")
    assert not failed, failed[:3]
    expert_adapter = next((a for a in adapters if a.startswith("lora-experts")), None)
    if expert_adapter:  # before any assert: what tells a wrong batch from a wrong adapter
        models = [None, *adapters]
        expert_adapter_steps(server, references(checkpoint_of(cell)), models, expert_adapter, cell, info, kept)
        record(f"moe {cell}", **info)
    # how hard the 16 at once press one expert: above the fused kernel's 128 in a captured batch is P7's case
    info["16 mixed"]["hf_max_tokens_per_expert"] = references(checkpoint_of(cell)).max_tokens_per_expert(prompts(16, 2))
    # no closer than HF's own bfloat16 run can be (SPREAD_FACTOR of it), and never looser than TOLERANCE
    spread = references(checkpoint_of(cell)).bf16_spread([*prompts(3, 1), *prompts(16, 2)])
    info["hf_bf16_spread"], info["tolerance"] = round(spread, 4), round(max(TOLERANCE, SPREAD_FACTOR * spread), 4)
    record(f"moe {cell}", **info)
    if expect == "wrong":  # the control without the fix: right alone, wrong with requests at once
        alone = max(v["max_abs_dlogprob"] for k, v in info.items() if k.startswith("alone "))
        server.stop()
        assert alone < info["tolerance"] < info["16 mixed"]["max_abs_dlogprob"], info
        return
    assert info["max_abs_dlogprob"] < info["tolerance"], info
    if lora:
        assert info["lora-a vs base reference"] > 3 * info["tolerance"], "the adapter made no difference"
    if expert_adapter:  # its expert deltas applied, not dropped: far from a reference without them
        reference = references(checkpoint_of(cell))
        served = complete(server, expert_adapter, prompts(1, 1)[0])
        if expert_adapter == "lora-experts-3d":  # PEFT's ParamWrappers on the fused experts
            off = reference.dropping(("mlp.experts", "mlp.experts.base_layer"))
        else:
            off = reference.without_expert_deltas()
        with off:
            info[EXPERTS_OFF] = round(check(reference, expert_adapter, served)["max_abs_dlogprob"], 4)
        record(f"moe {cell}", **info)
        assert info[EXPERTS_OFF] > 3 * info["tolerance"], info
    if cell != MAIN:
        server.stop()


def expert_adapter_steps(
    server, reference, models: list, expert_adapter: str, cell: str, info: dict, kept: dict
) -> None:
    """Beside ``alone_and_mixed``'s steps, the ones that tell which property of a batch an error follows: the same
    16 requests as its mixed step again at once ("16 mixed, again": a first call's error is gone), one at a time
    ("16 mixed, one at a time": the adapters mixed across steps, never within one), and the expert adapter on all
    16 prompts at once ("expert adapter, 16 at once": requests at once, one adapter). Each step's worst per model
    goes into ``info``; every served answer, with the model and the step, into ``served-CELL.json`` beside the
    results (``HXF_GPU_RESULTS``), for reading offline."""
    import asyncio
    import json

    mix = [models[i % len(models)] for i in range(16)]
    jobs = [(a or SERVED, ids) for a, ids in zip(mix, prompts(16, 2))]
    served = {
        # the same batch again: a step right the second time is one that a first call got wrong
        "16 mixed, again": (mix, asyncio.run(gather_completions(server, jobs, 8, True))),
        "16 mixed, one at a time": (mix, [complete(server, model, ids) for model, ids in jobs]),
        "expert adapter, 16 at once": (
            [expert_adapter] * 16,
            asyncio.run(gather_completions(server, [(expert_adapter, ids) for ids in prompts(16, 2)], 8, True)),
        ),
    }
    dump = {"16 mixed": answers_dump(kept["16 mixed"])} if "16 mixed" in kept else {}  # alone_and_mixed's step
    for step, (names, answers) in served.items():
        rows = [(a, check(reference, a, r)) for a, r in zip(names, answers) if not isinstance(r, Exception)]
        info[step] = {**worst([r for _, r in rows]), "by model": worst_by_model(rows), "failed": len(names) - len(rows)}
        dump[step] = answers_dump(zip(names, answers))
    results = os.environ.get("HXF_GPU_RESULTS")
    if results:
        (Path(results).parent / f"served-{cell}.json").write_text(json.dumps(dump))


def test_moe_expert_adapter_refused_at_runtime_and_the_server_serves_on(moe_fleet, moe, moe_reference, record):
    """/v1/load_lora_adapter with lora-experts: a JSON error naming the expert modules (500 on 0.21), not
    listed afterwards, server healthy and still serving lora-a as HF + PEFT does; an allowed adapter
    (lora-b's folder under a new name) loads at runtime and serves lora-b's outputs."""
    import httpx

    server = ready(moe_fleet, MAIN)
    refused = httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": "experts-runtime", "lora_path": str(moe / "lora-experts")},
        timeout=120,
    )
    try:
        body = refused.json()
    except ValueError:
        body = {"not json": refused.text[:300]}
    message = str(body.get("error") or body)
    listed = {m.id for m in client(server).models.list().data}
    healthy = server.healthy()
    after = check(moe_reference, "lora-a", complete(server, "lora-a", prompts(1, 7)[0])) if healthy else None
    allowed = httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": "lora-b-runtime", "lora_path": str(moe / "lora-b")},
        timeout=120,
    )
    served_b = check(moe_reference, "lora-b", complete(server, "lora-b-runtime", prompts(1, 8)[0]))
    info = {
        "status": refused.status_code,
        "error": message[:700],
        "names_modules": "mlp.experts.0.gate_proj" in message,
        "listed_after": "experts-runtime" in listed,
        "healthy_after": healthy,
        "lora-a after": after and round(after["max_abs_dlogprob"], 4),
        "allowed adapter load": allowed.status_code,
        "allowed adapter max_abs_dlogprob": round(served_b["max_abs_dlogprob"], 4),
    }
    record(f"moe runtime adapters ({MAIN})", **info)
    # 0.21's load_lora_adapter re-raises whatever add_lora raised (entrypoints/openai/models/serving.py), so
    # every failed load is a 500 there, ours included (run 13); the refusal is in the message, nothing is loaded
    assert 400 <= refused.status_code < 600 and REFUSED in message and info["names_modules"], info
    assert not info["listed_after"] and healthy and after["max_abs_dlogprob"] < TOLERANCE, info
    assert allowed.status_code == 200 and served_b["max_abs_dlogprob"] < TOLERANCE, info
