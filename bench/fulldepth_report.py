"""Issue 18's table: Aphrodite (the server, with and without an adapter) against exllamav3's generator and
the memory roofline, per preset and concurrency, from one run's results (ci/stages/fulldepth.sh).

    python3 bench/fulldepth_report.py RESULTS_DIR --out bench/results [--title "..."] [--fallback OTHER_RUN_DIR]

Writes ``fulldepth.csv``, ``fulldepth.md`` and ``fulldepth_<preset>.png``. Ratios are taken within the
run: Aphrodite / exllamav3 (decode throughput: tokens after each request's first over the decode span; and
end to end: N x output / wall, prefill included), Aphrodite / roofline (per-request speed at N = 1, decode
throughput above), and the adapter's cost (1 - with / without, decode throughput). The goals of issue
18 are reported, never asserted: at N = 1 at least exllamav3's speed and 50 % of the roofline; at N = 32
at least 5x exllamav3's throughput; the adapter's cost under 10 % at N = 1 and N = 32.

``--fallback DIR``: a file RESULTS_DIR lacks (the model's inputs table, exllamav3's results) is read from
another run's folder instead; the report names every such file, and a ratio built on one is a ratio
across runs (run 14: exllamav3 ran beside other engines' start-ups, so its rows were set aside).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def rows_by_n(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    return {r["concurrency"]: r for r in json.loads(path.read_text()).get("rows", [])}


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def find(results: Path, name: str, fallback: Path | None, borrowed: list[str]) -> Path:
    """RESULTS/name, else FALLBACK/name (recorded in ``borrowed``)."""
    if not (results / name).exists() and fallback is not None and (fallback / name).exists():
        borrowed.append(str(fallback / name))
        return fallback / name
    return results / name


def table(results: Path, preset: str, fallback: Path | None = None, borrowed: list | None = None) -> list[dict]:
    import roofline

    from hybrid_exl3_fixes.doctor import parse_config

    borrowed = [] if borrowed is None else borrowed
    base = rows_by_n(results / f"{preset}-aphrodite-base.json")
    lora = rows_by_n(results / f"{preset}-aphrodite-lora.json")
    exl_path = find(results, f"{preset}-exllamav3.json", fallback, borrowed)
    exl = rows_by_n(exl_path)
    bandwidth = json.loads((results / "bandwidth.json").read_text())["copy_bandwidth_gbps"]
    inputs = json.loads(find(results, f"inputs-{preset}-exl3.json", fallback, borrowed).read_text())
    shape = parse_config(inputs["config.json"])[0]
    prompt, output = 512, 256
    if exl_path.exists():
        meta = json.loads(exl_path.read_text())
        prompt, output = meta.get("prompt", prompt), meta.get("output", output)
    levels = sorted(set(base) | set(lora) | set(exl))
    roof = {r["concurrency"]: r for r in roofline.roofline(shape, inputs["tensors"], bandwidth, levels, prompt, output)}
    out = []
    for n in levels:
        b, lo, e, r = base.get(n, {}), lora.get(n, {}), exl.get(n, {}), roof[n]
        aph = b.get("decode_tok_s")
        speed = b.get("per_request_tok_s")
        out.append(
            {
                "preset": preset,
                "concurrency": n,
                "aphrodite_decode_tok_s": aph,
                "aphrodite_per_request_tok_s": speed,
                "aphrodite_ttft_s": b.get("ttft_mean_s"),
                "aphrodite_lora_decode_tok_s": lo.get("decode_tok_s"),
                "exllamav3_decode_tok_s": e.get("decode_tok_s"),
                "exllamav3_per_request_tok_s": e.get("per_request_tok_s"),
                "exllamav3_ttft_s": e.get("ttft_mean_s"),
                "roofline_tok_s": r["roofline_tok_s"],
                "aphrodite_throughput_tok_s": b.get("throughput_tok_s"),
                "exllamav3_throughput_tok_s": e.get("throughput_tok_s"),
                "aphrodite_over_exllamav3": ratio(aph, e.get("decode_tok_s")),
                "aphrodite_over_exllamav3_end_to_end": ratio(b.get("throughput_tok_s"), e.get("throughput_tok_s")),
                "aphrodite_over_roofline": ratio(speed if n == 1 else aph, r["roofline_tok_s"]),
                "lora_cost": round(1 - lo["decode_tok_s"] / aph, 3) if aph and lo.get("decode_tok_s") else None,
            }
        )
    return out


def goals(rows: list[dict]) -> list[str]:
    at = {r["concurrency"]: r for r in rows}
    lines = []

    def say(label, value, ok):
        lines.append(
            f"- {label}: " + ("n/a (not measured)" if value is None else f"{value} ({'met' if ok else 'not met'})")
        )

    one, n32 = at.get(1, {}), at.get(32, {})
    v = one.get("aphrodite_per_request_tok_s"), one.get("exllamav3_per_request_tok_s")
    say("N = 1, Aphrodite / exllamav3 per-request speed >= 1", ratio(*v), bool(ratio(*v)) and ratio(*v) >= 1)
    x = one.get("aphrodite_over_roofline")
    say("N = 1, Aphrodite / roofline >= 0.5", x, bool(x) and x >= 0.5)
    x = n32.get("aphrodite_over_exllamav3")
    say("N = 32, Aphrodite / exllamav3 decode throughput >= 5", x, bool(x) and x >= 5)
    x = n32.get("aphrodite_over_exllamav3_end_to_end")
    say("N = 32, Aphrodite / exllamav3 end-to-end throughput (prefill included) >= 5", x, bool(x) and x >= 5)
    for n in (1, 32):
        x = at.get(n, {}).get("lora_cost")
        say(f"N = {n}, adapter cost < 10 %", x, x is not None and x < 0.10)
    return lines


def state_note(config: dict) -> str:
    """Which dtype the engine kept the GDN state in: the config's mamba_ssm_dtype, else the activations'."""
    text = config.get("text_config", config)
    if text.get("mamba_ssm_dtype"):
        return f"GDN state: {text['mamba_ssm_dtype']} (the config's `mamba_ssm_dtype`, as published)."
    return (
        "GDN state: bfloat16, the activations' dtype (a checkpoint written before make-tiny set `mamba_ssm_dtype`; "
        "the published models keep it in float32, twice the state bytes)."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--title", default="")
    p.add_argument("--fallback", type=Path, help="another run's result folder for the files this one lacks")
    args = p.parse_args(argv)
    for folder in (args.results, args.fallback):
        if folder is not None and not (folder / "bandwidth.json").exists():
            p.error(f"{folder} holds no bandwidth.json (not a ci/stages/fulldepth.sh result folder)")
    named = {f.name for f in args.results.glob("*-aphrodite-*.json")} | {f.name for f in args.results.glob("inputs-*")}
    presets = sorted(
        {n[len("inputs-") : -len("-exl3.json")] for n in named if n.startswith("inputs-")}
        | {n.split("-aphrodite-")[0] for n in named if "-aphrodite-" in n}
    )
    all_rows, md = [], [f"# Full-depth serving{': ' + args.title if args.title else ''}", ""]
    for preset in presets:
        borrowed: list[str] = []
        try:
            rows = table(args.results, preset, args.fallback, borrowed)
        except FileNotFoundError as exc:
            p.error(f"{preset}: {exc.filename} is missing (--fallback names a run that has it)")
        all_rows += rows
        inputs = json.loads(find(args.results, f"inputs-{preset}-exl3.json", args.fallback, []).read_text())
        md += [
            f"## {preset}",
            "",
            state_note(inputs["config.json"]),
            "",
            *(
                [f"From another run (ratios on them are across runs): {', '.join(f'`{b}`' for b in borrowed)}", ""]
                if borrowed
                else []
            ),
            "| N | " + " | ".join(k for k in rows[0] if k not in ("preset", "concurrency")) + " |",
        ]
        md += ["|---|" + "---|" * (len(rows[0]) - 2)]
        md += ["| " + " | ".join(str(v) for k, v in r.items() if k != "preset") + " |" for r in rows]
        md += ["", "Goals (reported, not asserted):", *goals(rows), ""]
        plot(rows, args.out / f"fulldepth_{preset}.png", f"{preset} {args.title}")
    args.out.mkdir(parents=True, exist_ok=True)
    if all_rows:
        with open(args.out / "fulldepth.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(all_rows[0]))
            w.writeheader()
            w.writerows(all_rows)
    (args.out / "fulldepth.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = [r["concurrency"] for r in rows]
    for key, label in (
        ("aphrodite_decode_tok_s", "Aphrodite (server)"),
        ("aphrodite_lora_decode_tok_s", "Aphrodite + adapter"),
        ("exllamav3_decode_tok_s", "exllamav3 generator"),
        ("roofline_tok_s", "memory roofline"),
    ):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax.plot(n, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
