"""hybrid-exl3-fixes: the overlay's command line. status: what each patch does in this aphrodite; doctor: preflight a
model folder and plan its memory; make-tiny: write a tiny synthetic EXL3 checkpoint; stubs: a libcuda stub for WSL2."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import sys

from .cli_status import cmd_status

EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in this tool, not in the user's input


DEBUG_ENV = "HYBRID_EXL3_FIXES_DEBUG"


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse turns the ValueError into a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def unit_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number from 0 to 1") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a number from 0 to 1")
    return value


def rates(text: str) -> float | tuple[float, ...]:
    """argparse type for --mtp-acceptance: one rate from 0 to 1, or up to 4 of them by commas (one token pool
    each: checkpoint/mtpaccept.py)."""
    values = tuple(unit_interval(part.strip()) for part in text.split(","))
    if len(values) > 4:
        raise argparse.ArgumentTypeError(f"{text}: at most 4 rates")
    return values[0] if len(values) == 1 else values


def mm_limits(text: str) -> dict[str, int]:
    """argparse type for --limit-mm-per-prompt: aphrodite's JSON object of modality -> count, e.g.
    '{"image": 0, "video": 0}' (all zero: the engine runs text-only)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            f'{text!r} is not a JSON object of modality -> count, e.g. \'{{"image": 0, "video": 0}}\''
        )
    return value


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybrid-exl3-fixes")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def cmd_make_tiny(args: argparse.Namespace) -> int:
    try:
        from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    except ImportError as exc:
        print(
            f"hybrid-exl3-fixes make-tiny: {exc.name or exc} is missing; make-tiny needs torch, safetensors and "
            "tokenizers: pip install 'hybrid-exl3-fixes[make-tiny]'",
            file=sys.stderr,
        )
        return 2
    if args.preset.endswith("-full"):
        return make_full(args)
    try:
        spec = TinySpec.preset(
            args.preset,
            bits=args.bits_given or 4,
            codebook=args.codebook,
            seed=args.seed,
            tp=args.tp,
            dtype=args.dtype,
            vision=args.vision,
            mtp_acceptance=args.mtp_acceptance,
        )
        if args.device:
            _check_device(args.device)
        manifest = write_tiny(args.dir, spec, device=args.device, dense=not args.no_dense)
    except ImportError as exc:  # torch, safetensors or tokenizers, imported when writing
        print(
            f"hybrid-exl3-fixes make-tiny: {exc.name or exc} is missing; make-tiny needs torch, safetensors and "
            "tokenizers: pip install 'hybrid-exl3-fixes[make-tiny]'",
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as exc:  # bad options, a folder it cannot create, a full disk: nothing is left
        print(f"hybrid-exl3-fixes make-tiny: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.dir}: exl3/ ({len(manifest['exl3_modules'])} EXL3 projections, {spec.bits} bits, "
        f"{args.codebook}, config dtype {args.dtype}), {'' if args.no_dense else 'dense/ (decoded twin), '}"
        f"{', '.join(manifest['adapters'])} (LoRA rank 8)"
    )
    return 0


def make_full(args: argparse.Namespace) -> int:
    """Full-depth presets: streamed layer by layer on the GPU, no dense twin."""
    try:
        from hybrid_exl3_fixes.checkpoint.stream import full_spec, write_full

        device = args.device or "cuda"
        _check_device(device)
        overrides = {
            k: v
            for k, v in (
                ("bits", args.bits_given),
                ("seed", args.seed),
                ("dtype", args.dtype),
                ("codebook", args.codebook),
                ("vision", args.vision),
                ("mtp_acceptance", args.mtp_acceptance),
            )
            if v is not None
        }
        if args.mtp_acceptance is not None:  # a known-acceptance head is written exactly (checkpoint/mtpaccept.py)
            overrides["head_bits"] = None
        spec = full_spec(args.preset, tp=args.tp, **overrides)
        manifest = write_full(args.dir, spec, device=device)
    except ImportError as exc:
        print(
            f"hybrid-exl3-fixes make-tiny: {exc.name or exc} is missing: pip install 'hybrid-exl3-fixes[make-tiny]'",
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as exc:
        print(f"hybrid-exl3-fixes make-tiny: {exc}", file=sys.stderr)
        return 2
    head = f"{spec.head_bits} bits" if spec.head_bits else "float16"
    print(
        f"wrote {args.dir}: exl3/ ({len(spec.layer_types)} layers, {len(manifest['exl3_modules'])} EXL3 projections, "
        f"{spec.bits} bits, head {head}, {manifest['weight_bytes'] / 2**30:.2f} GiB in "
        f"{len(spec.layer_types) + 3} shards), lora-a (attention and GDN), lora-mlp (and the MLP; no dense twin at "
        "full depth)" + (f"; MTP acceptance {spec.mtp_acceptance}" if spec.mtp_acceptance is not None else "")
    )
    return 0


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: torch sees no CUDA device here; leave --device out to use the CPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: make-tiny packs on the CPU or a CUDA device")


def default_stub_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hybrid-exl3-fixes", "libcuda-stub")


def cmd_stubs(args: argparse.Namespace) -> int:
    from hybrid_exl3_fixes.build_stubs import BuildError, build_stubs

    try:
        result = build_stubs(args.out, root=args.root)
    except BuildError as exc:
        print(f"hybrid-exl3-fixes stubs: {exc}", file=sys.stderr)
        return 2
    for cand in result.rejected:
        print(f"skipped {cand.path} ({cand.origin}): {cand.reason}")
    print(
        f"libcuda stub: {result.out}/libcuda.so, {result.source}, SONAME {result.soname}"
        + (f", {result.symbols} symbols" if result.symbols else "")
    )
    print("self-check passed: a probe linked as flashinfer links records NEEDED libcuda.so.1")
    for warning in result.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    print(f"next: source {result.out}/env.sh   (never put {result.out} on LD_LIBRARY_PATH)")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from hybrid_exl3_fixes.doctor import Options, as_json, diagnose, render
    from hybrid_exl3_fixes.doctor.memory.vision import mm_limits_plan

    # every Options field from the flag of its name (two flags are spelled as the engine spells them)
    spelled = {"utilization": "gpu_memory_utilization", "prefix_caching": "enable_prefix_caching"}
    values = {
        f.name: getattr(args, spelled.get(f.name, f.name))
        for f in dataclasses.fields(Options)
        if hasattr(args, spelled.get(f.name, f.name))
    }
    text_only, image_limit = mm_limits_plan(args.limit_mm_per_prompt)
    options = Options(
        **{**values, "language_model_only": args.language_model_only or text_only, "image_limit": image_limit}
    )
    report = diagnose(args.model_dir, options)
    if args.json:
        print(as_json(report), file=args.json_out)
    else:
        print(render(report))
    return report.exit_code


def release_name(text: str) -> str:
    """An aphrodite-engine release as X.Y.Z (argparse type)."""
    parts = text.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a release number like 0.24.1")
    return ".".join(str(int(p)) for p in parts)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every subcommand and flag), parsed by ``main``."""
    from hybrid_exl3_fixes.doctor import DTYPE_CHOICES  # torch-free, light
    from hybrid_exl3_fixes.doctor.shape import SSM_DTYPES

    parser = argparse.ArgumentParser(prog="hybrid-exl3-fixes", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    # required is checked by parse_command, after the unknown flags: those are named first
    sub = parser.add_subparsers(dest="command", metavar="{status,make-tiny,stubs,doctor}")
    status = sub.add_parser(
        "status",
        help="apply through aphrodite's plugin loader and print each patch's status",
        description="Exit 0: every patch applied, fixed upstream or not applicable; "
        "1: a patch DRIFTED or FAILED, or HYBRID_EXL3_FIXES_DISABLE names no patch; 2: aphrodite would not load "
        "the plugin; "
        "3: the aphrodite install is broken (a package it needs is missing).",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    tiny = sub.add_parser(
        "make-tiny",
        help="write a tiny synthetic EXL3 Qwen3.5 hybrid, its dense twin and two LoRA adapters",
        description="Writes DIR/exl3 (the EXL3 checkpoint in the form exllamav3 writes: config, safetensors, "
        "quantization_config.json, tokenizer, chat template), DIR/dense (its exact dense twin, for HF "
        "transformers), DIR/lora-a and DIR/lora-b (PEFT adapters; the MoE presets add DIR/lora-experts) and "
        "DIR/manifest.json. Downloads nothing.",
    )
    tiny.add_argument("dir", help="a new (or empty) folder")
    tiny.add_argument(
        "--bits",
        type=positive_int,
        dest="bits_given",
        default=None,
        metavar="K",
        help="EXL3 bitrate K, 1..8 (default 4; the full-depth presets set their own)",
    )
    tiny.add_argument(
        "--codebook",
        default="mcg",
        choices=["3inst", "mcg", "mul1", "mixed"],
        help="EXL3 codebook of every quantized projection (mixed: 3inst, mcg and mul1 in turn, P3's case; "
        "default mcg, the one aphrodite's MoE kernel takes on every release)",
    )
    tiny.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of every random tensor (same seed, same bytes)"
    )
    tiny.add_argument("--tp", type=positive_int, default=2, help="largest tensor-parallel size to stay 128-aligned for")
    tiny.add_argument(
        "--device",
        help="torch device to pack and decode on, e.g. cuda (default: the CPU); "
        "the EXL3 tensors are the same either way",
    )
    tiny.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16"],
        help="the config's dtype (default bfloat16, as exllamav3 keeps the source model's and "
        "Qwen3.5/3.6 are bfloat16); float16 writes the checkpoints of this project before 2026-12-01",
    )
    tiny.add_argument("--no-dense", action="store_true", help="skip the dense twin (benchmarks never read it)")
    tiny.add_argument(
        "--mtp-acceptance",
        type=rates,
        metavar="P[,P...]",
        help="an MTP head that agrees with the model's greedy continuation at rate P (0..1), for speculative "
        "decoding at a known acceptance; several rates by commas, one token pool each (docs/make-tiny.md); a "
        "*-full preset then keeps lm_head float16",
    )
    tiny.add_argument(
        "--vision",
        default="tiny",
        choices=["tiny", "published"],
        help="the vision tower: tiny (default, one block of width 128) or published (the published models' 27 "
        "blocks of width 1152, 0.8 GiB, for memory-plan rows with vision on)",
    )
    tiny.add_argument(
        "--preset",
        default="tiny",
        choices=[
            "tiny",
            "tiny-moe",
            "qwen3.6-35b-a3b",
            "qwen3.6-27b",
            "qwen3.6-27b-full",
            "qwen3.5-9b-full",
            "qwen3.6-35b-a3b-full",
        ],
        help="tiny (default); tiny-moe: the tiny shape with routed experts and a shared expert (and an adapter "
        "over the experts too); qwen3.6-35b-a3b: the same at the 35B-A3B layer dimensions, 4 layers, 32 of its "
        "256 experts; qwen3.6-27b: the 27B layer dimensions with 4 layers, for benchmarks; *-full: "
        "the published models' full depth and widths, streamed on the GPU layer by layer, no dense twin",
    )
    tiny.set_defaults(func=cmd_make_tiny)
    stubs = sub.add_parser(
        "stubs",
        help="find or generate a libcuda stub for JIT links (WSL2, conda CUDA) and write env.sh",
        description="Exit 0: stub written and self-checked; 2: bad input or environment (nothing written).",
    )
    stubs.add_argument(
        "--out", default=default_stub_dir(), help="folder for libcuda.so, env.sh, manifest.json (default: %(default)s)"
    )
    stubs.add_argument("--root", default="/", help="filesystem root to search (for testing layouts)")
    stubs.set_defaults(func=cmd_stubs)
    doctor = sub.add_parser(
        "doctor",
        help="preflight a hybrid GDN (+EXL3) model folder and plan its memory",
        description="Reads the folder's JSON files and safetensors headers (no weights), checks them against the "
        "installed aphrodite and this overlay, and, given --gpu-mem, plans the engine's memory. Exit 0: ok; "
        "1: warnings; 2: blocking problems.",
    )
    doctor.add_argument("model_dir", help="the model folder aphrodite will be given (config.json, *.safetensors)")
    doctor.add_argument("--gpu-mem", type=positive_float, help="GiB per GPU (enables the KV pool and concurrency plan)")
    doctor.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="GPUs on the machine: replicas = GPUS // TP in the plan (--tp is the engine's own flag)",
    )
    doctor.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    doctor.add_argument(
        "--max-model-len", type=positive_int, help="as given to the engine (default: the config's max positions)"
    )
    doctor.add_argument(
        "--max-num-seqs", type=positive_int, help="default: the engine's (1024 on a GPU of >= 70 GiB, else 256)"
    )
    doctor.add_argument(
        "--max-num-batched-tokens", type=positive_int, help="default: the engine's (8192 on >= 70 GiB, else 2048)"
    )
    doctor.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (their memory leaves the plan)")
    doctor.add_argument(
        "--limit-mm-per-prompt",
        type=mm_limits,
        help='the engine\'s JSON, e.g. \'{"image": 0, "video": 0}\' (all zero: text only, as --language-model-only)',
    )
    doctor.add_argument("--max-loras", type=positive_int, default=1, help="with --enable-lora (engine default 1)")
    doctor.add_argument("--max-lora-rank", type=positive_int, default=16, help="with --enable-lora (engine default 16)")
    doctor.add_argument(
        "--kv-cache-dtype",
        "--kv-dtype",
        dest="kv_dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="the engine's --kv-cache-dtype (auto: the activations' dtype; the fp8 kinds take 1 byte)",
    )
    doctor.add_argument(
        "--gpu-memory-utilization", type=fraction, default=0.92, help="default: aphrodite's (0.92; vLLM's is 0.9)"
    )
    doctor.add_argument(
        "--language-model-only", action="store_true", help="text only: no processor files, no image budget"
    )
    doctor.add_argument("--enable-lora", action="store_true", help="the engine will run with --enable-lora")
    doctor.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPE_CHOICES),
        help="the engine's --dtype (default auto: the config's); float16 activations decide the compiled-mode check",
    )
    doctor.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's flag (default: the release's: on for hybrid models from 0.23.0); on, each request holds "
        "two GDN state blocks per state group instead of one",
    )
    ssm_help = "the engine's flag (default auto: the config's mamba_ssm_dtype, float32 in the published configs)"
    doctor.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", *SSM_DTYPES], help=ssm_help)
    doctor.add_argument(
        "--release",
        type=release_name,
        help="plan for this aphrodite-engine release, e.g. 0.21.0 (default: the installed one, else 0.24.1)",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings and the plan as JSON")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    actions = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return actions.choices[command]


def parse_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` where an unknown flag is a usage error that names it, with the usage of the command it
    was given to (and the closest flag that command has), not argparse's top-level usage or a missing command."""
    args, unknown = parser.parse_known_args(argv)
    where = parser if args.command is None else subparser(parser, args.command)
    if unknown:
        flags = [o for a in where._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(unknown[0].split("=", 1)[0], flags, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.command is None:
        parser.error("a command is required: status, make-tiny, stubs or doctor")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command(parser, argv)
    try:
        if not getattr(args, "json", False):
            return args.func(args)
        # --json: stdout carries the JSON document alone. aphrodite's logger writes to sys.stdout as it
        # is when aphrodite is first imported, which happens inside the command: send that to stderr.
        args.json_out = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return args.func(args)
    except KeyboardInterrupt:
        print(f"hybrid-exl3-fixes {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every expected bad input has its own message; this is a bug of ours
        if os.environ.get(DEBUG_ENV):
            raise
        print(
            f"hybrid-exl3-fixes {args.command}: unexpected {type(exc).__name__}: {exc}. This is a bug in "
            f"hybrid-exl3-fixes: rerun with {DEBUG_ENV}=1 and report the traceback",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
