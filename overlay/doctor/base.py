"""Findings, the report they make up, and the units doctor counts in."""

from __future__ import annotations

from dataclasses import dataclass, field

from .memory.vision import DEFAULT_IMAGE_LIMIT
from .memory.vision import DEFAULT_LONGEST_EDGE as _PUBLISHED_LONGEST_EDGE

GIB = 1 << 30
MIB = 1 << 20
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
TOKENIZER_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"))
KNOWN_ARCHS = {
    "Qwen3_5ForConditionalGeneration": "aphrodite >= 0.20",
    "Qwen3_5MoeForConditionalGeneration": "aphrodite >= 0.20",
    "Qwen3_5ForCausalLM": "aphrodite >= 0.23 (text-only checkpoints do not load in 0.21)",
    "Qwen3NextForCausalLM": "aphrodite >= 0.20",
}
# Column-parallel projections split their output across TP ranks, row-parallel ones their input.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz")
ROW = ("o_proj", "down_proj", "out_proj")
DEFAULT_LONGEST_EDGE = _PUBLISHED_LONGEST_EDGE  # the published preprocessor_config.json size.longest_edge
# --dtype values aphrodite accepts, by the activation dtype they give (auto: the config's)
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "half", "float32", "float")
CONFIG_DTYPES = ("bfloat16", "float16", "float32", "half", "float", "auto")
COMPILED_CRASH_DOC = "docs/upstream/exl3-compiled-illegal-address.md"


@dataclass(frozen=True)
class Options:
    """What doctor is told about the engine that will serve the folder: the engine's own flags where it has one
    (defaults as `aphrodite run` resolves them), plus ``gpu_mem`` and ``gpus`` (the machine) and
    ``check_overlay`` (whether to evaluate the patches in this process)."""

    gpu_mem: float | None = None  # GiB per GPU; None: no KV pool or concurrency plan
    gpus: int = 1
    tp: int = 1
    max_model_len: int | None = None  # None: the config's max_position_embeddings
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_dtype: str = "auto"
    utilization: float = 0.92
    language_model_only: bool = False
    image_limit: int = DEFAULT_IMAGE_LIMIT  # --limit-mm-per-prompt's image count (aphrodite's for one left unset)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    dtype: str = "auto"
    enforce_eager: bool = False
    prefix_caching: bool | None = None  # None: the release's default
    # --mamba-ssm-cache-dtype: auto keeps the config's mamba_ssm_dtype; any other value replaces it
    mamba_ssm_cache_dtype: str = "auto"
    release: str | None = None  # None: the installed release, else arithmetic.NEWEST_RELEASE
    check_overlay: bool = True


@dataclass
class Finding:
    level: str  # OK | WARN | BLOCK
    check: str
    message: str


@dataclass
class Report:
    model: str
    findings: list[Finding] = field(default_factory=list)
    plan: dict = field(default_factory=dict)

    def add(self, level: str, check: str, message: str) -> None:
        self.findings.append(Finding(level, check, message))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        return 2 if "BLOCK" in levels else 1 if "WARN" in levels else 0
