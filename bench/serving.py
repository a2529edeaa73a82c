"""Issue 7: the original deployment's serving experiments on a synthetic EXL3 hybrid, one engine per
configuration (each in a fresh process), with the overlay on.

    hybrid-exl3-fixes make-tiny MODEL --preset qwen3.6-27b      # 27B layer widths, 4 layers
    python3 bench/serving.py MODEL --out DIR [--only concurrency,lora,chunk,graphs]

Experiments (ratios are taken within one run, on one machine):
  concurrency  N = 1..128 requests at once (prompt 128, output 128 tokens, greedy, ignore_eos):
               throughput and per-request decode speed; CUDA graphs on (the default).
  lora         the same at N = 1 and 32: EXL3 alone (LoRA off) against LoRA on with no adapter in
               the batch, one adapter, and two adapters alternating.
  chunk        one long prompt (12,000 tokens) and five short ones submitted together, for
               --max-num-batched-tokens 256..8192: total time and the spread of completion times.
  graphs       CUDA graphs against eager mode at N = 1 and 32.
Writes DIR/serving.csv (one row per measurement) and DIR/serving.json (engine start times, errors).

Status: written after the H200 time of 2026-11-30 was spent; not yet run. The engine arguments
are those that worked on the H200 (tests/gpu/engine_case.py) minus enforce_eager.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128]
CHUNKS = [256, 512, 1024, 2048, 4096, 8192]
PROMPT, OUTPUT, LONG = 128, 128, 12000
_REQUEST_IDS = itertools.count()


def engine_cases(model: str, adapters: dict[str, str], only: set[str]) -> list[dict]:
    base = {"model": model, "max_model_len": 16384, "max_num_seqs": 128}
    cases = []
    if "concurrency" in only or "graphs" in only or "lora" in only:
        cases.append({**base, "name": "exl3", "work": ["concurrency"] if "concurrency" in only else ["n1_n32"]})
    if "lora" in only:
        cases.append({**base, "name": "exl3+lora", "enable_lora": True, "adapters": adapters, "work": ["lora"]})
    if "graphs" in only:
        cases.append({**base, "name": "exl3-eager", "enforce_eager": True, "work": ["n1_n32"]})
    if "chunk" in only:
        cases += [{**base, "name": f"chunk-{c}", "max_num_batched_tokens": c, "work": ["chunk"]} for c in CHUNKS]
    return cases


def timed(llm, prompts: list[list[int]], max_tokens: list[int], loras: list | None = None) -> list[float]:
    """Submit everything at once; return each request's completion time (s) after submission, by
    stepping the engine as LLM.generate does."""
    from aphrodite import SamplingParams

    engine = llm.llm_engine
    ids_ = [f"r{next(_REQUEST_IDS)}" for _ in prompts]  # request ids must not repeat within an engine
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(ids_[i], {"prompt_token_ids": ids}, params, lora_request=loras[i] if loras else None)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter() - start
    return [done[r] for r in ids_]


def worker(case_path: str) -> None:
    case = json.loads(Path(case_path).read_text())
    from aphrodite import LLM
    from aphrodite.lora.request import LoRARequest

    kwargs = dict(model=case["model"], quantization="exl3", max_model_len=case["max_model_len"],
                  gpu_memory_utilization=0.85, attention_backend="TRITON_ATTN", gdn_prefill_backend="triton",
                  language_model_only=True, max_num_seqs=case["max_num_seqs"], seed=0,
                  enforce_eager=case.get("enforce_eager", False))
    if "max_num_batched_tokens" in case:
        kwargs.update(max_num_batched_tokens=case["max_num_batched_tokens"], enable_chunked_prefill=True)
    if case.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompts(n, length=PROMPT):
        return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]

    rows = []

    def measure(label, n, loras=None):
        timed(llm, prompts(1), [4])  # one short request first: the engine is warm, caches settled
        times = timed(llm, prompts(n), [OUTPUT] * n, loras)
        wall = max(times)
        rows.append({"engine": case["name"], "workload": label, "n": n, "wall_s": round(wall, 4),
                     "throughput_tok_s": round(n * OUTPUT / wall, 1),
                     "per_request_tok_s": round(statistics.mean(OUTPUT / t for t in times), 1)})

    for work in case["work"]:
        if work == "concurrency":
            for n in CONCURRENCY:
                measure("concurrency", n)
        elif work == "n1_n32":
            for n in (1, 32):
                measure("no adapter", n)
        elif work == "lora":
            names = sorted(case["adapters"])
            reqs = [LoRARequest(name, i + 1, case["adapters"][name]) for i, name in enumerate(names)]
            for n in (1, 32):
                measure("lora on, no adapter", n)
                measure("one adapter", n, [reqs[0]] * n)
                measure("two adapters alternating", n, [reqs[i % len(reqs)] for i in range(n)])
        elif work == "chunk":
            batch = prompts(1, LONG) + prompts(5)
            times = timed(llm, batch, [OUTPUT] * 6)
            rows.append({"engine": case["name"], "workload": "long+5 short", "n": 6, "wall_s": round(max(times), 4),
                         "short_done_s": [round(t, 3) for t in times[1:]], "long_done_s": round(times[0], 3),
                         "spread_s": round(statistics.pstdev(times), 4)})
    print("RESULT " + json.dumps({"ok": True, "start_s": start_s, "rows": rows}), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the checkpoint folder make-tiny wrote (its exl3/ and lora-*/ are used)")
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", default="concurrency,lora,chunk,graphs")
    args = ap.parse_args()
    out, model = Path(args.out), Path(args.model)
    out.mkdir(parents=True, exist_ok=True)
    adapters = {p.name: str(p) for p in sorted(model.glob("lora-*"))}
    rows, engines = [], {}
    for case in engine_cases(str(model / "exl3"), adapters, set(args.only.split(","))):
        path = out / f"case-{case['name']}.json"
        path.write_text(json.dumps(case))
        proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True)
        (out / f"engine-{case['name']}.log").write_text(proc.stdout + proc.stderr)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": proc.stderr[-2000:]}
        engines[case["name"]] = {k: v for k, v in result.items() if k != "rows"}
        rows += result.get("rows", [])
        print(case["name"], engines[case["name"]], flush=True)
    (out / "serving.json").write_text(json.dumps(engines, indent=2))
    if rows:
        fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(out / "serving.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
