"""Issue 31's table: one checkpoint served by each staged release, without and with an adapter, beside exllamav3's
generator, from one ``bench/same_run.py`` run (``ci/gpu-run.sh compare:PRESET``).

    python3 bench/compare_report.py RUN.json --inputs INPUTS.json[.xz] [--bandwidth-file BANDWIDTH.json] \
        --out bench/results [--title "..."] [--note "..."]... [--stem NAME]

RUN.json: same_run.py's results; INPUTS.json: the checkpoint's config and tensor list (memory_calibration.save_inputs,
xz-compressed or not); BANDWIDTH.json: ``bench/roofline.py --measure`` on the same GPU kind (left out for a kind
with no measured copy bandwidth: then the report has no roofline, rather than one from another card's). Writes
``compare_<model>`` (or ``--stem``) ``.csv``, ``.md`` and ``.png``: per variant and concurrency the median and
spread (min-max over the repeats) of per-request and decode tok/s by same_run's one formula, the time to first
token, the ratio to the exllamav3 variant's per-request median at the same level (with the spread of the ratios of
the repeats, each a pair measured back to back), each release's adapter against its base, P8 on against off (a
NAME-nop8 variant), and the memory roofline of the step (bench/roofline.py: for a MoE the expected distinct experts
of N x k routes).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from report import load_levels, plot_levels, spread, with_notes, write_csv, write_table  # noqa: E402

METRICS = {"per_request": "per_request_tok_s", "decode": "decode_tok_s", "ttft": "ttft_mean_s"}


def is_exllamav3(variant: dict) -> bool:
    return "exllamav3_generator.py" in " ".join(variant.get("command", []))


def rows(run: dict, inputs: dict, bandwidth: float | None) -> list[dict]:
    import roofline

    from hybrid_exl3_fixes.doctor import parse_config

    shape = parse_config(inputs["config.json"])[0]
    ns = sorted({int(n) for levels in run["summary"].values() for n in levels})
    prompt, output = run.get("prompt", 512), run.get("output", 256)
    roof = (
        {r["concurrency"]: r for r in roofline.roofline(shape, inputs["tensors"], bandwidth, ns, prompt, output)}
        if bandwidth
        else {}
    )
    x3 = next((n for n, v in run["variants"].items() if is_exllamav3(v)), None)
    out = []
    for name, levels in run["summary"].items():
        for n in ns:
            s = levels.get(str(n))
            if not s or "per_request_tok_s" not in s:
                continue
            row = {"variant": name, "concurrency": n}
            row["repeats"] = sum(1 for r in run["runs"] if r["variant"] == name and r["concurrency"] == n)
            for key, metric in METRICS.items():
                stat = s.get(metric) or {}
                row.update({key: stat.get("median"), f"{key}_min": stat.get("min"), f"{key}_max": stat.get("max")})
            ref = (run["summary"].get(x3) or {}).get(str(n)) if x3 and name != x3 else None
            ref = (ref or {}).get("per_request_tok_s", {}).get("median")
            row["over_exllamav3"] = round(row["per_request"] / ref, 3) if ref else None
            paired = repeat_ratios(run, name, x3, n) if ref else []
            row["over_exllamav3_min"] = min(paired, default=row["over_exllamav3"])
            row["over_exllamav3_max"] = max(paired, default=row["over_exllamav3"])
            r = roof.get(n)
            if r is None:
                out.append(row)
                continue
            row.update(
                weight_gb=r["weight_gb"], state_gb=r["state_gb"], kv_gb=r["kv_gb"], roofline_step_ms=r["step_ms"]
            )
            row["roofline_per_request"] = r["roofline_tok_s_per_request"]
            row["of_roofline"] = round(row["per_request"] / r["roofline_tok_s_per_request"], 3)
            out.append(row)
    return out


def repeat_ratios(run: dict, name: str, ref: str, n: int) -> list[float]:
    """NAME's per-request tok/s over REF's at level N, one ratio per repeat both measured: the two ran back to back
    in that repeat (same_run.py alternates the variants' order), so these ratios' spread is the comparison's own."""
    speed = {
        (r["variant"], r["repeat"]): r.get("per_request_tok_s")
        for r in run.get("runs", [])
        if r.get("concurrency") == n and r.get("variant") in (name, ref)
    }
    return sorted(
        round(speed[name, k] / speed[ref, k], 3)
        for (v, k) in speed
        if v == name and speed[name, k] and speed.get((ref, k))
    )


# Variant pairs ci/gpu-run.sh's compare stage names NAME and NAME-SUFFIX: (suffix, which is measured over which, what
# the ratio says). An adapter over its base; P8's before/after: the overlay as installed over the same release with
# HYBRID_EXL3_FIXES_DISABLE=P8.
PAIRS = (
    ("-lora", "adapter", "the adapter's speed as a share of its base"),
    ("-lora-tuned", "adapter", "the adapter with tuned LoRA kernel configs as a share of its base"),
    ("-lora-experts", "adapter", "an adapter on the routed experts (P13) as a share of its base"),
    ("-experts", "adapter", "the routed experts adapted (P13) over the same adapter's other projections alone"),
    ("-tuned", "adapter", "tuned LoRA kernel configs over the default ones: above 1, the tuned are faster"),
    ("-nop8", "p8", "P8 on over P8 off (HYBRID_EXL3_FIXES_DISABLE=P8): above 1, P8 is faster"),
    ("-p12", "adapter", "P12 opted in over the same release without it: above 1, P12 is faster"),
    ("-keep", "adapter", "P12 with kept float16 weights over the same release without it: above 1, it is faster"),
)


def pairs(run: dict) -> list[tuple[str, str, str]]:
    """(numerator, denominator, what) variant pairs: NAME-lora, NAME-lora-tuned and NAME-lora-experts over NAME,
    NAME-lora-tuned and NAME-lora-experts over NAME-lora, NAME-p12 and NAME-keep over NAME, NAME over NAME-nop8."""
    out = []
    for n in run["variants"]:
        for suffix, kind, what in PAIRS:
            base = n[: -len(suffix)]
            if n.endswith(suffix) and base in run["variants"]:
                out.append((n, base, what) if kind == "adapter" else (base, n, what))
    return out


def markdown(run: dict, table: list[dict], bandwidth_file: str | None, title: str) -> list[str]:
    md = [
        f"# Same-run comparison: {title}",
        "",
        "| variant | engine | ready (s) | weights GiB | KV pool GiB | KV tokens | attention block | note |",
    ]
    md.append("|---|---|---|---|---|---|---|---|")
    for name, v in run["variants"].items():
        engine = (
            "exllamav3 generator"
            if is_exllamav3(v)
            else "aphrodite run" + (" + LoRA" if "--enable-lora" in v["command"] else "")
        )
        ready = v.get("ready_s") if v.get("started") else "did not start"
        tokens = int(v["kv_cache_tokens"]) if v.get("kv_cache_tokens") is not None else "-"
        block = int(v["attention_block_size"]) if v.get("attention_block_size") else "-"
        note = (v.get("error") or "")[:160].replace("|", "/")
        if is_exllamav3(v) and v.get("load_s") is not None:
            note = f"load {v['load_s']} s, warm-up {v.get('warmup_s')} s" + (f"; {note}" if note else "")
        weights, pool = (v.get(k, "-") for k in ("weights_gib", "kv_reserved_gib"))
        md.append(f"| {name} | {engine} | {ready} | {weights} | {pool} | {tokens} | {block} | {note} |")
    md += ["", "Formula: " + " ".join(run.get("formula", "").split()), ""]
    # the ratio column only where the run has an exllamav3 variant to divide by
    x3 = any(is_exllamav3(v) for v in run["variants"].values())
    roof = all("roofline_per_request" in r for r in table)
    md += [
        f"Roofline: bench/roofline.py with the copy bandwidth in `{bandwidth_file}`, prompt {run.get('prompt', 512)} "
        f"+ output {run.get('output', 256)}; the weights a step reads count the expected distinct routed experts of "
        "N x k routes."
        if roof
        else "Roofline: none (no copy bandwidth measured on this GPU kind).",
        "",
        (
            "| variant | N | repeats | per-request tok/s, median (min-max) | decode tok/s | TTFT s | "
            + ("/ exllamav3 | " if x3 else "")
            + ("roofline per request | of roofline |" if roof else "")
        ).rstrip(),
        "|---|---|---|---|---|---|" + ("---|" if x3 else "") + ("---|---|" if roof else ""),
    ]
    for r in sorted(table, key=lambda r: (r["concurrency"], r["variant"])):
        cells = [spread({"median": r[k], "min": r[f"{k}_min"], "max": r[f"{k}_max"]}) for k in METRICS]
        over = {"median": r["over_exllamav3"], "min": r["over_exllamav3_min"], "max": r["over_exllamav3_max"]}
        ratio = f"{spread(over)} | " if x3 else ""
        of = f"{r['roofline_per_request']} | {r['of_roofline']} |" if roof else ""
        row = f"| {r['variant']} | {r['concurrency']} | {r['repeats']} | {cells[0]} | {cells[1]} | {cells[2]} | "
        md.append(f"{row}{ratio}{of}".rstrip())
    by = {(r["variant"], r["concurrency"]): r for r in table}
    for num, den, what in pairs(run):
        # the difference as time: a request's time per token changes by 1/num - 1/den (a fixed cost a step shows as
        # the same number of ms at every N, where the ratios fall with N)
        lines = []
        for n in sorted({r["concurrency"] for r in table}):
            if (num, n) not in by or (den, n) not in by or not by[den, n]["decode"]:
                continue
            paired = repeat_ratios(run, num, den, n)
            lo_hi = f" ({paired[0]:.3f}-{paired[-1]:.3f} over the repeats)" if len(paired) > 1 else ""
            ms = 1000 / by[num, n]["per_request"] - 1000 / by[den, n]["per_request"]
            lines.append(
                f"- N = {n}: per-request {by[num, n]['per_request'] / by[den, n]['per_request']:.3f}{lo_hi}, decode "
                f"{by[num, n]['decode'] / by[den, n]['decode']:.3f}; a request's time per token {ms:+.2f} ms"
            )
        if lines:
            md += ["", f"{num} / {den} (medians; {what}):", "", *lines]
    ns = sorted({r["concurrency"] for r in table})
    if not roof:
        return md
    md += ["", "| N | weights GB/step | KV GB/step | state GB/step | roofline step ms |", "|---|---|---|---|---|"]
    for n in ns:
        r = next(r for r in table if r["concurrency"] == n)
        md.append(f"| {n} | {r['weight_gb']} | {r['kv_gb']} | {r['state_gb']} | {r['roofline_step_ms']} |")
    return md


def main(argv: list[str] | None = None) -> int:
    args, run, table = load_levels(argv, __doc__, rows, bandwidth_required=False)
    stem = args.stem or "compare_" + Path(run.get("model", "model")).parent.name
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", table)
    bandwidth_file = str(args.bandwidth_file) if args.bandwidth_file else None
    md = with_notes(markdown(run, table, bandwidth_file, args.title or stem), args.note)
    write_table(args.out / f"{stem}.md", md)
    panels = [("per_request", "tokens/s per request"), ("decode", "decode tokens/s (all requests)")]
    plot_levels(table, args.out / f"{stem}.png", args.title or stem, panels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
