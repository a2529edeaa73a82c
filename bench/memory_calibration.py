"""Issue 19: what the engine itself logs about its memory at start-up, one `aphrodite run` at a time.

    python3 bench/memory_calibration.py MODELS --out DIR [--deadline S] [--only a,b]

For each configuration below: the real server (tests/gpu/server.py: ``aphrodite run`` as a user starts
it, the overlay found by aphrodite's plugin loader) alone on the GPU, so its memory profiling sees
nothing else, with ``APHRODITE_LOGGING_LEVEL=DEBUG`` for the profiling split. Once the engine has
logged its KV cache size and concurrency, the figures are taken from the log and the server is
stopped (CUDA graph capture and serving add nothing to them). Per configuration ``DIR/<name>.json``:
the command, the parsed figures, and the log's memory lines; ``DIR/inputs-<model>.json``: what
doctor reads of each model folder (config and safetensors header table), so the plan can be
recomputed on a machine without the checkpoints (bench/memory_plan_report.py). Resumable: a
configuration with a result is skipped.

The GPU is an H200 (about 140 GiB). A 24 GB or 32 GB consumer card is emulated with
``--gpu-memory-utilization`` such that the engine requests what it would request there (total x 0.92, aphrodite's
default utilization; runs 11 and 14 emulated total x 0.9, vLLM's, and bench/memory_plan_report.py plans those
rows at 0.9),
plus the batch defaults aphrodite picks for a GPU under 70 GiB (--max-num-batched-tokens 2048,
--max-num-seqs 256; engine/arg_utils.py get_batch_defaults). Terms that depend on the GPU itself
(CUDA context, cuBLAS workspace, graph pool granularity) are what they are on the H200: the report
says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from server import STARTUP_FIGURES, Server  # noqa: E402

GIB = 1 << 30
DEFAULT_UTILIZATION = 0.92  # aphrodite 0.20.0 - 0.24.1, config/cache.py (vLLM's is 0.9)
CONSUMER_BATCH = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"]
COMMON = ["--max-model-len", "32768", "--gdn-prefill-backend", "triton", "--seed", "0"]
TEXT = ["--language-model-only"]
LORA = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]


def gpu_total_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[1] / GIB


def consumer_card(card_gib: float, total_gib: float) -> list[str]:
    """--gpu-memory-utilization that requests card_gib x 0.92 of this GPU (aphrodite requests total x util,
    v1/worker/utils.py request_memory), and the batch defaults of a GPU under 70 GiB."""
    return ["--gpu-memory-utilization", f"{card_gib * DEFAULT_UTILIZATION / total_gib:.4f}", *CONSUMER_BATCH]


def configs(total_gib: float) -> dict[str, tuple[str, str | None, list[str]]]:
    """name: (model folder under MODELS, adapter folder or None, args); HELD_OUT are not used to calibrate."""

    def emulate(card_gib: float) -> list[str]:
        return consumer_card(card_gib, total_gib)

    return {
        # in the order they run (a deadline cuts the tail); --max-num-batched-tokens 8192 overrides 2048
        "9b-24g": ("9b/exl3", None, [*emulate(24), *TEXT]),
        "9b-24g-lora": ("9b/exl3", "9b/lora-a", [*emulate(24), *TEXT, *LORA]),
        "35b-a3b-32g": ("35b/exl3", None, [*emulate(32), *TEXT]),
        # bfloat16 weights, compiled, every engine default of the H200 (utilization 0.92, 8,192 batched tokens,
        # 1,024 sequences): the row that checks the 0.92 default itself (runs 11-14 passed 0.9)
        "27b-4layer-bf16-h200": ("27b4/dense", None, [*TEXT]),
        "9b-24g-fp8kv": ("9b/exl3", None, [*emulate(24), *TEXT, "--kv-cache-dtype", "fp8"]),
        "9b-24g-mnbt8192": ("9b/exl3", None, [*emulate(24), *TEXT, "--max-num-batched-tokens", "8192"]),
        "9b-24g-eager": ("9b/exl3", None, [*emulate(24), *TEXT, "--enforce-eager"]),
        # vision on, three images a prompt as a deployment of the 27B serves them (the profile encodes one image of the
        # processor's largest size either way); the 9B is written with the published vision tower (ci/gpu-run.sh cal)
        "9b-24g-vision": ("9b/exl3", None, [*emulate(24), "--limit-mm-per-prompt", '{"image": 3}']),
        # the held-out deployment's batch size with vision on (the encoder budget follows it: encoder_budget.py)
        "9b-24g-vision-mnbt8192": (
            "9b/exl3",
            None,
            [*emulate(24), "--limit-mm-per-prompt", '{"image": 3}', "--max-num-batched-tokens", "8192"],
        ),
        # vision on in the eager engine, where 0.24.1's text pass (0.47 GiB planned) is below the encoder's peak
        "9b-24g-vision-eager": (
            "9b/exl3",
            None,
            [*emulate(24), "--limit-mm-per-prompt", '{"image": 3}', "--enforce-eager"],
        ),
        # two axes in one start where the device time is short: no compile, no graphs, and an fp8 KV pool
        "9b-24g-eager-fp8kv": ("9b/exl3", None, [*emulate(24), *TEXT, "--enforce-eager", "--kv-cache-dtype", "fp8"]),
        "35b-a3b-32g-eager": ("35b/exl3", None, [*emulate(32), *TEXT, "--enforce-eager"]),
        # MoE profiled without the full-depth 35B (its writer takes 12 min of CPU: run 11): 4 layers at the
        # 35B-A3B layer width (32 experts of 512, 8 active), whose profiling peak is one layer's
        "35b4-32g-eager": ("35b4/exl3", None, [*emulate(32), *TEXT, "--enforce-eager"]),
        "35b4-32g": ("35b4/exl3", None, [*emulate(32), *TEXT]),  # the EXL3 MoE profiled in the default compiled mode
        # held out: the user's model at full depth on a 24 GB card
        "27b-24g": ("27b/exl3", None, [*emulate(24), *TEXT]),
        "35b-a3b-32g-lora": ("35b/exl3", "35b/lora-a", [*emulate(32), *TEXT, *LORA]),
        "27b-4layer-exl3-h200": ("27b4/exl3", None, ["--gpu-memory-utilization", "0.9", *TEXT]),
        "27b-24g-lora": ("27b/exl3", "27b/lora-a", [*emulate(24), *TEXT, *LORA]),
    }


HELD_OUT = ("27b-24g", "27b-24g-lora")
# the rows on 0.24.1 (float32 GDN state, as make-tiny writes the published configs), in the order they run:
# the 9B's four share one checkpoint and its compile cache; bfloat16 weights; the EXL3 MoE profiled, compiled
ISSUE34 = ("9b-24g", "9b-24g-vision", "9b-24g-mnbt8192", "9b-24g-lora", "27b-4layer-bf16-h200", "35b4-32g")

# the server suite's start-up figures (KV memory, tokens, concurrency, compile times), and the profiling split
FIGURES = {
    **{key: pattern.pattern for key, pattern in STARTUP_FIGURES.items()},
    "non_kv_gib": r"Total non KV cache memory: ([\d.]+)GiB",
    "torch_peak_gib": r"torch peak memory increase: ([\d.]+)GiB",
    "non_torch_gib": r"non-torch forward increase memory: ([\d.]+)GiB",
    "weights_gib": r"weights memory: ([\d.]+)GiB",
    "cudagraph_gib": r"Estimated CUDA graph memory: ([\d.]+) GiB total",
    "attention_block_size": r"Setting attention block size to (\d+) tokens",
    "mamba_padding_pct": r"Padding mamba page size by ([\d.]+)%",
    "init_free_gib": r"worker init memory snapshot: [^\n]*?free_memory=([\d.]+)GiB",
    # 0.23+: the drop in free memory the profile measured (the non-torch split is no longer logged)
    "total_consumed_gib": r"total consumed \(from mem_get_info\): ([\d.]+)GiB",
    "total_gib": r"worker init memory snapshot: .*?total_memory=([\d.]+)GiB",
    "requested_gib": r"worker requested memory: ([\d.]+)GiB",
    "model_loading_gib": r"Model loading took ([\d.]+) GiB memory",
}
MEMORY_LINE = re.compile(r"memory|KV cache|concurrency|block size|CUDA graph|Padding mamba", re.IGNORECASE)


def figures(text: str) -> dict:
    found = {}
    for key, pattern in FIGURES.items():
        match = re.search(pattern, text)
        if match:
            found[key] = float(match.group(1).replace(",", ""))
    return found


def engine_from_command(command: list[str], total_gib: float, release: str):
    """The ``arithmetic.Engine`` a calibration start planned for: its flags as ``aphrodite run`` read them (the last of
    a repeated flag wins), on a GPU of ``total_gib`` (the engine's own logged total; an emulated card is its
    ``--gpu-memory-utilization`` share of it)."""
    import json

    from hybrid_exl3_fixes.doctor.memory import arithmetic

    def value(flag: str, cast=str, default=None):
        found = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]
        return cast(found[-1]) if found else default

    prefix = (
        True if "--enable-prefix-caching" in command else False if "--no-enable-prefix-caching" in command else None
    )
    text_only, image_limit = arithmetic.vision.mm_limits_plan(json.loads(value("--limit-mm-per-prompt", default="{}")))
    return arithmetic.Engine(
        total_gib,
        tp=value("--tensor-parallel-size", int, 1),
        utilization=value("--gpu-memory-utilization", float, 0.92),
        max_model_len=value("--max-model-len", int, 4096),
        max_num_seqs=value("--max-num-seqs", int),
        max_num_batched_tokens=value("--max-num-batched-tokens", int),
        kv_dtype=value("--kv-cache-dtype", default="auto"),
        eager="--enforce-eager" in command,
        lora="--enable-lora" in command,
        max_loras=value("--max-loras", int, 1),
        max_lora_rank=value("--max-lora-rank", int, 16),
        language_model_only="--language-model-only" in command or text_only,
        image_limit=image_limit,
        prefix_caching=prefix,
        release=release,
    )


def save_inputs(models: Path, out: Path, folder: str) -> None:
    """What doctor reads of the folder (config.json, quantization_config.json, the header table)."""
    from hybrid_exl3_fixes.doctor import Report, read_weights

    dest = out / f"inputs-{folder.replace('/', '-')}.json"
    if dest.exists():
        return
    path = models / folder
    data = {
        name: json.loads((path / name).read_text())
        for name in ("config.json", "quantization_config.json", "preprocessor_config.json")
        if (path / name).exists()
    }
    data["tensors"] = read_weights(Report(str(path)), path)
    dest.write_text(json.dumps(data))


def run(name: str, spec: tuple, models: Path, out: Path, timeout: float, port: int) -> dict:
    folder, adapter, args = spec
    save_inputs(models, out, folder)
    extra = list(args)
    if adapter:
        extra += ["--lora-modules", f"a={models / adapter}"]
    env = {"APHRODITE_LOGGING_LEVEL": "DEBUG", "APHRODITE_CACHE_ROOT": str(out.parent / "calibration-cache")}
    server = Server(name, str(models / folder), [*COMMON, *extra], port, out / f"{name}.log", env)
    server.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.alive() and "Maximum concurrency for" not in server.text():
        time.sleep(2)
    time.sleep(1)
    text = server.text()
    elapsed = round(time.monotonic() - server.started, 1)
    server.stop()
    result = {
        "name": name,
        "held_out": name in HELD_OUT,
        "model": folder,
        "adapter": adapter,
        "command": server.command,
        "env": env,
        "seconds": elapsed,
        "logged": figures(text),
        "overlay": sorted(set(server.overlay_lines())),
        "memory_lines": [line[-300:] for line in text.splitlines() if MEMORY_LINE.search(line)][:80],
    }
    if "max_concurrency" not in result["logged"]:
        result["root_error"] = server.root_error()[:800]
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, help="folder holding 9b/, 35b/, 27b4/, 27b/ (make-tiny presets)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=3000, help="start no engine after this many seconds")
    parser.add_argument("--engine-timeout", type=float, default=600)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = configs(gpu_total_gib())
    wanted = [c for c in args.only.split(",") if c] or list(table)
    start = time.monotonic()
    for i, name in enumerate(wanted):
        if (args.out / f"{name}.json").exists():
            continue
        left = args.deadline - (time.monotonic() - start)
        if left < 60:
            print(f"deadline: {name} and later not started", flush=True)
            break
        result = run(name, table[name], args.models, args.out, min(args.engine_timeout, left), 8400 + i)
        print(f"{name}: {result['seconds']} s {result['logged']}", flush=True)


if __name__ == "__main__":
    main()
