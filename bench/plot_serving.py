"""Tables, issue 7's goals and plots from bench/serving.py's DIR/serving.csv and DIR/serving.json.

    python3 bench/plot_serving.py DIR [--out bench/results] [--title "NVIDIA H200, aphrodite 0.21.0"]

Writes OUT/serving.md and OUT/serving_{concurrency,lora,chunk}.png (plots need matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from report import pyplot, write_table

NATIVE = ["exl3", "exl3-3inst", "exl3-mul1"]  # single-codebook models: P3 routes nothing
LABEL = {"exl3": "mcg (native)", "exl3-3inst": "3INST (native)", "exl3-mul1": "mul1 (native)",
         "exl3-mixed": "mixed codebooks (P3 routes)", "exl3-eager": "mcg, eager"}


def load(src: Path) -> tuple[list[dict], dict]:
    with open(src / "serving.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = float(v) if "." in v else int(v)
            except (TypeError, ValueError):
                pass
    return rows, json.loads((src / "serving.json").read_text())


def pick(rows, engine, workload="no adapter", n=None):
    found = [r for r in rows if r["engine"] == engine and r["workload"] == workload and (n is None or r["n"] == n)
             and not r.get("error")]
    return found if n is None else (found[0] if found else None)


def lora_rows(rows):
    return [r for r in rows if r["engine"] == "exl3+lora" and not r.get("error")]


def chunk_rows(rows):
    return sorted((r for r in rows if r["workload"] == "long+5 short" and not r.get("error")),
                  key=lambda r: r["max_num_batched_tokens"])


def ratio(a, b, key="throughput_tok_s"):
    return a[key] / b[key] if a and b and b[key] else None


def mode(engine: dict) -> str:
    return {True: "eager", False: "compiled + CUDA graphs"}.get(engine.get("enforce_eager"), "—")


def fmt(x, digits=2):
    return "—" if x is None else f"{x:.{digits}f}"


def report(rows: list[dict], engines: dict, title: str) -> list[str]:
    md = [f"# Serving benchmarks ({title})", "",
          "Produced by `bench/serving.py` and `bench/plot_serving.py` (commands, setup and how to read these "
          "numbers: `bench/README.md`); model: `make-tiny --preset qwen3.6-27b` (Qwen3.6-27B layer widths, 4 "
          "layers `[GDN, GDN, GDN, attention]`, 4 bits), prompt 128 random tokens, 128 output tokens, greedy, "
          "each row the best of its repetitions (two by default; all of them in the CSV's `throughput_reps` "
          "where recorded).", ""]
    md += ["## Engines", "", "| engine | ok | mode | start (s) | overlay summary | P3 routed layers |", "|---|---|---|---|---|---|"]
    for name, e in engines.items():
        md.append(f"| {name} | {'yes' if e.get('ok') else 'NO: ' + str(e.get('error', ''))[-120:].replace(chr(10), ' ')} "
                  f"| {mode(e)} | {e.get('start_s', '—')} | {'; '.join(e.get('overlay', [])) or '—'} "
                  f"| {', '.join(f'{v} ({k})' for k, v in e.get('p3_routed', {}).items()) or '0'} |")

    sweep = pick(rows, "exl3")
    if sweep:
        md += ["", "## Concurrency (mcg)", "",
               "| N | throughput (tok/s) | mean TTFT (ms) | decode tok/s per request | vs N/2 |", "|---|---|---|---|---|"]
        prev = None
        for r in sweep:
            md.append(f"| {r['n']} | {r['throughput_tok_s']:.0f} | {r['ttft_ms_mean']:.0f} | "
                      f"{r['decode_tok_s_per_request']:.1f} | {fmt(ratio(r, prev))} |")
            prev = r

    goals = []
    lora = lora_rows(rows)
    if lora:
        md += ["", "## LoRA on EXL3 (throughput relative to the same model without --enable-lora)", "",
               "| N | workload | throughput (tok/s) | vs LoRA off | overhead |", "|---|---|---|---|---|"]
        for r in lora:
            q = ratio(r, pick(rows, "exl3", n=r["n"]))
            md.append(f"| {r['n']} | {r['workload']} | {r['throughput_tok_s']:.0f} | {fmt(q)} | "
                      f"{fmt(None if q is None else 100 * (1 - q), 1)} % |")
            if r["workload"] != "lora on, no adapter" and q is not None:
                goals.append((f"LoRA overhead, {r['workload']}, N = {r['n']}", f"{100 * (1 - q):.1f} %", "< 15 %",
                              1 - q < 0.15))

    eager = pick(rows, "exl3-eager")
    if eager:
        md += ["", "## CUDA graphs against eager mode", "", "| N | graphs (tok/s) | eager (tok/s) | graphs / eager |",
               "|---|---|---|---|"]
        for r in eager:
            g = pick(rows, "exl3", n=r["n"])
            md.append(f"| {r['n']} | {fmt(g and g['throughput_tok_s'], 0)} | {r['throughput_tok_s']:.0f} | {fmt(ratio(g, r))} |")

    mixed = pick(rows, "exl3-mixed")
    if mixed:
        md += ["", "## Codebooks: P3's routed layers against the native path", "",
               "| N | mixed (P3) | mcg | 3INST | mul1 | mixed / best native |", "|---|---|---|---|---|---|"]
        for r in mixed:
            natives = [pick(rows, e, n=r["n"]) for e in NATIVE]
            best = max((x for x in natives if x), key=lambda x: x["throughput_tok_s"], default=None)
            q = ratio(r, best)
            md.append(f"| {r['n']} | {r['throughput_tok_s']:.0f} | "
                      + " | ".join(fmt(x and x["throughput_tok_s"], 0) for x in natives) + f" | {fmt(q)} |")
            if q is not None:
                goals.append((f"mixed-codebook model (P3) vs best native, N = {r['n']}", f"{q:.2f}x", ">= 0.90x", q >= 0.9))

    chunk = chunk_rows(rows)
    if chunk:
        md += ["", "## Chunked prefill: one 12,000-token prompt and five short ones, submitted together", "",
               "| --max-num-batched-tokens | total (s) | long done (s) | short done, mean (s) | short TTFT, mean (ms) "
               "| spread of completion times (s) |", "|---|---|---|---|---|---|"]
        for r in chunk:
            md.append(f"| {r['max_num_batched_tokens']} | {r['wall_s']:.2f} | {r['long_done_s']:.2f} | "
                      f"{r['short_done_s_mean']:.2f} | {r['short_ttft_ms_mean']:.0f} | {r['spread_s']:.3f} |")

    bad = [r for r in rows if r.get("error") or r.get("tokens_short")]
    failed = [n for n, e in engines.items() if not e.get("ok")]
    top = max((r["n"] for r in rows if r["workload"] != "long+5 short"), default=0)
    goals.append((f"errors up to N = {top}", f"{len(bad)} failed measurements, {len(failed)} failed engines",
                  "none", not bad and not failed))
    md += ["", "## Goals (issue 7)", "", "| goal | measured | aim | met |", "|---|---|---|---|"]
    md += [f"| {g} | {m} | {a} | {'yes' if ok else 'NO'} |" for g, m, a, ok in goals]
    md += ["| plugin time per process | see `plugin_overhead.md` | < 50 ms | see there |"]
    return md


def plots(rows: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for engine in ["exl3", "exl3-eager", "exl3-mixed", "exl3-3inst", "exl3-mul1"]:
        rs = pick(rows, engine)
        if rs:
            a.plot([r["n"] for r in rs], [r["throughput_tok_s"] for r in rs], marker="o", label=LABEL[engine])
            b.plot([r["n"] for r in rs], [r["decode_tok_s_per_request"] for r in rs], marker="o", label=LABEL[engine])
    for ax, what in ((a, "output throughput (tok/s)"), (b, "decode speed per request (tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"EXL3 hybrid, Qwen3.6-27B widths, 4 layers: {title}")
    fig.tight_layout()
    fig.savefig(out / "serving_concurrency.png", dpi=120)

    lora = lora_rows(rows)
    if lora:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels, values = [], []
        for r in lora:
            labels.append(f"N={r['n']}\n{r['workload']}")
            values.append(ratio(r, pick(rows, "exl3", n=r["n"])) or 0)
        ax.bar(range(len(values)), values, color="tab:purple")
        ax.axhline(0.85, color="tab:red", ls="--", label="goal: overhead < 15 %")
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_ylabel("throughput relative to LoRA off")
        ax.legend(fontsize=8)
        ax.set_title(f"LoRA on EXL3 ({title})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "serving_lora.png", dpi=120)

    chunk = chunk_rows(rows)
    if chunk:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["wall_s"] for r in chunk], [r["spread_s"] for r in chunk], marker="o")
        for r in chunk:
            ax.annotate(str(r["max_num_batched_tokens"]), (r["wall_s"], r["spread_s"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("total time (s)")
        ax.set_ylabel("spread of completion times (s)")
        ax.set_title(f"--max-num-batched-tokens: 12k-token prompt + 5 short ({title})", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "serving_chunk.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="serving.py's --out folder")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--title", default="NVIDIA H200, aphrodite-engine 0.21.0 + overlay")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, engines = load(Path(args.src))
    write_table(out / "serving.md", report(rows, engines, args.title))
    plots(rows, out, args.title)


if __name__ == "__main__":
    main()
