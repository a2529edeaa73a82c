"""Issue 18: the memory roofline of a decode step, from what doctor reads of a model folder.

    python3 bench/roofline.py MODEL_DIR --bandwidth GBPS [--concurrency 1,2,...] [--prompt 512 --output 256]
    python3 bench/roofline.py --measure            # on the GPU: the device-to-device copy bandwidth

A decode step at N concurrent sequences must read, at least once: every weight byte the step touches
(all of a dense model's EXL3 tensors, norms and the head; for a MoE only the experts its N x k routes
select, the expected number of distinct experts per layer; the embedding rows of N tokens; not the
vision tower, nor the MTP head's ``mtp.*`` tensors, which a step without speculative decoding never
reads), each sequence's KV cache (its full-attention layers over the current context) and GatedDeltaNet
state (read and written: the state is updated in place every step), in the state dtype the engine keeps
(``state_dtype``: aphrodite's is the config's ``mamba_ssm_dtype`` or ``--mamba-ssm-cache-dtype``,
exllamav3's its Cache ``recurrent_dtype``, float16 by default). The roofline speed is N tokens per
(those bytes / the copy bandwidth measured on the same GPU in the same run); a real step is slower.
The context is the prompt plus half the output (the mean over the decode).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def unread(key: str) -> bool:
    """Tensors a decode step without speculative decoding never reads: the vision tower and the MTP head."""
    return ".visual." in key or key.startswith(("visual.", "mtp.")) or ".mtp." in key


def step_bytes(
    shape,
    tensors: dict,
    n: int,
    context: int,
    kv_dtype: str = "auto",
    dtype: str = "bfloat16",
    state_dtype: str | None = None,
) -> dict:
    """Bytes one decode step at ``n`` sequences of ``context`` tokens must read, by kind; ``state_dtype`` the GDN
    recurrent state's storage where the engine's differs from the config's (``shape.ssm_dtype``)."""
    import dataclasses

    from hybrid_exl3_fixes.doctor import kv_bytes_per_token, state_bytes_per_sequence

    embed = sum(t["bytes"] for k, t in tensors.items() if "embed_tokens" in k and not unread(k))
    experts = sum(t["bytes"] for k, t in tensors.items() if ".mlp.experts." in k and not unread(k))
    rest = sum(t["bytes"] for k, t in tensors.items() if not unread(k)) - embed - experts
    expert_bytes = 0
    if experts and shape.moe and shape.moe.get("experts"):
        e, k = shape.moe["experts"], shape.moe["per_token"]
        distinct = e * (1 - (1 - k / e) ** n)  # expected distinct experts per layer for n tokens routed k each
        expert_bytes = experts * distinct / e
    vocab = shape.vocab or 1
    kv_tok, _ = kv_bytes_per_token(shape, kv_dtype)
    if state_dtype:
        shape = dataclasses.replace(shape, ssm_dtype=state_dtype)
    recurrent, conv, _ = state_bytes_per_sequence(shape, dtype)
    parts = {
        "weights": rest + expert_bytes + embed * min(n, vocab) / vocab,
        "kv": n * context * kv_tok,
        "state": n * 2 * (recurrent + conv),
    }
    parts["total"] = sum(parts.values())
    return parts


def roofline(
    shape,
    tensors: dict,
    bandwidth_gbps: float,
    concurrency: list[int],
    prompt: int,
    output: int,
    state_dtype: str | None = None,
) -> list:
    context = prompt + output // 2
    rows = []
    for n in concurrency:
        b = step_bytes(shape, tensors, n, context, state_dtype=state_dtype)
        step_s = b["total"] / (bandwidth_gbps * GB)
        rows.append(
            {
                "concurrency": n,
                "context": context,
                "weight_gb": round(b["weights"] / GB, 3),
                "kv_gb": round(b["kv"] / GB, 3),
                "state_gb": round(b["state"] / GB, 3),
                "state_dtype": state_dtype or shape.ssm_dtype or "bfloat16",
                "step_ms": round(step_s * 1e3, 3),
                "roofline_tok_s": round(n / step_s, 1),
                "roofline_tok_s_per_request": round(1 / step_s, 1),
            }
        )
    return rows


def measure_bandwidth(gib: int = 4, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second), median of ``repeats``."""
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[3:])
    return round(2 * src.numel() / times[len(times) // 2] / GB, 1)


def load(model_dir: Path):
    from hybrid_exl3_fixes.doctor import Report, parse_config, read_weights

    config = json.loads((model_dir / "config.json").read_text())
    shape, problems = parse_config(config)
    if problems:
        raise SystemExit(f"roofline: {model_dir}/config.json: {problems[0]}")
    return shape, read_weights(Report(str(model_dir)), model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", type=Path)
    parser.add_argument("--bandwidth", type=float, help="GB/s (from --measure on the same GPU)")
    parser.add_argument("--measure", action="store_true", help="measure the copy bandwidth on the GPU and exit")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    args = parser.parse_args(argv)
    if args.measure:
        import torch

        if not torch.cuda.is_available():
            parser.error("--measure needs a CUDA GPU (none here): give the figure of one with --bandwidth")
        print(json.dumps({"copy_bandwidth_gbps": measure_bandwidth()}))
        return 0
    if args.model_dir is None or args.bandwidth is None:
        parser.error("give MODEL_DIR and --bandwidth (or --measure)")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} has no config.json")
    shape, tensors = load(args.model_dir)
    rows = roofline(
        shape, tensors, args.bandwidth, [int(c) for c in args.concurrency.split(",")], args.prompt, args.output
    )
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
