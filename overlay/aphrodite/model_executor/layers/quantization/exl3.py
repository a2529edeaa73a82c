"""Patches to aphrodite/model_executor/layers/quantization/exl3.py: P1, P3, P4, P7, P9 and P10.

P1: EXL3 shard ids for the GatedDeltaNet ``in_proj_qkv`` projection with LoRA on.

Why:     With ``--enable-lora``, ``models/qwen3_5.py`` builds GDN ``in_proj_qkv`` as its own
         ``MergedColumnParallelLinear`` (three output partitions: q, k, v) and ``load_weights``
         loads the fused checkpoint tensor once with the tuple shard id ``(0, 1, 2)``.
         ``Exl3LinearMethod._shard_ids_for_layer`` has branches for ``qkv_proj``,
         ``gate_up_proj`` and ``in_proj_qkvz`` only, so it falls back to ``[0, 1, 2]`` and
         ``process_weights_after_loading`` fails with
         ``ValueError: Missing EXL3 tensors for ...linear_attn.in_proj_qkv: suh[0], suh[1], ...``
         (seen on an H200 with aphrodite-engine 0.21.0; present in 0.20.0 too).
How:     Replace the class attribute (a staticmethod in 0.20/0.21) with a wrapper that answers
         ``[(0, 1, 2)]`` for a multi-partition layer whose prefix ends in ``in_proj_qkv`` and
         defers to the original for everything else. The class attribute, not an instance, is
         patched: spawned engine/worker processes unpickle ``Exl3Config`` before plugins run and
         look the method up on the class.
Upstream: https://github.com/dphnAI/sonar/pull/1711, first released in aphrodite-engine 0.22.0.
Retire when: the oldest supported aphrodite-engine is 0.22.0 (the probe already reports
         UPSTREAM_FIXED there).

P3: mixed EXL3 codebooks in one process at <= 32 rows.

Why:     ``_exl3_linear_one`` sends <= 32 rows to ``ops.exl3_gemm``, whose compiled kernel
         selection (``select_exl3_gemm_mgemm_kernel_new`` in csrc/.../exl3_kernel_map.cu) caches
         the kernel per ``(size_k, size_n, cc, K, c_fp32)`` -- without the codebook. Every later
         layer of that shape and bitrate runs the first one's codebook kernel and computes
         wrong numbers (relative error about 1.5) whatever its own mcg/mul1 flag says: a draft
         or MTP model quantized differently, a model whose layers mix codebooks, two models in
         one process. Measured on an H200 with aphrodite-engine 0.21.0; read from the 0.20.0 and
         0.21.0 binaries (overlay/exl3/dispatch.py, docs/upstream/exl3-gemm-codebook-cache.md).
How:     Python cannot reach the C++ cache, so the plan is made at load time, per layer, after
         the original ``process_weights_after_loading``: a GPU probe (once per process and
         device, a few small GEMMs) confirms the behaviour and that the uncached launch
         (``force_shape_idx``/``force_num_sms``) is right for every codebook; the first layer
         (or the probe) to use a cache key owns it; a later layer of another codebook on that
         key gets an instance-level ``_apply_one`` that calls the uncached launch (or, if the
         probe found it wrong, the reconstruct path) for its shards. Layers that own their key
         -- every layer of a single-codebook model -- are not touched and pay nothing per call.
         One WARNING per process names the first routed layer; the rest are logged at INFO.
Upstream: not reported before this project; report draft and fix in
         docs/upstream/exl3-gemm-codebook-cache.md and patches/0004-exl3-gemm-cache-codebook.patch.
         aphrodite-engine 0.24.0 (and 0.24.1) keys its replacement autotuner on the codebook
         (``gemm_autotune_hash(..., cb)``): the probe reports UPSTREAM_FIXED there.
Retire when: the oldest supported aphrodite-engine is 0.24.x.

P4: a fused EXL3 projection in float16, compiled: Inductor folds the GDN split into the concat.

Why:     ``Exl3LinearMethod.apply`` runs one kernel per checkpoint tensor of a fused projection and
         joins the float16 outputs with ``torch.cat``; it casts back only when the activations are
         not float16. With float16 activations (a float16 config, or ``--dtype float16``), the
         merged GDN ``in_proj_qkvz`` (built whenever LoRA is off: ``models/qwen3_5.py:142``) is a
         bare ``cat`` that ``gdn_linear_attn.py:540`` splits straight back into its two inputs.
         Inductor's ``cat_splitwithsizes_replace`` (torch/_inductor/fx_passes/post_grad.py)
         rewrites ``split(cat([a, b]))`` to ``[a, b]``, so the graph piece before
         ``gdn_attention_core`` returns ``z`` with its own row stride instead of the traced one
         (the cat's), and the piece after it, compiled for the traced strides, reads past the end:
         ``CUDA error: an illegal memory access`` in the first profiling run (H200, 0.21.0) and
         NaN on the CPU (docs/upstream/repro/exl3_piecewise_strides.py reproduces it in plain torch).
         bfloat16 activations are safe: the fp16 -> bf16 cast between cat and split stops the
         rewrite. docs/upstream/exl3-compiled-illegal-address.md.
How:     For float16 input to a layer with several shards and no fused mgemm kernel, join the
         outputs with ``hybrid_exl3_fixes::cat_last_dim``, a custom op (torch.cat inside) that
         Inductor cannot see through; every other call goes to the original ``apply`` unchanged.
         The probe runs the live ``apply`` on meta tensors (~2 ms) and looks at the last op that
         produced its output: a bare ``aten.cat`` is the bug.
Upstream: not reported before this project; report and diff in
         docs/upstream/exl3-compiled-illegal-address.md and patches/0005-exl3-fp16-cat-split.patch.
         Present in every release from 0.20.0 to 0.24.1 (the same ``apply``; CPU suite).
Retire when: aphrodite joins EXL3 shard outputs where Inductor cannot fold them (the probe then
         reports UPSTREAM_FIXED), or PyTorch's rewrite keeps the split outputs' strides.

P7: EXL3 routed experts in a CUDA graph: no expert may get more tokens than the fused kernel takes.

Why:     ``Exl3MoEMethod.apply`` sends a batch of more than ``exl3_small_batch_threshold`` tokens to
         ``ops.exl3_moe``, whose kernel skips every expert that received more tokens than its per-expert
         capacity (``if (token_count > max_tokens_per_expert) continue;`` in
         csrc/quantization/exl3/exllamav3_ext/quant/exl3_moe_kernel.cuh, v0.21.0; 128 tokens,
         ``_EXL3_MOE_MAX_TOKENS_PER_EXPERT``; 0.24 adds 32 and 1 for SM110). Outside a graph the Python
         fallback after the kernel computes those experts one by one; while a CUDA graph is captured
         ``apply`` returns straight after the kernel (``if torch.cuda.is_current_stream_capturing():
         return``), so every replay of that graph leaves out the contribution of any expert that gets
         more than 128 of the batch's tokens, silently. The default compiled mode captures piecewise
         graphs for batches up to 512 tokens (prefill chunks included), so a prompt batch of 129-512
         tokens with a popular expert is answered with wrong numbers. Measured (run 13, H200, 0.21.0,
         ``aphrodite run`` compiled, tiny EXL3 MoE, 4 experts 2 active): one request alone matches HF at
         0.0025 nats, 16 requests at once (prefill batches of about 200 tokens) 0.185; the eager twin
         0.0031 (docs/upstream/exl3-moe-graph-expert-capacity.md). Present in 0.20.0 - 0.24.1.
How:     While a graph is being captured and the batch has more rows than can be safe (a token
         picks each expert at most once, so a chunk of at most ``capacity`` rows never overflows), run
         the original ``apply`` on consecutive chunks of the largest safe size and write their outputs
         into one tensor: the captured graph then holds one exact kernel call per chunk. Eager calls
         and batches that cannot overflow go to the original unchanged.
Probe:   the live ``apply`` (its source, read with ``inspect``) returns from a branch that tests
         ``is_current_stream_capturing`` after calling ``exl3_moe`` (the fallback is skipped in graphs),
         and has no such branch ahead of the kernel (where patches/0008 chunks the batch).
Upstream: not reported yet; the upstream-ready diff is patches/0008-exl3-moe-graph-expert-capacity.patch.
Retire when: an aphrodite release runs the overflow experts (or chunks the batch) under capture and is
         the oldest supported one.

P9: EXL3 routed experts and padding rows: the expert id -1 that 0.23+ give them is out of range.

Why:     0.23.0 turned ``APHRODITE_MOE_SKIP_PADDING`` on by default (envs.py: ``"1"``; 0.22.0: ``"0"``) and
         moved it into the top-k kernel of every fused router (router/fused_topk_router.py ``_get_padding_mask``
         passes ``is_padding`` to ``ops.topk_softmax``): the rows the V2 model runner adds to reach a
         CUDA-graph size, and those of its profiling run, get expert id -1 (vLLM #48979; 0.22.0's own
         modular_kernel.py comment: it "requires the experts kernel to treat topk_id == -1 as a skip
         sentinel, which not all MoE backends support yet"). ``Exl3MoEMethod.apply`` does not: its large-batch
         path counts tokens per expert with ``expert_count.scatter_add_(0, expert_sorted, ...)``, and its
         one-token and small-batch paths pass the ids to ``exl3_mgemm`` as indices into the experts' pointer
         tables. Measured (run 15, H200, 0.24.1, eager, no LoRA, the overlay off): every EXL3 MoE hybrid
         stops in the profiling run, ``ScatterGatherKernel.cu:203: Assertion `idx_dim >= 0 && idx_dim <
         index_size``` then ``torch.AcceleratorError: CUDA error: device-side assert triggered`` at
         ``expert_count.tolist()`` (docs/upstream/exl3-moe-padding-expert-ids.md). 0.23.0 - 0.24.1.
How:     before the original ``apply``, give padding rows an id its path takes: on the large-batch path
         ``local_num_experts``, the spare last slot of ``expert_count`` that the fused kernel and the fallback never
         read (exllamav3 1.6.5 exl3_moe.cu: "last item is ignored"; its block_sparse_mlp.py sends experts outside a
         shard there): ``topk_ids.remainder(E + 1)``, -1 becomes E, real ids stay, one kernel; on the one-token and
         small-batch paths expert 0 (``clamp(min=0)``): a padding row's output is thrown away, whatever it is. Placed
         under P7 (applied first), so each chunk P7 captures is sanitised for the path its own size takes.
Probe:   NOT_APPLICABLE where no router marks padding rows in the top-k ids EXL3 receives (0.20 - 0.22:
         0.22.0 does it in the modular kernel only, which EXL3 MoE does not use); buggy when the live
         ``apply``'s source never compares ``topk_ids`` with 0 nor clamps it.
Upstream: not reported yet; the upstream-ready diff is patches/0009-exl3-moe-padding-expert-ids.patch.
         (P8 is kept for the small-row kernel choice of docs/upstream/exl3-small-batch-kernel-choice.md.)
Workaround without the overlay: ``APHRODITE_MOE_SKIP_PADDING=0``.
Retire when: an aphrodite release treats expert id -1 as a skip in ``Exl3MoEMethod.apply`` and is the oldest
         supported one.

P10: EXL3 routed experts under CUDA-graph capture: the fused kernel's device context must exist before it.

Why:     exllamav3's kernels allocate their per-device context lazily (``DevCtx::get_locks``: ``cudaMalloc`` +
         ``cudaMemset`` on first use, csrc/quantization/exl3/exllamav3_ext/quant/exl3_devctx.cu; the MoE kernel,
         exl3_gemm and exl3_gemv share it). 0.24.0's kernel update made ``exl3_moe`` return before that when no
         expert has work (``if (num_active == 0) return;``, exl3_moe.cu, ``num_active`` from
         ``Exl3MoEMethod.apply``), and since 0.23.0 every row of a warm-up or profiling batch is padding, expert
         id -1 (P9 sends those to the kernel's spare slot). So no eager call launches the fused kernel with work,
         and where no other exllamav3 kernel ran eagerly either, its first launch comes inside a CUDA-graph
         capture (num_active = -1 there): the allocation invalidates the capture and the launch reports it,
         ``operation failed due to a previous error during capture ... exl3_moe.cu 295``. The method captured on
         its own fails so on 0.24.1; a served model whose dense layers are EXL3 gets the context from their
         eager exl3_gemm / exl3_gemv calls first and starts without P10 (docs/upstream/exl3-moe-context-in-capture.md
         has both measurements). P10 makes the experts' capture independent of what else ran before it. 0.23.0
         launches on every call and is not affected.
How:     after the original ``process_weights_after_loading``, one eager call of the live ``apply`` with a few
         zero rows routed to real experts (weight 0) takes the fused kernel with work: the context is allocated
         and the kernel's shared-memory attribute set at load time. Per layer, once; nothing changes per step.
Probe:   NOT_APPLICABLE where the routers never mark padding (0.20 - 0.22) or ``ops.exl3_moe`` takes no
         ``num_active`` (0.23.0); buggy unless the load path already calls ``ops.exl3_moe`` itself. A fix in the
         C++ alone (patches/0010's exl3_moe.cu half) is invisible to the probe: the launch then costs one
         kernel per layer at load and changes nothing else.
Upstream: not reported yet; the upstream-ready diff is patches/0010-exl3-moe-context-before-capture.patch.
Retire when: an aphrodite release prepares the context before the idle-launch return (or at load) and is the
         oldest supported one.
"""

from __future__ import annotations

import types
from typing import Any

from hybrid_exl3_fixes.exl3 import dispatch
from hybrid_exl3_fixes.registry import (
    MARKER,
    Drift,
    Live,
    NotApplicable,
    Patch,
    Target,
    logger,
    tag,
    wrapper_chain,
)

MODULE = "aphrodite.model_executor.layers.quantization.exl3"
SHARD_IDS = Target(MODULE, "Exl3LinearMethod._shard_ids_for_layer", params=("layer", "output_partition_sizes"))

GDN_PREFIX = "language_model.model.layers.0.linear_attn.in_proj_qkv"
FUSED_QKV = [(0, 1, 2)]
BUGGY_ANSWER = [0, 1, 2]


def probe_in_proj_qkv_shard_ids(live: dict[str, Live]) -> bool:
    """Ask the live method for the shard ids of a LoRA-path GDN in_proj_qkv; True = buggy."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    # 0.22+ made the method an instance method that consults the quant config: build a real one.
    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    answer = method._shard_ids_for_layer(types.SimpleNamespace(prefix=GDN_PREFIX), [256, 256, 512])
    if list(answer) == FUSED_QKV:
        return False
    if list(answer) == BUGGY_ANSWER:
        return True
    raise Drift(f"_shard_ids_for_layer answered {answer!r} for in_proj_qkv, expected {FUSED_QKV!r} or {BUGGY_ANSWER!r}")


def build(live: dict[str, Live]) -> dict[str, Any]:
    original = live[SHARD_IDS.key].function

    def _shard_ids_for_layer(layer, output_partition_sizes):
        if len(output_partition_sizes) > 1 and getattr(layer, "prefix", "").endswith("in_proj_qkv"):
            return list(FUSED_QKV)
        return original(layer, output_partition_sizes)

    return {SHARD_IDS.key: staticmethod(tag("P1", _shard_ids_for_layer, original))}


PATCH = Patch(
    id="P1",
    slug="exl3-in-proj-qkv-shard-ids",
    title="EXL3 shard ids for GDN in_proj_qkv (LoRA path)",
    upstream="https://github.com/dphnAI/sonar/pull/1711",
    fixed_in="0.22.0",
    retire_when="the oldest supported aphrodite-engine is 0.22.0",
    targets=(SHARD_IDS,),
    probe=probe_in_proj_qkv_shard_ids,
    build=build,
)


# -- P3 ----------------------------------------------------------------------------------------

PROCESS_WEIGHTS = Target(MODULE, "Exl3LinearMethod.process_weights_after_loading", params=("self", "layer"))

# The probe's cache key: (in, out, K) = (384, 256, 2) is no projection of a Qwen3.5/3.6 model,
# and the probe claims it for mcg like any layer, so a real layer on it is still planned right.
PROBE_SHAPE = (384, 256, 2)
PROBE_ROWS = 4
CODEBOOK_FLAGS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}

PLANNER = dispatch.Planner()
VERDICTS: dict[int, dispatch.ProbeVerdict] = {}  # per CUDA device index, for this process
_warned = False


def probe_codebook_blind_gemm_cache(live: dict[str, Live]) -> bool:
    """Read the installed kernel library's dispatch (its dynamic symbols, ~1 ms, no GPU): a
    codebook-blind cache is a bug until this patch plans the loads; True = buggy."""
    verdict, evidence = dispatch.classify_build(dispatch.installed_kernel_libraries())
    if verdict is None:
        raise NotApplicable(evidence)
    if verdict == dispatch.UNKNOWN_DISPATCH:
        raise Drift(evidence)
    if verdict == dispatch.CODEBOOK_KEYED:
        return False
    return getattr(live[PROCESS_WEIGHTS.key].function, MARKER, None) != "P3"


def build_load_time_plan(live: dict[str, Live]) -> dict[str, Any]:
    original = live[PROCESS_WEIGHTS.key].function

    def process_weights_after_loading(self, layer):
        original(self, layer)
        try:
            plan_layer(self, layer)
        except Exception:  # never fail a load that upstream would have finished
            logger.warning(
                "hybrid-exl3-fixes: P3 could not plan %s; it keeps aphrodite's own path",
                getattr(layer, "prefix", type(layer).__name__),
                exc_info=True,
            )

    return {PROCESS_WEIGHTS.key: tag("P3", process_weights_after_loading, original)}


def codebook_of(layer, shard_id) -> str:
    if shard_id in layer.mcg.exl3_tensors:
        return "mcg"
    if shard_id in layer.mul1.exl3_tensors:
        return "mul1"
    return "3inst"


def small_batch_gemm_shards(layer) -> list:
    """The shards whose <= 32-row calls reach exl3_gemm (fused gate/up and k/v take exl3_mgemm)."""
    if getattr(layer, "exl3_can_mgemm", False):
        mode = getattr(layer, "exl3_mgemm_mode", None)
        if mode == "gate_up":
            return []
        if mode == "qkv_kv":
            return ["q"]
    return list(layer.exl3_shard_ids)


def plan_layer(
    method, layer, verdict: dispatch.ProbeVerdict | None = None, device_class: str = "hopper", device_sms: int = 132
) -> dict:
    """Claim this layer's exl3_gemm keys; route the shards whose key another codebook owns.
    Returns the routes {shard id: (force_shape_idx, force_num_sms)}, (0, 0) = reconstruct path."""
    if verdict is None:
        verdict, device_class, device_sms = device_verdict(next(iter(layer.trellis.exl3_tensors.values())).device)
    if not verdict.codebook_blind:
        return {}
    name = getattr(layer, "prefix", "") or type(layer).__name__

    def entries(shards):
        return [
            (s, dispatch.gemm_key(tuple(layer.trellis.exl3_tensors[s].shape)), codebook_of(layer, s)) for s in shards
        ]

    shards = small_batch_gemm_shards(layer)
    if getattr(layer, "exl3_can_mgemm", False) and any(
        PLANNER.conflicts_with(key, cb) for _, key, cb in entries(shards)
    ):
        # q of a fused qkv conflicts: q, k and v each take the per-shard path, planned below
        layer.exl3_can_mgemm = False
        shards = list(layer.exl3_shard_ids)
    routes = {}
    for shard, key, cb in entries(shards):
        label = name if shard is None else f"{name}[{shard!r}]"
        owner = PLANNER.claim(key, cb, label)
        if owner is None:
            continue
        launch = dispatch.forced_launch(device_class, *key, device_sms) if verdict.forced_ok else None
        routes[shard] = launch or (0, 0)
        _report_route(label, cb, key, owner, routes[shard])
    if routes:
        layer.hxf_exl3_routes = routes
        method._apply_one = types.MethodType(_routed_apply_one, method)
    return routes


def _report_route(label: str, codebook: str, key, owner, route) -> None:
    global _warned
    how = f"uncached kernel launch (shape {route[0]}, {route[1]} SMs)" if route[0] else "reconstruct path"
    what = (
        f"{label} ({codebook}, {key[0]} -> {key[1]}, {key[2]} bits) shares aphrodite's small-batch "
        f"GEMM cache key with {owner[1]} ({owner[0]}); routed to the {how}"
    )
    if _warned:
        logger.info("hybrid-exl3-fixes: P3: %s", what)
        return
    _warned = True
    logger.warning(
        "hybrid-exl3-fixes: P3: EXL3 layers of one shape and bitrate use different codebooks in this "
        "process, and aphrodite's <= 32-row GEMM would run them all with the first one's kernel "
        "(docs/upstream/exl3-gemm-codebook-cache.md). %s. Further routed layers are logged at INFO.",
        what,
    )


def _routed_apply_one(self, layer, x, shard_id):
    route = layer.hxf_exl3_routes.get(shard_id)
    if route is None:
        return type(self)._apply_one(self, layer, x, shard_id)
    mcg, mul1 = CODEBOOK_FLAGS[codebook_of(layer, shard_id)]
    return routed_linear()(
        x,
        layer.trellis.exl3_tensors[shard_id],
        layer.suh.exl3_tensors[shard_id],
        layer.svh.exl3_tensors[shard_id],
        mcg,
        mul1,
        route[0],
        route[1],
    )


_ROUTED_OP = None


def routed_linear():
    """``hybrid_exl3_fixes::exl3_linear_routed``: aphrodite's _exl3_linear_one, with the <= 32-row
    branch launching exl3_gemm uncached (force_shape_idx > 0) or, for shape_idx 0, taking the
    reconstruct path at every batch size. A custom op so torch.compile and CUDA graphs treat it
    as aphrodite's own."""
    global _ROUTED_OP
    if _ROUTED_OP is not None:
        return _ROUTED_OP
    import torch
    from aphrodite import _custom_ops as ops

    def exl3_linear_routed(x, trellis, suh, svh, mcg, mul1, shape_idx, num_sms):
        out_features = trellis.shape[1] * 16
        output = torch.empty((x.shape[0], out_features), device=x.device, dtype=torch.float16)
        x_had = torch.empty_like(x)
        if shape_idx > 0 and x.shape[0] <= dispatch.SMALL_BATCH_ROWS:
            ops.exl3_gemm(x, trellis, output, suh, x_had, svh, shape_idx, mcg, mul1, num_sms)
            return output
        weight = torch.empty((trellis.shape[0] * 16, out_features), device=trellis.device, dtype=torch.float16)
        ops.exl3_reconstruct(weight, trellis, trellis.shape[2] // 16, mcg, mul1)
        ops.exl3_had_r_128(x, x_had, suh, None, 1.0)
        ops.exl3_hgemm(x_had, weight, output)
        ops.exl3_had_r_128(output, output, None, svh, 1.0)
        return output

    op = torch.library.custom_op(
        "hybrid_exl3_fixes::exl3_linear_routed",
        exl3_linear_routed,
        mutates_args=(),
        device_types="cuda",
        schema="(Tensor x, Tensor trellis, Tensor suh, Tensor svh, bool mcg, bool mul1, int shape_idx, "
        "int num_sms) -> Tensor",
    )

    @op.register_fake
    def _(x, trellis, suh, svh, mcg, mul1, shape_idx, num_sms):
        return x.new_empty((x.shape[0], trellis.shape[1] * 16), dtype=torch.float16)

    _ROUTED_OP = op
    return op


def device_verdict(device) -> tuple[dispatch.ProbeVerdict, str, int]:
    """The runtime probe's answer for this CUDA device, measured once per process and device."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    device_class = dispatch.compute_class(props.major, props.minor)
    verdict = VERDICTS.get(index)
    if verdict is None:
        try:
            with torch.cuda.device(index):
                verdict = dispatch.read_probe(measure_gemm_cache(index, device_class, props.multi_processor_count))
        except Exception as exc:  # e.g. no kernel for the probe's shape on this device: route nothing
            verdict = dispatch.ProbeVerdict(None, False, f"the probe raised {type(exc).__name__}: {exc}")
        VERDICTS[index] = verdict  # asked once per process and device, whatever the answer
        if verdict.codebook_blind:
            PLANNER.claim(PROBE_SHAPE, "mcg", "the hybrid-exl3-fixes probe")
            logger.info(
                "hybrid-exl3-fixes: P3 probe on cuda:%d: the <= 32-row EXL3 GEMM keeps the first codebook "
                "per shape; uncached launch %s (%s)",
                index,
                "right" if verdict.forced_ok else "WRONG",
                verdict.detail,
            )
        elif verdict.codebook_blind is None:
            logger.warning(
                "hybrid-exl3-fixes: P3 probe on cuda:%d gave no clear answer, so no layer is routed: %s",
                index,
                verdict.detail,
            )
        else:
            logger.info(
                "hybrid-exl3-fixes: P3 probe on cuda:%d: the EXL3 GEMM honours each codebook; nothing to route (%s)",
                index,
                verdict.detail,
            )
    return verdict, device_class, props.multi_processor_count


def measure_gemm_cache(index: int, device_class: str, device_sms: int) -> dict[str, float]:
    """Run the probe's GEMMs on cuda:<index>; returns relative errors for dispatch.read_probe.
    References come from aphrodite's own reconstruct path (more than 32 rows), which decodes
    every codebook right."""
    import aphrodite.model_executor.layers.quantization.exl3  # noqa: F401 - registers the op
    import torch

    from hybrid_exl3_fixes.exl3 import codec

    k, n, K = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    tensors = codec.random_exl3_linear(k, n, K, "mcg", gen)
    trellis, suh, svh = (tensors[name].to(f"cuda:{index}") for name in ("trellis", "suh", "svh"))
    x_big = torch.randn(dispatch.SMALL_BATCH_ROWS + 1, k, generator=gen).to(torch.float16).to(f"cuda:{index}")
    x = x_big[:PROBE_ROWS].contiguous()
    linear = torch.ops.aphrodite.exl3_linear_one

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    ref = {cb: linear(x_big, trellis, suh, svh, *flags)[:PROBE_ROWS] for cb, flags in CODEBOOK_FLAGS.items()}
    first = linear(x, trellis, suh, svh, *CODEBOOK_FLAGS["mcg"])
    second = linear(x, trellis, suh, svh, *CODEBOOK_FLAGS["mul1"])
    errors = {
        "first": rel(first, ref["mcg"]),
        "second": rel(second, ref["mul1"]),
        "second_vs_first": rel(second, ref["mcg"]),
    }
    launch = dispatch.forced_launch(device_class, k, n, K, device_sms)
    for cb, flags in CODEBOOK_FLAGS.items():
        errors[f"forced_{cb}"] = rel(routed_linear()(x, trellis, suh, svh, *flags, *launch), ref[cb])
    return errors


PATCH_P3 = Patch(
    id="P3",
    slug="exl3-gemm-codebook-cache",
    title="EXL3 <= 32-row GEMM keeps the first codebook per shape (mixed-codebook processes)",
    upstream="docs/upstream/exl3-gemm-codebook-cache.md (not reported upstream before this project)",
    fixed_in="0.24.0",
    retire_when="the oldest supported aphrodite-engine is 0.24.x",
    targets=(PROCESS_WEIGHTS,),
    probe=probe_codebook_blind_gemm_cache,
    build=build_load_time_plan,
)


# -- P4 ----------------------------------------------------------------------------------------

APPLY = Target(MODULE, "Exl3LinearMethod.apply", params=("self", "layer", "x", "bias"))
VIEW_OPS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default")
_CAT_OP = None


def cat_last_dim():
    """``hybrid_exl3_fixes::cat_last_dim(tensors) -> Tensor``: torch.cat(tensors, -1) behind a custom-op
    boundary, so Inductor's pattern passes cannot fold a following split into it (P4). Registered once
    per process; any device (the probe and the CPU tests run it on meta and CPU tensors)."""
    global _CAT_OP
    if _CAT_OP is not None:
        return _CAT_OP
    import torch

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors, dim=-1)

    op = torch.library.custom_op(
        "hybrid_exl3_fixes::cat_last_dim", cat, mutates_args=(), schema="(Tensor[] tensors) -> Tensor"
    )

    @op.register_fake
    def _(tensors):
        return tensors[0].new_empty((*tensors[0].shape[:-1], sum(t.shape[-1] for t in tensors)))

    _CAT_OP = op
    return op


def _probe_layer(torch):
    """A two-shard EXL3 linear on the meta device (a GDN in_proj_qkvz as aphrodite builds it: the
    checkpoint's in_proj_qkv as one (0, 1, 2) shard and in_proj_z as shard 3), no mgemm."""

    def store(make):
        return types.SimpleNamespace(exl3_tensors={shard: make() for shard in ((0, 1, 2), 3)})

    return types.SimpleNamespace(
        prefix="language_model.model.layers.0.linear_attn.in_proj_qkvz",
        exl3_can_mgemm=False,
        exl3_shard_ids=[(0, 1, 2), 3],
        mcg=types.SimpleNamespace(exl3_tensors={}),
        mul1=types.SimpleNamespace(exl3_tensors={}),
        trellis=store(lambda: torch.empty(8, 8, 64, dtype=torch.int16, device="meta")),
        suh=store(lambda: torch.empty(128, dtype=torch.float16, device="meta")),
        svh=store(lambda: torch.empty(128, dtype=torch.float16, device="meta")),
    )


def ops_of_fp16_fused_apply(apply) -> list[str]:
    """The ops the live ``Exl3LinearMethod.apply`` dispatches for float16 input to a two-shard layer."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=4.0, head_bits=None, tensor_storage={}))
    layer, x = _probe_layer(torch), torch.empty(4, 128, dtype=torch.float16, device="meta")
    with Record() as record:
        apply(method, layer, x, None)
    return record.ops


def probe_fp16_fused_cat(live: dict[str, Live]) -> bool:
    """True = buggy: after the EXL3 kernels, the op that produced apply's output (views aside) is a
    bare ``aten.cat``, the form Inductor's cat/split rewrite matches."""
    ops = ops_of_fp16_fused_apply(live[APPLY.key].function)
    kernels = [i for i, op in enumerate(ops) if "exl3" in op and not op.startswith("aten.")]
    if len(kernels) < 2:
        raise Drift(f"Exl3LinearMethod.apply ran {len(kernels)} EXL3 kernel(s) for a two-shard layer: {ops}")
    produced = [op for op in ops[kernels[-1] + 1 :] if op not in VIEW_OPS]
    return produced[-1:] == ["aten.cat.default"]


def build_fp16_fused_cat(live: dict[str, Live]) -> dict[str, Any]:
    original = live[APPLY.key].function
    join = cat_last_dim()
    import torch

    def apply(self, layer, x, bias=None):
        shards = layer.exl3_shard_ids
        if x.dtype != torch.float16 or getattr(layer, "exl3_can_mgemm", False) or len(shards) < 2:
            return original(self, layer, x, bias)
        x_2d = x.reshape(-1, x.shape[-1]).contiguous()
        output = join([self._apply_one(layer, x_2d, shard_id) for shard_id in shards])
        if bias is not None:
            output = output + bias
        return output.reshape(*x.shape[:-1], output.shape[-1])

    return {APPLY.key: tag("P4", apply, original)}


PATCH_P4 = Patch(
    id="P4",
    slug="exl3-fp16-cat-split",
    title="fused EXL3 projection in float16: join the shard outputs where Inductor cannot fold the GDN split",
    upstream="docs/upstream/exl3-compiled-illegal-address.md (not reported upstream before this project)",
    fixed_in=None,
    retire_when="aphrodite joins EXL3 shard outputs behind an op boundary, or PyTorch's cat/split rewrite keeps "
    "strides",
    targets=(APPLY,),
    probe=probe_fp16_fused_cat,
    build=build_fp16_fused_cat,
)


# -- P7 ---------------------------------------------------------------------------------------------

MOE_APPLY = Target(
    MODULE,
    "Exl3MoEMethod.apply",
    params=("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts_input"),  # 0.20, 0.21
    also=(("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input"),),  # 0.22+
)


def returns_when_capturing(function) -> bool:
    """True when ``function`` calls ``exl3_moe`` and then returns from a branch whose test is
    ``torch.cuda.is_current_stream_capturing()`` or a name assigned from it (0.24's ``capturing``)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise Drift(f"Exl3MoEMethod.apply has no readable source: {exc}") from exc

    def calls_capturing(node) -> bool:
        return any(
            isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) == "is_current_stream_capturing"
            for n in ast.walk(node)
        )

    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and calls_capturing(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    kernel_line = min(
        (
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr == "exl3_moe"
            and isinstance(getattr(n, "ctx", None), ast.Load)
            and n.value is not None
            and getattr(n.value, "id", "") == "ops"
        ),
        default=None,
    )
    if kernel_line is None:
        raise NotApplicable("Exl3MoEMethod.apply does not call ops.exl3_moe here")
    returns = {"before": False, "after": False}  # a capture branch that returns, before / after the kernel
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        tests_capture = calls_capturing(node.test) or any(
            isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.test)
        )
        if tests_capture and any(isinstance(n, ast.Return) for b in node.body for n in ast.walk(b)):
            returns["before" if node.lineno < kernel_line else "after"] = True
    # a capture branch ahead of the kernel (patches/0008 chunks the batch there) means the graph path no
    # longer ends at the kernel alone
    return returns["after"] and not returns["before"]


def probe_moe_graph_capacity(live: dict[str, Live]) -> bool:
    """True = buggy: under capture the live ``apply`` returns after the fused kernel, before the
    fallback for experts the kernel skipped. Once P7 is in place (its wrapper's source, which
    ``inspect`` reaches through ``__wrapped__``, is still the original's) the question is whether the
    wrapper's chunks are safe, at today's capacities (128; 0.24's SM110: 32, and 1 up to 32 rows)."""
    function = live[MOE_APPLY.key].function
    if getattr(function, MARKER, None) == "P7":
        layers = [
            types.SimpleNamespace(exl3_small_batch_threshold=2, exl3_moe_max_tokens_per_expert=128),
            types.SimpleNamespace(
                exl3_small_batch_threshold=4,
                exl3_moe_max_tokens_per_expert=32,
                exl3_moe_short_token_threshold=32,
                exl3_moe_short_max_tokens_per_expert=1,
            ),
        ]
        return not all(
            sum(sizes) == rows and all(safe_rows(layer, n) for n in sizes)
            for layer in layers
            for rows in (3, 33, 129, 200, 512)
            for sizes in [chunk_rows(layer, rows)]
        )
    return returns_when_capturing(function)


def expert_capacity(layer: Any, rows: int) -> int:
    """How many tokens one expert may receive in a batch of ``rows`` before the fused kernel skips it."""
    import importlib

    default = getattr(importlib.import_module(MODULE), "_EXL3_MOE_MAX_TOKENS_PER_EXPERT", 128)
    capacity = getattr(layer, "exl3_moe_max_tokens_per_expert", default)  # 0.24+: per device
    if rows <= getattr(layer, "exl3_moe_short_token_threshold", 0):
        capacity = getattr(layer, "exl3_moe_short_max_tokens_per_expert", capacity)
    return capacity


def safe_rows(layer: Any, rows: int) -> bool:
    """A batch of ``rows`` tokens cannot lose an expert: it takes a per-token path (one row, or no more
    than the small-batch threshold), or no expert can get more tokens than there are rows."""
    return rows == 1 or rows <= getattr(layer, "exl3_small_batch_threshold", 0) or rows <= expert_capacity(layer, rows)


def chunk_rows(layer: Any, rows: int) -> list[int]:
    """Consecutive chunk sizes covering ``rows``, each the largest safe size left (1 always is)."""
    sizes = []
    while rows:
        size = min(rows, max(expert_capacity(layer, rows), getattr(layer, "exl3_small_batch_threshold", 1)))
        while not safe_rows(layer, size):
            size -= 1
        sizes.append(size)
        rows -= size
    return sizes


def build_moe_graph_capacity(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_APPLY.key].function
    import torch

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kwargs):
        rows = x.numel() // x.shape[-1]
        if not torch.cuda.is_current_stream_capturing() or safe_rows(layer, rows):  # eager calls: one C check
            return original(self, layer, x, topk_weights, topk_ids, *rest, **kwargs)
        x_2d = x.reshape(rows, x.shape[-1])
        weights, ids = topk_weights.reshape(rows, -1), topk_ids.reshape(rows, -1)
        output = torch.empty((rows, layer.hidden_size), dtype=x.dtype, device=x.device)  # what apply returns
        start = 0
        for size in chunk_rows(layer, rows):
            end = start + size
            part = original(self, layer, x_2d[start:end], weights[start:end], ids[start:end], *rest, **kwargs)
            output[start:end] = part.reshape(size, layer.hidden_size)
            start = end
        return output.reshape(*x.shape[:-1], layer.hidden_size)

    return {MOE_APPLY.key: tag("P7", apply, original)}


PATCH_P7 = Patch(
    id="P7",
    slug="exl3-moe-graph-expert-capacity",
    title="EXL3 routed experts in a CUDA graph: chunk the batch so no expert exceeds the fused kernel's capacity",
    upstream="not reported yet (patches/0008-exl3-moe-graph-expert-capacity.patch)",
    fixed_in=None,
    retire_when="an aphrodite release computes the experts the fused kernel skips under CUDA-graph capture and is "
    "the oldest supported one",
    targets=(MOE_APPLY,),
    probe=probe_moe_graph_capacity,
    build=build_moe_graph_capacity,
)


# -- P9 ---------------------------------------------------------------------------------------------

ROUTER_MODULE = "aphrodite.model_executor.layers.fused_moe.router.fused_topk_router"


def marks_padding_rows() -> bool:
    """Whether this release's fused top-k routers give padding rows expert id -1 (0.23+: ``_get_padding_mask``
    feeds ``is_padding`` to the top-k kernel, gated by ``APHRODITE_MOE_SKIP_PADDING``)."""
    import importlib

    try:
        router = importlib.import_module(ROUTER_MODULE)
    except ImportError:  # 0.20, 0.21: no router package
        return False
    return callable(getattr(router, "_get_padding_mask", None))


def handles_negative_ids(function) -> bool:
    """True when ``apply``'s source compares ``topk_ids`` itself with 0 or -1 (``topk_ids < 0``) or clamps it
    (``topk_ids.clamp(...)``, ``.remainder(...)``): a fix upstream. ``topk_ids.shape[-1] == 1`` is not one."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise Drift(f"Exl3MoEMethod.apply has no readable source: {exc}") from exc

    def is_ids(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "topk_ids"

    def zero_or_minus_one(node) -> bool:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return isinstance(node.operand, ast.Constant) and node.operand.value == 1
        return isinstance(node, ast.Constant) and node.value == 0

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and is_ids(node.left) and any(zero_or_minus_one(c) for c in node.comparators):
            return True
        func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and is_ids(func.value) and func.attr in CLAMPS:
            return True
    return False


CLAMPS = ("clamp", "clamp_", "clamp_min", "clamp_min_", "remainder", "masked_fill", "where")


def probe_moe_padding_ids(live: dict[str, Live]) -> bool:
    """True = buggy: the routers give padding rows expert id -1 and the live ``apply`` passes it on."""
    function = live[MOE_APPLY.key].function
    if any(getattr(f, MARKER, None) == "P9" for f in wrapper_chain(function)):
        return False
    if not marks_padding_rows():
        raise NotApplicable("this release's routers never give EXL3 experts the padding id -1 (0.23+ do)")
    return not handles_negative_ids(function)


def padding_safe_ids(layer: Any, rows: int, topk_ids):
    """``topk_ids`` with every padding id (-1) replaced by one the path of a ``rows``-row batch takes."""
    if rows == 1 or rows <= getattr(layer, "exl3_small_batch_threshold", 0):
        return topk_ids.clamp(min=0)  # pointer-table indices: any real expert (the row is thrown away)
    return topk_ids.remainder(layer.local_num_experts + 1)  # the slot the kernel and the fallback skip


def build_moe_padding_ids(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_APPLY.key].function

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kwargs):
        rows = x.numel() // x.shape[-1]
        return original(self, layer, x, topk_weights, padding_safe_ids(layer, rows, topk_ids), *rest, **kwargs)

    return {MOE_APPLY.key: tag("P9", apply, original)}


PATCH_P9 = Patch(
    id="P9",
    slug="exl3-moe-padding-expert-ids",
    title="EXL3 routed experts: padding rows' expert id -1 (APHRODITE_MOE_SKIP_PADDING, 0.23+) mapped to one "
    "the kernel takes",
    upstream="not reported yet (patches/0009-exl3-moe-padding-expert-ids.patch)",
    fixed_in=None,
    retire_when="an aphrodite release treats expert id -1 as a skip in Exl3MoEMethod.apply and is the oldest "
    "supported one",
    targets=(MOE_APPLY,),
    probe=probe_moe_padding_ids,
    build=build_moe_padding_ids,
)


# -- P10 --------------------------------------------------------------------------------------------

MOE_LOAD = Target(MODULE, "Exl3MoEMethod.process_weights_after_loading", params=("self", "layer"))
MOE_SETUP = "_setup_fused_moe_kernel"


def kernel_skips_idle_launches() -> bool:
    """Whether this release's ``ops.exl3_moe`` takes ``num_active`` (0.24+): the kernel then returns before it
    touches exllamav3's device context when no expert has work, as in every padded warm-up batch."""
    import inspect

    from aphrodite import _custom_ops as ops

    op = getattr(ops, "exl3_moe", None)
    if op is None:
        raise NotApplicable("this release has no EXL3 MoE kernel (aphrodite._custom_ops.exl3_moe)")
    try:
        return "num_active" in inspect.signature(op).parameters
    except (TypeError, ValueError) as exc:
        raise Drift(f"aphrodite._custom_ops.exl3_moe has no readable signature: {exc}") from exc


def launches_at_setup(method_class) -> bool:
    """True when the live load path (``process_weights_after_loading`` and the class's own methods it reaches, such
    as ``_setup_fused_moe_kernel``) calls ``ops.exl3_moe`` itself: a warm-up launch upstream."""
    import ast
    import inspect
    import textwrap

    seen, todo = set(), ["process_weights_after_loading"]
    while todo:
        name = todo.pop()
        seen.add(name)
        function = inspect.getattr_static(method_class, name, None)
        function = getattr(function, "__func__", function)
        if getattr(function, MARKER, None) == "P10":
            function = getattr(function, "__wrapped__", None)
        if not callable(function):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError) as exc:
            raise Drift(f"Exl3MoEMethod.{name} has no readable source: {exc}") from exc
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        if attributes & {"exl3_moe", "exl3_moe_active"}:
            return True
        todo += [a for a in attributes - seen if callable(inspect.getattr_static(method_class, a, None))]
    return False


def probe_moe_context_before_capture(live: dict[str, Live]) -> bool:
    """True = buggy: padding rows carry expert id -1 (so every warm-up and profiling batch leaves the experts
    idle), the kernel skips idle launches before it allocates its device context, and nothing at load time
    launches it with work."""
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    if getattr(live[MOE_LOAD.key].function, MARKER, None) == "P10":
        return False
    if not marks_padding_rows():
        raise NotApplicable("this release's routers give the warm-up batches real experts (0.23+ mark padding)")
    if not kernel_skips_idle_launches():
        raise NotApplicable("this release's exl3_moe launches on every call (0.24+ skip idle launches)")
    return not launches_at_setup(exl3.Exl3MoEMethod)


def warm_fused_kernel(method, layer) -> int:
    """One eager call of ``method.apply`` that takes the fused kernel with work for it: threshold + 1 rows of
    zeros, row t on experts t*k .. t*k + k - 1 (mod E, distinct within a row), weight 0. Every expert gets at
    most a couple of tokens, far below the kernel's capacity, so nothing else runs. The kernel then allocates
    exllamav3's device context (its lock buffer, cudaMalloc + cudaMemset) and sets its kernel's shared-memory
    attribute here, outside any CUDA-graph capture. Returns the rows used."""
    import inspect

    import torch

    experts, k = layer.local_num_experts, layer.top_k
    device = layer.exl3_gate_ptrs_trellis.device
    rows = max(2, getattr(layer, "exl3_small_batch_threshold", 1) + 1)
    ids = (torch.arange(rows * k, device=device) % experts).reshape(rows, k)
    x = torch.zeros(rows, layer.hidden_size, dtype=torch.float16, device=device)
    weights = torch.zeros(rows, k, dtype=torch.float32, device=device)
    # 0.22+: the shared-expert arguments
    extra = list(inspect.signature(inspect.unwrap(type(method).apply)).parameters)[5:]
    method.apply(layer, x, weights, ids, **dict.fromkeys(extra))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def build_moe_context_warmup(live: dict[str, Live]) -> dict[str, Any]:
    original = live[MOE_LOAD.key].function

    def process_weights_after_loading(self, layer):
        original(self, layer)
        try:
            warm_fused_kernel(self, layer)
        except Exception:  # never fail a load that upstream would have finished
            logger.warning(
                "hybrid-exl3-fixes: P10 could not launch the EXL3 MoE kernel for %s at load time; CUDA-graph "
                "capture may stop at exl3_moe.cu (docs/upstream/exl3-moe-context-in-capture.md). --enforce-eager "
                "avoids it",
                getattr(layer, "layer_name", type(layer).__name__),
                exc_info=True,
            )

    return {MOE_LOAD.key: tag("P10", process_weights_after_loading, original)}


PATCH_P10 = Patch(
    id="P10",
    slug="exl3-moe-context-before-capture",
    title="EXL3 routed experts: launch the fused kernel once at load, so its device context exists before "
    "CUDA-graph capture (0.24+)",
    upstream="not reported yet (patches/0010-exl3-moe-context-before-capture.patch)",
    fixed_in=None,
    retire_when="an aphrodite release allocates exllamav3's device context before the kernel's idle-launch return "
    "(or at load) and is the oldest supported one",
    targets=(MOE_LOAD,),
    probe=probe_moe_context_before_capture,
    build=build_moe_context_warmup,
)
