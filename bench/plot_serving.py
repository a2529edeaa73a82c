"""Tables, the serving goals and plots from bench/serving.py's DIR/serving.csv and DIR/serving.json.

    python3 bench/plot_serving.py DIR [--out bench/results] [--title "NVIDIA H200, aphrodite 0.21.0"]
                                      [--variant=-fullgraph-nocompile]

Writes OUT/serving.md and OUT/serving_{concurrency,lora,chunk}.png (plots need matplotlib).
``--variant SUFFIX`` reports the engines that serving.py ran with ``--tag=SUFFIX`` under their plain
names (exl3, exl3+lora, exl3-mixed, ...), so the tables and goals compare them; an engine of the
plain name that the variant displaces is kept as NAME-compiled (serving.py's default mode).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from report import pyplot, write_table
from serving import root_cause

NATIVE = ["exl3", "exl3-3inst", "exl3-mul1"]  # single-codebook models: P3 routes nothing
LABEL = {
    "exl3": "mcg (native)",
    "exl3-3inst": "3INST (native)",
    "exl3-mul1": "mul1 (native)",
    "exl3-mixed": "mixed codebooks (P3 routes)",
    "exl3-eager": "mcg, eager",
}


def load(src: Path, variant: str = "") -> tuple[list[dict], dict]:
    with open(src / "serving.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = float(v) if "." in v else int(v)
            except (TypeError, ValueError):
                pass
    engines = json.loads((src / "serving.json").read_text())
    for name, e in engines.items():
        log = src / f"engine-{name}.log"  # results written before serving.py recorded the cause
        if not e.get("ok") and not e.get("cause") and log.is_file():
            e["cause"] = root_cause(log.read_text(errors="replace"))
        case = src / f"case-{name}.json"  # the engine's mode and --engine-args live in serving.py's case file
        if case.is_file():
            spec = json.loads(case.read_text())
            e.setdefault("engine_args", spec.get("engine_args", {}))
            e.setdefault("enforce_eager", spec.get("enforce_eager", False))
    if variant:
        plain = {n: n[: -len(variant)] for n in engines if n.endswith(variant) and len(n) > len(variant)}
        rename = {**{n: n + "-compiled" for n in plain.values() if n in engines}, **plain}
        engines = {rename.get(n, n): e for n, e in engines.items()}
        for r in rows:
            r["engine"] = rename.get(r["engine"], r["engine"])
    return rows, engines


def pick(rows, engine, workload="no adapter", n=None):
    found = [
        r
        for r in rows
        if r["engine"] == engine and r["workload"] == workload and (n is None or r["n"] == n) and not r.get("error")
    ]
    return found if n is None else (found[0] if found else None)


def lora_rows(rows):
    """Rows of every engine started with --enable-lora (exl3+lora and its eager / compiled twins)."""
    return [r for r in rows if r["engine"].startswith("exl3+lora") and not r.get("error")]


def lora_off(engine: str) -> str:
    """The engine without --enable-lora in the same mode: exl3+lora-eager -> exl3-eager."""
    return "exl3" + engine[len("exl3+lora") :]


def graph_pairs(engines: dict) -> list[tuple[str, str]]:
    """(engine with CUDA graphs, the same configuration in eager mode) for every NAME-eager present."""
    return [
        (g, e)
        for e in engines
        if e.endswith("-eager")
        for g in (e[: -len("-eager")], e[: -len("-eager")] + "-compiled")
        if g in engines
    ]


def chunk_rows(rows):
    return sorted(
        (r for r in rows if r["workload"] == "long+5 short" and not r.get("error")),
        key=lambda r: r["max_num_batched_tokens"],
    )


def ratio(a, b, key="throughput_tok_s"):
    return a[key] / b[key] if a and b and b[key] else None


def mode(engine: dict) -> str:
    if engine.get("enforce_eager") is None:
        return "—"
    if engine["enforce_eager"]:
        return "eager"
    cc = engine.get("engine_args", {}).get("compilation_config", {})
    graphs = cc.get("cudagraph_mode", "default")
    compiled = "no torch.compile" if cc.get("mode") == 0 else f"torch.compile (backend {cc.get('backend', 'inductor')})"
    return f"{compiled}, CUDA graphs {graphs}"


def fmt(x, digits=2):
    return "—" if x is None else f"{x:.{digits}f}"


def report(rows: list[dict], engines: dict, title: str) -> list[str]:
    md = [
        f"# Serving benchmarks ({title})",
        "",
        "Produced by `bench/serving.py` and `bench/plot_serving.py` (commands, setup and how to read these "
        "numbers: `bench/README.md`); model: `make-tiny --preset qwen3.6-27b` (Qwen3.6-27B layer widths, 4 "
        "layers `[GDN, GDN, GDN, attention]`, 4 bits), prompt 128 random tokens, 128 output tokens, greedy, "
        "each row the best of its repetitions (two by default; all of them in the CSV's `throughput_reps` "
        "where recorded).",
        "",
    ]
    md += [
        "## Engines",
        "",
        "| engine | ok | mode | start (s) | overlay summary | P3 routed layers |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in engines.items():
        why = e.get("cause") or str(e.get("error", ""))[-120:].replace(chr(10), " ")
        md.append(
            f"| {name} | {'yes' if e.get('ok') else 'NO: ' + why.replace('|', '/')} "
            f"| {mode(e)} | {e.get('start_s', '—')} | {'; '.join(e.get('overlay', [])) or '—'} "
            f"| {', '.join(f'{v} ({k})' for k, v in e.get('p3_routed', {}).items()) or '0'} |"
        )

    sweep = pick(rows, "exl3")
    if sweep:
        md += [
            "",
            f"## Concurrency (mcg; {mode(engines.get('exl3', {}))})",
            "",
            "| N | throughput (tok/s) | mean TTFT (ms) | decode tok/s per request | vs N/2 |",
            "|---|---|---|---|---|",
        ]
        prev = None
        for r in sweep:
            md.append(
                f"| {r['n']} | {r['throughput_tok_s']:.0f} | {r['ttft_ms_mean']:.0f} | "
                f"{r['decode_tok_s_per_request']:.1f} | {fmt(ratio(r, prev))} |"
            )
            prev = r

    goals = []
    lora = lora_rows(rows)
    if lora:
        md += [
            "",
            "## LoRA on EXL3",
            "",
            "Throughput against the same model in the same mode without `--enable-lora` (where this run has "
            "that engine), and against the same engine's batch without an adapter.",
            "",
            "| engine | N | workload | throughput (tok/s) | vs LoRA off | overhead | vs no adapter, same engine |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in lora:
            q = ratio(r, pick(rows, lora_off(r["engine"]), n=r["n"]))
            own = ratio(r, pick(rows, r["engine"], "lora on, no adapter", r["n"]))
            md.append(
                f"| {r['engine']} | {r['n']} | {r['workload']} | {r['throughput_tok_s']:.0f} | {fmt(q)} | "
                f"{fmt(None if q is None else 100 * (1 - q), 1)} % | {fmt(own)} |"
            )
            if r["workload"] != "lora on, no adapter" and q is not None:
                where = "" if r["engine"] == "exl3+lora" else f" ({r['engine']})"
                goals.append(
                    (
                        f"LoRA overhead, {r['workload']}, N = {r['n']}{where}",
                        f"{100 * (1 - q):.1f} %",
                        "< 15 %",
                        1 - q < 0.15,
                    )
                )

    pairs = graph_pairs(engines)
    if pairs:
        md += [
            "",
            "## CUDA graphs against eager mode",
            "",
            "| engine (graphs) | engine (eager) | workload | N | graphs (tok/s) | eager (tok/s) | graphs / eager |",
            "|---|---|---|---|---|---|---|",
        ]
        for g_name, e_name in pairs:
            for r in (r for r in rows if r["engine"] == e_name and not r.get("error") and "n" in r):
                g = pick(rows, g_name, r["workload"], r["n"])
                if g:
                    md.append(
                        f"| {g_name} | {e_name} | {r['workload']} | {r['n']} | {g['throughput_tok_s']:.0f} | "
                        f"{r['throughput_tok_s']:.0f} | {fmt(ratio(g, r))} |"
                    )

    mixed = pick(rows, "exl3-mixed")
    if mixed:
        md += [
            "",
            "## Codebooks: P3's routed layers against the native path",
            "",
            "| N | mixed (P3) | mcg | 3INST | mul1 | mixed / best native |",
            "|---|---|---|---|---|---|",
        ]
        for r in mixed:
            natives = [pick(rows, e, n=r["n"]) for e in NATIVE]
            best = max((x for x in natives if x), key=lambda x: x["throughput_tok_s"], default=None)
            q = ratio(r, best)
            md.append(
                f"| {r['n']} | {r['throughput_tok_s']:.0f} | "
                + " | ".join(fmt(x and x["throughput_tok_s"], 0) for x in natives)
                + f" | {fmt(q)} |"
            )
            if q is not None:
                goals.append(
                    (f"mixed-codebook model (P3) vs best native, N = {r['n']}", f"{q:.2f}x", ">= 0.90x", q >= 0.9)
                )

    chunk = chunk_rows(rows)
    if chunk:
        md += [
            "",
            "## Chunked prefill: one 12,000-token prompt and five short ones, submitted together",
            "",
            "| --max-num-batched-tokens | total (s) | long done (s) | short done, mean (s) | short TTFT, mean (ms) "
            "| spread of completion times (s) |",
            "|---|---|---|---|---|---|",
        ]
        for r in chunk:
            md.append(
                f"| {r['max_num_batched_tokens']} | {r['wall_s']:.2f} | {r['long_done_s']:.2f} | "
                f"{r['short_done_s_mean']:.2f} | {r['short_ttft_ms_mean']:.0f} | {r['spread_s']:.3f} |"
            )
        md += [
            "",
            f"Mode: {mode(engines.get(chunk[0]['engine'], {}))}. The long prompt is submitted first; "
            "every request decodes 128 tokens, so the short ones, admitted only beside the long prompt's "
            "chunks, finish with it (a spread near 0). Their wait shows as time to first token.",
        ]

    bad = [r for r in rows if r.get("error") or r.get("tokens_short")]
    failed = [n for n, e in engines.items() if not e.get("ok")]
    top = max((r["n"] for r in rows if r["workload"] != "long+5 short"), default=0)
    started = len(engines) - len(failed)
    goals.append(
        (
            f"errors up to N = {top}",
            f"{len(bad)} failed measurements in {started} engines that started",
            "none",
            not bad,
        )
    )
    goals.append(
        (
            "every engine starts",
            f"{len(failed)} failed engines" + (f": {', '.join(failed)}" if failed else ""),
            "none",
            not failed,
        )
    )
    md += ["", "## Goals", "", "| goal | measured | aim | met |", "|---|---|---|---|"]
    md += [f"| {g} | {m} | {a} | {'yes' if ok else 'NO'} |" for g, m, a, ok in goals]
    md += ["| plugin time per process | see `plugin_overhead.md` | < 50 ms | see there |"]
    return md


def plots(rows: list[dict], engines: dict, out: Path, title: str) -> None:
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
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5))
        keys = sorted({(r["n"], r["workload"]) for r in lora})
        lora_engines = sorted({r["engine"] for r in lora})
        width = 0.8 / len(lora_engines)
        for i, engine in enumerate(lora_engines):
            for ax, base in (
                (a, lambda r: pick(rows, lora_off(engine), n=r["n"])),
                (b, lambda r: pick(rows, engine, "lora on, no adapter", r["n"])),
            ):
                values = [ratio(pick(rows, engine, w, n), base({"n": n})) for n, w in keys]
                if any(v is not None for v in values):
                    ax.bar(
                        [k + i * width for k in range(len(keys))],
                        [v or 0 for v in values],
                        width,
                        color=f"C{i}",
                        label=f"{engine} ({mode(engines.get(engine, {}))})" if ax is b else None,
                    )
        for ax, what in (
            (a, "throughput relative to LoRA off (same mode)"),
            (b, "throughput relative to no adapter (same engine)"),
        ):
            ax.axhline(0.85, color="tab:red", ls="--", lw=1, label="overhead 15 %" if ax is b else None)
            ax.set_xticks(
                [k + 0.4 - width / 2 for k in range(len(keys))],
                [f"N={n}\n{w.replace('lora on, ', '')}" for n, w in keys],
                fontsize=7,
            )
            ax.set_ylabel(what, fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        fig.legend(fontsize=7, loc="lower center", ncol=2)
        fig.suptitle(f"LoRA on EXL3: {title}", fontsize=10)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        fig.savefig(out / "serving_lora.png", dpi=120)

    chunk = chunk_rows(rows)
    if chunk:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        sizes = [r["max_num_batched_tokens"] for r in chunk]
        ax.plot(sizes, [r["wall_s"] for r in chunk], marker="o", color="tab:blue", label="total time (s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--max-num-batched-tokens")
        ax.set_ylabel("total time (s)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(sizes, [r["short_ttft_ms_mean"] for r in chunk], marker="s", color="tab:orange")
        ax2.set_ylabel("short requests: mean time to first token (ms)", color="tab:orange")
        ax.set_title(f"12k-token prompt + 5 short ones, submitted together\n{title}", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "serving_chunk.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="serving.py's --out folder")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--title", default="NVIDIA H200, aphrodite-engine 0.21.0 + overlay")
    ap.add_argument(
        "--variant", default="", help="report the engines of serving.py --tag=SUFFIX under their plain names"
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, engines = load(Path(args.src), args.variant)
    write_table(out / "serving.md", report(rows, engines, args.title))
    plots(rows, engines, out, args.title)


if __name__ == "__main__":
    main()
