"""Issue 7: the original deployment's serving experiments on a synthetic EXL3 hybrid at Qwen3.6-27B
layer widths, aphrodite-engine with the overlay, one engine per configuration (each in a fresh
process, as `aphrodite run` would start it).

    for cb in mcg mixed 3inst mul1; do
      hybrid-exl3-fixes make-tiny MODELS/$cb --preset qwen3.6-27b --codebook $cb --device cuda
    done
    python3 bench/serving.py MODELS --out DIR [--only concurrency,lora,graphs,codebooks,chunk]
    python3 bench/plot_serving.py DIR          # tables, goals and plots from DIR/serving.csv

Experiments (every ratio is taken between engines of the same run on the same GPU):
  concurrency  N = 1..128 requests submitted at once (prompt 128 random tokens, 128 output tokens,
               greedy, ignore_eos), CUDA graphs on (the default): output throughput, time to first
               token, per-request decode speed. Model: MODELS/mcg.
  lora         N = 1 and 32 with --enable-lora: no adapter in the batch, one adapter, four adapters
               (the two make-tiny wrote, each also under a second id) spread over the batch; against
               the concurrency rows (LoRA off) at the same N.
  graphs       the same model in eager mode (--enforce-eager) at N = 1, 8, 32, 128.
  codebooks    MODELS/mixed (codebooks cycling 3INST/mcg/mul1 over the projections: P3 routes the
               layers whose small-batch GEMM cache key another codebook owns) and the single-codebook
               MODELS/3inst, MODELS/mul1 at N = 1, 8, 32, 128; against MODELS/mcg.
  chunk        one long prompt (12,000 tokens) and five short ones (128) submitted together, for
               --max-num-batched-tokens 256..8192: total time and spread of completion times.
Each measurement follows a short warm-up request and is the best of two repetitions (highest
throughput). Writes DIR/result-ENGINE.json per engine (resumable: engines with a result are
skipped), DIR/engine-ENGINE.log, and DIR/serving.csv + DIR/serving.json (all engines so far).
``--deadline S``: start no engine after S seconds, so a capped session ends with its results saved.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128]
SHORT_SWEEP = [1, 8, 32, 128]
CHUNKS = [256, 512, 1024, 2048, 4096, 8192]
PROMPT, OUTPUT, LONG = 128, 128, 12000
REPEATS = 2  # --repeats
ENGINE_GUESS_S = 150  # an engine start plus its measurements, for --deadline


def engine_cases(models: Path, only: set[str], chunks: list[int]) -> list[dict]:
    base = {"max_model_len": 16384, "max_num_seqs": 128}
    mcg = str(models / "mcg" / "exl3")
    adapters = {p.name: str(p) for p in sorted((models / "mcg").glob("lora-*"))}
    cases = []
    if only & {"concurrency", "lora", "graphs", "codebooks"}:
        cases.append({**base, "name": "exl3", "model": mcg, "work": [("concurrency", CONCURRENCY)]})
    if "lora" in only:
        cases.append(
            {
                **base,
                "name": "exl3+lora",
                "model": mcg,
                "enable_lora": True,
                "adapters": adapters,
                "work": [("lora", [1, 32])],
            }
        )
    if "graphs" in only:
        cases.append(
            {**base, "name": "exl3-eager", "model": mcg, "enforce_eager": True, "work": [("concurrency", SHORT_SWEEP)]}
        )
    if "codebooks" in only:
        cases += [
            {**base, "name": f"exl3-{cb}", "model": str(models / cb / "exl3"), "work": [("concurrency", SHORT_SWEEP)]}
            for cb in ("mixed", "3inst", "mul1")
        ]
    if "chunk" in only:
        cases += [
            {**base, "name": f"chunk-{c}", "model": mcg, "max_num_batched_tokens": c, "work": [("chunk", [6])]}
            for c in chunks
        ]
    return cases


# -- the engine process ----------------------------------------------------------------------


def timed(engine, prompts: list[list[int]], loras: list | None = None, output: int = OUTPUT) -> list[dict]:
    """Submit every prompt at once and step the engine as LLM.generate does; per request: time of
    its first token and of its completion (s after submission)."""
    from aphrodite import SamplingParams
    from aphrodite.sampling_params import RequestOutputKind

    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]  # unique within the engine
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=output, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        engine.add_request(ids[i], {"prompt_token_ids": p}, params, lora_request=loras[i] if loras else None)
    first, done, tokens = {}, {}, {r: 0 for r in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            tokens[out.request_id] += len(out.outputs[0].token_ids)
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    return [{"first": first[r], "done": done[r], "tokens": tokens[r]} for r in ids]


def summarise(times: list[dict], output: int = OUTPUT) -> dict:
    wall = max(t["done"] for t in times)
    return {
        "wall_s": round(wall, 4),
        "throughput_tok_s": round(sum(t["tokens"] for t in times) / wall, 1),
        "ttft_ms_mean": round(1000 * statistics.mean(t["first"] for t in times), 1),
        "decode_tok_s_per_request": round(
            statistics.mean((t["tokens"] - 1) / (t["done"] - t["first"]) for t in times), 1
        ),
        "tokens_short": sum(t["tokens"] != output for t in times),
    }


def worker(case_path: str) -> None:
    case = json.loads(Path(case_path).read_text())
    from aphrodite import LLM
    from aphrodite.lora.request import LoRARequest

    # the engine's defaults (attention backend, torch.compile + CUDA graphs) except the GDN prefill
    # backend: FlashInfer's GDN prefill, the default on SM90, compiles its kernel at the first prefill, minutes on a
    # fresh machine
    kwargs = dict(
        model=case["model"],
        quantization="exl3",
        max_model_len=case["max_model_len"],
        gpu_memory_utilization=0.85,
        gdn_prefill_backend="triton",
        language_model_only=True,
        max_num_seqs=case["max_num_seqs"],
        seed=0,
        enforce_eager=case.get("enforce_eager", False),
    )
    if "max_num_batched_tokens" in case:
        kwargs.update(max_num_batched_tokens=case["max_num_batched_tokens"], enable_chunked_prefill=True)
    if case.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=4)
    kwargs.update(case.get("engine_args", {}))  # --engine-args: e.g. compilation_config variants
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.get_vocab_size()

    prompt_len, output = case.get("prompt", PROMPT), case.get("output", OUTPUT)

    def prompts(n, length=None):
        return [[rng.randrange(10, vocab - 10) for _ in range(length or prompt_len)] for _ in range(n)]

    rows = []

    def record(row: dict, fill) -> None:
        """Warm up, then ``row.update(fill())``; an error is recorded in the row and the remaining
        measurements still run."""
        try:
            timed(engine, prompts(1), output=output)  # warm-up: the engine is idle and its caches settled
            row.update(fill(), error="")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)

    def best_of(n, loras=None):
        runs = [
            summarise(timed(engine, prompts(n), loras, output), output) for _ in range(case.get("repeats", REPEATS))
        ]
        return {
            **max(runs, key=lambda r: r["throughput_tok_s"]),
            "throughput_reps": " ".join(str(r["throughput_tok_s"]) for r in runs),
        }

    def mixed_workload():
        times = timed(engine, prompts(1, LONG) + prompts(5), output=output)
        done = [t["done"] for t in times]
        return dict(
            wall_s=round(max(done), 4),
            long_done_s=round(done[0], 3),
            short_done_s_mean=round(statistics.mean(done[1:]), 3),
            short_ttft_ms_mean=round(1000 * statistics.mean(t["first"] for t in times[1:]), 1),
            spread_s=round(statistics.pstdev(done), 4),
        )

    def measure(workload, n, loras=None):
        record({"engine": case["name"], "workload": workload, "n": n}, lambda: best_of(n, loras))

    for work, sizes in case["work"]:
        if work == "concurrency":
            for n in sizes:
                measure("no adapter", n)
        elif work == "lora":
            paths = sorted(case["adapters"].items())
            # four adapters: the two written, each also under a second id (a separate slot)
            four = [
                LoRARequest(f"{name}-{k}", 1 + i + k * len(paths), path)
                for k in range(2)
                for i, (name, path) in enumerate(paths)
            ]
            for n in sizes:
                measure("lora on, no adapter", n)
                measure("one adapter", n, [four[0]] * n)
                measure("four adapters", n, [four[i % 4] for i in range(n)])
        elif work == "chunk":
            record(
                {
                    "engine": case["name"],
                    "workload": "long+5 short",
                    "n": 6,
                    "max_num_batched_tokens": case["max_num_batched_tokens"],
                },
                mixed_workload,
            )
    print(
        "RESULT "
        + json.dumps(
            {"ok": True, "start_s": round(start_s, 2), "rows": rows, "enforce_eager": kwargs["enforce_eager"]}
        ),
        flush=True,
    )


# -- the driver ------------------------------------------------------------------------------

OVERLAY_LINE = re.compile(r"hybrid-exl3-fixes: (applied=.*)")
P3_ROUTED = re.compile(r"hybrid-exl3-fixes: P3: .* routed to the (uncached kernel launch|reconstruct path)")
P3_PROBE = re.compile(r"hybrid-exl3-fixes: (P3 probe on .*)")


CAUSE = re.compile(r"^(?:ERROR [0-9:]+ )?((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Unsupported): .*)$", re.M)


def root_cause(log: str) -> str:
    """The first exception line of an engine log that is not the front end's "Engine core
    initialization failed" (the engine core's own error, logged before it)."""
    found = [m for m in CAUSE.findall(log) if "Engine core initialization failed" not in m]
    return found[0].strip() if found else ""


def run_engine(case: dict, out: Path, timeout_s: float) -> dict:
    case_path = out / f"case-{case['name']}.json"
    case_path.write_text(json.dumps(case))
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(case_path)], capture_output=True, text=True, timeout=timeout_s
        )
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (
            exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ) + f"\ntimeout after {timeout_s} s"
    log = stdout + stderr
    (out / f"engine-{case['name']}.log").write_text(log)
    results = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    partial = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
    result = (
        results[-1] if results else {"ok": False, "rows": partial, "error": stderr[-3000:], "cause": root_cause(log)}
    )
    result.update(
        engine=case["name"],
        wall_s=round(time.perf_counter() - started, 1),
        overlay=sorted(set(OVERLAY_LINE.findall(log))),
        p3_probe=sorted(set(P3_PROBE.findall(log))),
        p3_routed=dict(Counter(P3_ROUTED.findall(log))),
    )
    return result


def collect(out: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("result-*.json"))]
    rows = [r for res in results for r in res.get("rows", [])]
    (out / "serving.json").write_text(
        json.dumps({r["engine"]: {k: v for k, v in r.items() if k != "rows"} for r in results}, indent=2)
    )
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(out / "serving.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def cases_from_args(args, models: Path, only: set[str]) -> list[dict]:
    """The engines of the chosen experiments with the command line's workload and variants applied."""
    cases = engine_cases(models, only, [int(c) for c in args.chunks.split(",")])
    if args.engines:
        cases = [c for c in cases if c["name"] in args.engines.split(",")]
    if args.eager:
        cases = [{**c, "enforce_eager": True} for c in cases if c["name"] != "exl3-eager"]
    sweep = [int(n) for n in args.concurrency.split(",")]
    workload = {
        "prompt": args.prompt,
        "output": args.output,
        "max_num_seqs": max(128, *sweep),
        "max_model_len": max(16384, args.prompt + args.output),
    }
    cases = [
        {
            **c,
            **workload,
            "name": c["name"] + args.tag,
            "repeats": args.repeats,
            "engine_args": args.engine_args,
            "work": [(w, sweep if w == "concurrency" and c["name"] == "exl3" else n) for w, n in c["work"]],
        }
        for c in cases
    ]
    return cases


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", help="folder of make-tiny outputs named by codebook: mcg (and mixed, 3inst, mul1)")
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", default="concurrency,lora,graphs,codebooks,chunk")
    ap.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="--max-num-batched-tokens values")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds; start no engine after that")
    ap.add_argument("--engine-timeout", type=float, default=540.0)
    ap.add_argument("--eager", action="store_true", help="every engine in eager mode (--enforce-eager)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="repetitions per measurement (the best is kept)")
    ap.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        help="JSON merged into every engine's LLM(...) arguments, e.g. "
        '\'{"compilation_config": {"cudagraph_mode": "NONE"}}\'',
    )
    ap.add_argument(
        "--engines",
        default="",
        help="comma-separated engine names (before --tag): run only these of the experiments' engines",
    )
    ap.add_argument("--tag", default="", help="suffix for the engine names, so variants keep their own results")
    ap.add_argument("--prompt", type=int, default=PROMPT, help=f"prompt tokens per request (default {PROMPT})")
    ap.add_argument("--output", type=int, default=OUTPUT, help=f"output tokens per request (default {OUTPUT})")
    ap.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="N values of the concurrency sweep (1,2,4,...,256)",
    )
    return ap


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    args = parser().parse_args()
    began = time.perf_counter()
    out, models = Path(args.out), Path(args.models)
    only = set(args.only.split(","))
    unknown = only - {"concurrency", "lora", "graphs", "codebooks", "chunk"}
    cases = cases_from_args(args, models, only)
    missing = sorted({str(Path(c["model"]).parent) for c in cases if not (Path(c["model"]) / "config.json").is_file()})
    if unknown or missing:
        sys.exit(
            f"serving.py: unknown experiments {sorted(unknown)}"
            if unknown
            else f"serving.py: no checkpoint in {', '.join(missing)}: write them with hybrid-exl3-fixes make-tiny "
            "(see this script's docstring)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        done = out / f"result-{case['name']}.json"
        if done.is_file() and json.loads(done.read_text()).get("ok"):
            print(f"{case['name']}: done before, skipped", flush=True)
            continue
        left = args.deadline - (time.perf_counter() - began)
        if left < ENGINE_GUESS_S:
            print(f"{case['name']}: not started, {left:.0f} s left before the deadline", flush=True)
            continue
        result = run_engine(case, out, min(args.engine_timeout, left))
        done.write_text(json.dumps(result, indent=1))
        collect(out)
        print(
            case["name"],
            {k: v for k, v in result.items() if k not in ("rows", "error")},
            "ERROR " + result["error"][-300:] if "error" in result else "",
            flush=True,
        )


if __name__ == "__main__":
    main()
