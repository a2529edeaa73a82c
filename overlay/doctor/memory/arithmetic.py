"""The engine's memory arithmetic for a hybrid GDN model, term by term (doctor's memory plan).

Each term carries its bytes, its formula, and its basis: ``code`` (aphrodite-engine 0.21.0's own
arithmetic, restated; exact up to rounding), ``measured`` (a constant taken from an H200 start-up log,
bench/results/memory_plan.md; it may differ on another GPU model, which the term says) or
``bound`` (not derived; a range). Sources, all in aphrodite-engine 0.21.0:

- requested memory = ceil(total x --gpu-memory-utilization) (v1/worker/utils.py request_memory); the
  utilization's default is 0.92 in aphrodite 0.20.0 - 0.24.1 (config/cache.py CacheConfig; vLLM's is 0.9:
  the engine logs it as "desired GPU memory utilization (0.92, ...)");
  available KV = requested - (weights + torch peak + non-torch increase) - CUDA graph estimate
  (v1/worker/gpu_worker.py determine_available_memory; the estimate is subtracted by default since
  0.21, APHRODITE_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1). From 0.23.0 the profiler counts "total consumed" (the
  drop in free memory since the worker's start-up snapshot) plus the transient peak (utils/mem_utils.py
  memory_profiling): the same terms, and with them whatever the model runner allocates after the snapshot
  (profile.py's ``runner_buffers``, Model Runner V2 in 0.24.1).
- batch defaults: a GPU of >= 70 GiB (not an A100) gets --max-num-batched-tokens 8192 and
  --max-num-seqs 1024 under `aphrodite run`; smaller GPUs 2048 and 256 (engine/arg_utils.py
  get_batch_defaults): the one place the GPU model changes the plan by itself.
- hybrid page: attention page per token 2 x KV heads/TP x head_dim x bytes; GDN state page
  conv_dim/TP x (kernel - 1) x bytes + value_heads/TP x value_dim x key_dim x bytes, both in the model
  dtype unless text_config.mamba_ssm_dtype names the SSM state's (models/config.py
  Qwen3_5ForConditionalGenerationConfig); attention block = 16 x ceil(state page / (16 x page per
  token)), the state page padded to the attention page (platforms/interface.py).
- groups: group size = min(full, linear layers) (max when max < 1.5 x min), each kind split into
  groups of that size; blocks = available // page // group size; blocks per request = attention
  groups x ceil(max_model_len / block) + state groups x state blocks; concurrency = blocks / that; "GPU
  KV cache size" = int(concurrency x max_model_len) tokens (v1/core/kv_cache_utils.py).
- state blocks per request: 1 without prefix caching, 2 with it (MambaSpec.max_memory_usage_bytes: the
  Mamba cache mode 'align', which models/config.py MambaModelConfig sets for Qwen3.5 whenever prefix caching
  is on, 0.20.0-0.24.1; Qwen3.5 lacks SupportsMambaPrefixCaching, so 0.20/0.21's 'all' never applies).
  Prefix caching is on by default for hybrid models from 0.23.0 (config/model.py
  is_prefix_caching_supported: "Generative hybrid models support prefix caching"), off before
  (docs/upstream/hybrid-prefix-caching-state-blocks.md).
- CUDA graphs: capture sizes 1, 2, 4, 8..248 step 8, 256..max step 16 with max = min(2 x
  max_num_seqs, 512, max_num_batched_tokens) (config/aphrodite.py), piecewise graphs at every size,
  FULL decode graphs at sizes <= max_num_seqs, each set twice with LoRA on; estimate = the larger first
  capture + the others' per-graph cost (gpu_model_runner.py profile_cudagraph_memory).
- EXL3 MoE scratch: every EXL3 MoE layer allocates, after loading and inside "Model loading took", four fp16
  buffers of C x 128 tokens per expert x (hidden, hidden, intermediate, intermediate) with C = the GPU's SM count
  // 12, and a handful of top_k-sized ones (quantization/exl3.py Exl3MoEMethod._setup_fused_moe_kernel,
  0.20.0-0.24.1; 32 tokens per expert on SM 11.x in 0.24): 13.8 MiB a layer at the 35B-A3B's widths on an H200.
- EXL3 GEMM: more than 32 rows (0.24.1: 144) reconstruct the fp16 weight of the tensor first
  (quantization/exl3.py _exl3_linear_one): the profiling run's sampler pass (max_num_seqs rows through
  lm_head) holds an fp16 copy of an EXL3 head, whole or (0.24.1) in slices (profile.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...compat import NEWEST_TESTED
from . import bounds, profile, vision

GIB = 1 << 30
MIB = 1 << 20
BIG_GPU_GIB = 70  # get_batch_defaults: >= 70 GiB (and not an A100) gets the large batch defaults
REDUNDANCY = 150 * MIB  # gpu_worker.py: the margin the engine leaves in its own --kv-cache-memory-bytes advice
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# --dtype's other spellings (aphrodite config/model.py: ModelDType and _STR_DTYPE_TO_TORCH_DTYPE, 0.20 - 0.24.1)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


NEWEST_RELEASE = NEWEST_TESTED  # the plan's release when none is named or installed
PREFIX_CACHING_DEFAULT_FROM = (0, 23, 0)  # hybrid models get prefix caching by default from this release on


def release_tuple(release: str) -> tuple[int, ...]:
    """``"0.24.1"`` -> ``(0, 24, 1)``; a part that is not a number (``rc1``, ``dev``) stops the tuple."""
    out = []
    for part in release.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def canonical_dtype(name: str) -> str:
    """``half`` -> ``float16``, ``float`` -> ``float32``; any other name as given."""
    return DTYPE_ALIASES.get(name, name)


def dtype_bytes(name: str, default: int = 2) -> int:
    """Bytes per value of a dtype or cache dtype name, aliases included (``default`` for a name not listed)."""
    return DTYPE_BYTES.get(canonical_dtype(name), default)


def kv_value_bytes(kv_dtype: str, dtype: str) -> int:
    """Bytes per KV value: any fp8 cache dtype 1; ``auto`` keeps the cache in the activations' ``dtype``."""
    if kv_dtype.startswith("fp8"):
        return 1
    return dtype_bytes(dtype if kv_dtype == "auto" else kv_dtype)


# Measured on the H200 (the calibration rows of bench/results/memory_plan.md); each term says what it stands for.
NON_TORCH = int(0.27 * GIB)  # non-torch increase during profiling at TP 1 (cuBLAS/Triton workspaces)
LOAD_OVERHEAD = 30 * MIB  # model loading beyond the tensors: fixed part ...
LOAD_OVERHEAD_PER_LAYER = 4 * MIB  # ... and per decoder layer (tiny-moe 0.05 GiB, 9B 0.158 GiB over headers)
PIECEWISE_PER_GRAPH = 8 * MIB  # profile_cudagraph_memory's per-graph figures on the 9B
FULL_PER_GRAPH = 6 * MIB
FULL_PER_GRAPH_LORA = 4 * MIB


@dataclass
class Engine:
    """The engine arguments the plan depends on, resolved as the planned release resolves them."""

    gpu_gib: float
    tp: int = 1
    utilization: float = 0.92  # aphrodite's default (config/cache.py), not vLLM's 0.9
    max_model_len: int = 4096
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_dtype: str = "auto"
    dtype: str = "bfloat16"  # the activations' (and so the KV cache's and the GDN state's) dtype
    eager: bool = False
    lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    language_model_only: bool = False
    prefix_caching: bool | None = None  # --enable-prefix-caching / --no-enable-prefix-caching; None: the default
    release: str | None = None  # the aphrodite-engine release planned for; None: the newest supported
    exl3_keep: int | None = None  # P12's opt-in, HYBRID_EXL3_FIXES_EXL3_KEEP: bytes per GPU, -1 all, None off
    image_tokens: int | None = None  # the processor's largest image in tokens; None: the published processor's
    image_limit: int = vision.DEFAULT_IMAGE_LIMIT  # --limit-mm-per-prompt's image count

    def __post_init__(self):
        big = self.gpu_gib >= BIG_GPU_GIB
        self.max_num_seqs = self.max_num_seqs or (1024 if big else 256)
        self.max_num_batched_tokens = self.max_num_batched_tokens or (8192 if big else 2048)

    @property
    def release_version(self) -> tuple[int, ...]:
        """The planned release as a tuple (``release_tuple``); the newest supported where none is named."""
        return release_tuple(self.release or "") or release_tuple(NEWEST_RELEASE)

    @property
    def prefix_caching_on(self) -> bool:
        """The flag as given, else the release's default: on for hybrid models from 0.23.0."""
        if self.prefix_caching is not None:
            return self.prefix_caching
        return self.release_version >= PREFIX_CACHING_DEFAULT_FROM

    @property
    def state_blocks_per_request(self) -> int:
        """GDN state blocks one request holds per state group: 2 in the 'align' Mamba cache mode."""
        return 2 if self.prefix_caching_on else 1

    @property
    def defaults_note(self) -> str:
        big = self.gpu_gib >= BIG_GPU_GIB
        return (
            f"`aphrodite run` defaults on a {'>=' if big else '<'} {BIG_GPU_GIB} GiB GPU: "
            f"--max-num-batched-tokens {8192 if big else 2048}, --max-num-seqs {1024 if big else 256}"
        )


def term(value: int, formula: str, basis: str) -> dict:
    return {"bytes": int(value), "gib": round(value / GIB, 3), "formula": formula, "basis": basis}


def capture_sizes(eng: Engine) -> tuple[list[int], list[int]]:
    """(piecewise sizes, FULL decode sizes) as config/aphrodite.py builds them."""
    largest = min(2 * eng.max_num_seqs, 512, eng.max_num_batched_tokens)
    sizes = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)] if s <= largest]
    return sizes, [s for s in sizes if s <= eng.max_num_seqs]


def gdn_state_bytes(shape, dtype: str, tp: int = 1) -> tuple[int, int, int, int]:
    """One GDN layer's state per sequence and rank: (recurrent bytes, conv bytes, recurrent and conv bytes per
    value). aphrodite 0.21 keeps both in the activations' dtype unless the config's ``mamba_ssm_dtype`` names the
    recurrent state's (models/config.py; the logged block sizes and page padding follow it:
    bench/results/memory_plan.md)."""
    if not (shape.linear_layers and shape.gdn):
        return 0, 0, 0, 0
    g = shape.gdn
    width = dtype_bytes(dtype)
    ssm = dtype_bytes(shape.ssm_dtype or "", width)
    conv_dim = (2 * g["key_heads"] * g["key_dim"] + g["value_heads"] * g["value_dim"]) // tp
    recurrent = g["value_heads"] // tp * g["value_dim"] * g["key_dim"] * ssm
    return recurrent, conv_dim * (g["kernel"] - 1) * width, ssm, width


def kv_layout(shape, eng: Engine) -> dict:
    """Page sizes, block size and groups of the hybrid KV cache (per rank)."""
    kv_bytes = kv_value_bytes(eng.kv_dtype, eng.dtype)
    kv_heads = max(1, (shape.kv_heads or 0) // eng.tp) if shape.full_layers else 0
    per_token = 2 * kv_heads * (shape.head_dim or 0) * kv_bytes
    recurrent, conv, ssm_bytes, _ = gdn_state_bytes(shape, eng.dtype, eng.tp)
    state = recurrent + conv
    block = 16
    if state and per_token:
        block = max(16, 16 * math.ceil(state / (16 * per_token)))
    page = block * per_token if per_token else state
    full, linear = shape.full_layers, shape.linear_layers
    counts = [n for n in (full, linear) if n]
    group = min(counts) if counts else 1
    if counts and max(counts) < 1.5 * min(counts):
        group = max(counts)
    attn_groups = math.ceil(full / group) if full else 0
    state_groups = math.ceil(linear / group) if linear else 0
    return {
        "page_bytes_per_token": per_token,
        "state_page_bytes": state,
        "block_size": block,
        "page_bytes": page,
        "group_size": group,
        "attention_groups": attn_groups,
        "state_groups": state_groups,
        "state_blocks_per_request": eng.state_blocks_per_request,
        "prefix_caching": eng.prefix_caching_on,
        "formula": (
            f"page per token 2 x {kv_heads} KV heads x {shape.head_dim} x {kv_bytes} B = {per_token:,} B; state page "
            f"{state:,} B (SSM state {ssm_bytes} B/value); block {block} tokens = 16 x ceil(state / (16 x page per "
            f"token)); page {page:,} B; {full} full + {linear} linear layers in groups of {group}: "
            f"{attn_groups} attention + {state_groups} state groups; prefix caching "
            f"{'on' if eng.prefix_caching_on else 'off'}: {eng.state_blocks_per_request} state block(s) per request "
            f"and group"
        ),
    }


def kv_capacity(layout: dict, pool: int, max_model_len: int) -> dict:
    """Blocks, concurrency and token capacity the engine reports for a KV pool of ``pool`` bytes."""
    blocks = max(0, int(pool // layout["page_bytes"] // layout["group_size"])) if layout["page_bytes"] else 0
    state_blocks = layout["state_groups"] * layout["state_blocks_per_request"]
    per_request = layout["attention_groups"] * math.ceil(max_model_len / layout["block_size"]) + state_blocks
    concurrency = blocks / per_request if per_request else 0.0
    return {
        "blocks": blocks,
        "blocks_per_request": per_request,
        "max_concurrency": round(concurrency, 2),
        "kv_cache_tokens": int(concurrency * max_model_len),
        "formula": (
            f"blocks = pool // {layout['page_bytes']:,} B // {layout['group_size']} = {blocks:,}; per request "
            f"{layout['attention_groups']} x ceil({max_model_len:,} / {layout['block_size']}) + "
            f"{layout['state_groups']} x {layout['state_blocks_per_request']} = {per_request}; "
            f"concurrency {concurrency:.2f}"
        ),
    }


def lora_linears(shape) -> list[tuple[int, int, int]]:
    """(slices, in, out) at TP 1 of every linear the LoRA manager wraps (the routed experts of an EXL3 MoE
    stay unwrapped, P5), from the config: qwen3_5.py's projections with LoRA on."""
    h, out = shape.hidden or 0, []
    g = shape.gdn or {}
    for kind in shape.layer_types:
        if kind == "linear_attention" and g:
            key, value = g["key_heads"] * g["key_dim"], g["value_heads"] * g["value_dim"]
            out += [(3, h, 2 * key + value), (1, h, value), (2, h, 2 * g["value_heads"]), (1, value, h)]
        elif kind == "full_attention":
            q = (shape.heads or 0) * (shape.head_dim or 0)
            kv = (shape.kv_heads or 0) * (shape.head_dim or 0)
            out += [(3, h, 2 * q + 2 * kv), (1, q, h)]  # q carries the output gate (x 2)
        if shape.moe:
            inter = shape.moe.get("shared_intermediate") or 0
            out += [(1, h, shape.moe.get("experts") or 0), (1, h, 1)]  # router, shared-expert gate
            if inter:
                out += [(2, h, 2 * inter), (1, inter, h)]
        elif shape.intermediate:
            out += [(2, h, 2 * shape.intermediate), (1, shape.intermediate, h)]
    return out


def lora_bytes(shape, eng: Engine) -> tuple[int, str]:
    """Stacked LoRA A and B buffers, allocated at load (counted in the engine's "weights memory")."""
    if not eng.lora:
        return 0, "LoRA off"
    per = sum(s * fin + fout for s, fin, fout in lora_linears(shape))
    linear = eng.max_loras * eng.max_lora_rank * per * 2 // eng.tp
    embed = eng.max_loras * (shape.vocab or 0) * eng.max_lora_rank * 2
    return linear + embed, (
        f"{eng.max_loras} LoRAs x rank {eng.max_lora_rank} x 2 B x (sum over {len(lora_linears(shape))} wrapped "
        f"linears of slices x in + out = {per:,}) / TP {eng.tp} + embedding {eng.max_loras} x {shape.vocab:,} x rank"
    )


def cudagraph_bytes(shape, eng: Engine) -> tuple[int, str]:
    if eng.eager:
        return 0, "--enforce-eager: no CUDA graphs"
    piecewise, full = capture_sizes(eng)
    copies = 2 if eng.lora else 1
    n_p, n_f = copies * len(piecewise), copies * len(full)
    layers, h = len(shape.layer_types), shape.hidden or 0
    first_p = (piecewise[-1] * layers * h * 4 + PIECEWISE_PER_GRAPH) if piecewise else 0
    per_full = FULL_PER_GRAPH_LORA if eng.lora else FULL_PER_GRAPH
    first_f = (full[-1] * layers * h * 4 + per_full) if full else 0
    total = max(first_p, first_f) + (n_p - 1) * PIECEWISE_PER_GRAPH + max(0, n_f - 1) * per_full
    return total, (
        f"first capture max({piecewise[-1] if piecewise else 0}, {full[-1] if full else 0} tokens) x {layers} layers x "
        f"{h} x 4 B + {n_p - 1} piecewise x {PIECEWISE_PER_GRAPH // MIB} MiB + {max(0, n_f - 1)} FULL x "
        f"{per_full // MIB} MiB (per-graph costs measured on the H200)"
    )


MOE_TOKENS_PER_EXPERT = 128  # quantization/exl3.py _EXL3_MOE_(DEFAULT_)MAX_TOKENS_PER_EXPERT, 0.20.0-0.24.1
MOE_MAX_EXPERTS_PER_TOKEN = 32  # _EXL3_MOE_MAX_EXPERTS_PER_TOKEN: caps the small-batch output buffer's rows
PLAN_GPU_SMS = 132  # the SM count the scratch is planned for: an H200's or H100's (bounds.py: other GPUs)


def exl3_moe_scratch(shape, eng: Engine) -> tuple[int, str]:
    """The buffers each EXL3 MoE layer allocates once its experts are loaded (Exl3MoEMethod._setup_fused_moe_kernel):
    per layer 2 x C x T x hidden + 2 x C x T x intermediate fp16 (the gate/up states and intermediates), C = SMs //
    12, T = 128, and the small-batch ones: 2k x hidden and 2k x intermediate fp16, 2k int64 ids, k x intermediate
    fp16, k x hidden fp32, min(experts // k, 32) x hidden fp32 (k = experts per token); intermediate per rank."""
    h, moe = shape.hidden or 0, shape.moe or {}
    inter, k, experts = (moe.get("intermediate") or 0) // eng.tp, moe.get("per_token") or 0, moe.get("experts") or 0
    c, t, layers = max(1, PLAN_GPU_SMS // 12), MOE_TOKENS_PER_EXPERT, len(shape.layer_types)
    big = 2 * c * t * (h + inter) * 2
    small = 2 * k * (h + inter) * 2 + 2 * k * 8 + k * inter * 2 + k * h * 4
    small += min(experts // k if k else 0, MOE_MAX_EXPERTS_PER_TOKEN) * h * 4
    return layers * (big + small), (
        f"{layers} MoE layers x (2 x {c} x {t} x ({h} + {inter}) x 2 B + {small:,} B of small-batch buffers), "
        f"{c} = {PLAN_GPU_SMS} SMs // 12"
    )


def exl3_kept_weights(tensors: dict, eng: Engine) -> tuple[int, str]:
    """P12's opt-in float16 weights (overlay/decisions/p12_mid_batch.py): 2 x in x out bytes per EXL3 linear layer
    (trellis ``in/16 x out/16 x 16K``; routed experts excluded), per rank, up to the budget. An upper bound: P12 keeps a
    layer only where the kept weight was measured faster."""
    full = 0
    for name, t in tensors.items():
        if name.endswith(".trellis") and ".experts." not in name and len(t.get("shape") or ()) == 3:
            full += 2 * t["shape"][0] * 16 * t["shape"][1] * 16
    full //= eng.tp
    kept = full if eng.exl3_keep is None or eng.exl3_keep < 0 else min(full, eng.exl3_keep)
    budget = "all" if eng.exl3_keep is None or eng.exl3_keep < 0 else f"{eng.exl3_keep / GIB:g} GiB"
    return kept, f"float16 copies of the EXL3 linear layers, {full / GIB:.2f} GiB per rank, up to the budget ({budget})"


# the plan's terms that the engine's "Model loading took X GiB" figure holds (the rest come later in its start-up)
LOADING_TERMS = ("weights", "lora_buffers", "load_overhead", "exl3_moe_scratch", "exl3_kept_weights")


def loading_bytes(terms: dict) -> int:
    """What the engine will log as "Model loading took": the sum of the plan's LOADING_TERMS it has."""
    return sum(terms[k]["bytes"] for k in LOADING_TERMS if k in terms)


def is_mtp(name: str) -> bool:
    """A tensor of the MTP head: aphrodite's Qwen3.5 loaders skip every ``mtp.*`` tensor (0.20-0.23
    ``skip_prefixes``, 0.24 ``orig_to_new_prefix {"mtp.": None}``) unless MTP speculative decoding loads
    them as a draft model, so they take no memory in the served model."""
    return name.startswith("mtp.")


def plan(shape, tensors: dict, eng: Engine, exl3: bool) -> dict:
    """Every term per rank, the predicted available KV memory, and what the engine will report."""
    layers = len(shape.layer_types)
    tensors = {n: t for n, t in tensors.items() if not is_mtp(n)}
    width = dtype_bytes(eng.dtype)
    if eng.language_model_only:
        tensors = {n: t for n, t in tensors.items() if not (".visual." in n or n.startswith("visual."))}
    stored = sum(profile.loaded_bytes(n, t, width) for n, t in tensors.items())
    lora, lora_formula = lora_bytes(shape, eng)
    peak, peak_formula = profile.activation_peak(shape, tensors, eng, exl3)
    buffers, buffers_formula = profile.runner_buffers(shape, eng)
    graphs, graphs_formula = cudagraph_bytes(shape, eng)
    load = LOAD_OVERHEAD + LOAD_OVERHEAD_PER_LAYER * layers
    requested = math.ceil(eng.gpu_gib * GIB * eng.utilization)
    terms = {
        "requested": term(requested, f"{eng.gpu_gib:g} GiB x {eng.utilization:g} (per GPU)", "code"),
        "weights": term(
            stored // eng.tp, f"checkpoint tensors, floats as {eng.dtype}: {stored / GIB:.3f} GiB / TP {eng.tp}", "code"
        ),
        "lora_buffers": term(lora, lora_formula, "code"),
        "load_overhead": term(
            load, f"{LOAD_OVERHEAD // MIB} MiB + {LOAD_OVERHEAD_PER_LAYER // MIB} MiB x {layers} layers", "measured"
        ),
        "activation_peak": term(peak, peak_formula, "code, checked on one H200 start"),
        "non_torch": term(
            NON_TORCH, "cuBLAS / Triton workspaces at TP 1 on an H200 (NCCL's below)", "measured (GPU-dependent)"
        ),
        "cudagraphs": term(graphs, graphs_formula, "code structure, measured per-graph costs"),
        "runner_buffers": term(buffers, buffers_formula, "code"),
    }
    if exl3 and shape.moe:  # inside the engine's "Model loading took" figure, beside the weights
        scratch, scratch_formula = exl3_moe_scratch(shape, eng)
        terms["exl3_moe_scratch"] = term(scratch, scratch_formula, "code (the SM count: the GPU's)")
    if exl3 and eng.exl3_keep is not None:  # P12's opt-in, kept at load beside the weights
        kept, kept_formula = exl3_kept_weights(tensors, eng)
        terms["exl3_kept_weights"] = term(kept, kept_formula, "code (an upper bound: kept only where measured faster)")
    if eng.tp > 1:  # bounds.py: allocated by NCCL during the profiling run, in GPU memory over P2P / NVLink
        terms["nccl_buffers"] = term(
            0,
            "NCCL connection buffers: channels x 2 connections x 9.19 MiB, the channel count unknown here",
            "bound (not measured)",
        )
    if not eng.language_model_only and shape.vision:
        # the profiling run's vision encoder: its own peak before the text pass, its outputs kept through it
        extra, formula, _ = vision.vision_encoder(shape.vision, eng, peak)
        terms["vision_encoder"] = term(extra, formula, "code structure (one 0.24.1 engine at TP 1: pool within 1.2 %)")
    non_kv = sum(t["bytes"] for k, t in terms.items() if k != "requested")
    available = requested - non_kv
    layout = kv_layout(shape, eng)
    capacity = kv_capacity(layout, max(0, available), eng.max_model_len)
    return {
        "engine": {
            "gpu_gib": eng.gpu_gib,
            "tp": eng.tp,
            "gpu_memory_utilization": eng.utilization,
            "max_model_len": eng.max_model_len,
            "max_num_seqs": eng.max_num_seqs,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "kv_dtype": eng.kv_dtype,
            "dtype": eng.dtype,
            "enforce_eager": eng.eager,
            "lora": eng.lora,
            "max_loras": eng.max_loras,
            "max_lora_rank": eng.max_lora_rank,
            "prefix_caching": eng.prefix_caching_on,
            "release": eng.release or NEWEST_RELEASE,
            "exl3_keep": eng.exl3_keep,
            "image_limit": eng.image_limit,
            "image_tokens": eng.image_tokens,
            "defaults": eng.defaults_note,
        },
        "terms": terms,
        "non_kv_bytes": non_kv,
        "available_kv_bytes": available,
        "available_kv_gib": round(available / GIB, 2),
        "layout": layout,
        "capacity": capacity,
        "uncertainty": bounds.pool_range(
            terms, available, layout, eng.max_model_len, eng.gpu_gib >= BIG_GPU_GIB, kv_capacity
        ),
        "pin_kv_cache_memory": max(0, available - REDUNDANCY),
    }
