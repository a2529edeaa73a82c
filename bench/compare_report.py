"""One checkpoint served by several engine configurations beside exllamav3's generator, from the ``bench/same_run.py``
runs of one device call (``ci/gpu-run.sh compare:PRESET``): the same-run page.

    python3 bench/compare_report.py RUN.json [RUN2.json ...] --inputs INPUTS.json[.xz] [--bandwidth-file BW.json] \
        --out bench/results [--title "..."] [--note "..."]... [--stem NAME]

RUN.json: same_run.py's results, one per phase of the call (the stage runs the variants that do not fit the GPU
together one phase after the other: each phase's variants are alternated among themselves, and only variants of
one phase are divided by each other); INPUTS.json: the checkpoint's config and tensor list
(memory_calibration.save_inputs, xz-compressed or not). The copy bandwidth of the roofline is the one the run
measured on its GPU before the engines started (``bandwidth`` in RUN.json); ``--bandwidth-file`` stands in for a
run that has none, and the page names the file. Writes ``compare_<model>`` (or ``--stem``) ``.csv``, ``.md`` and
``.png``: per variant and concurrency its GDN state dtype, every reported repeat, their median and spread (min-max)
of per-request and decode tok/s by one formula, the time to first token, the fewest requests that streamed at once
in a reported repeat, the ratio to the exllamav3 variant of the same phase that keeps its state in as many bytes
(``/ exllamav3``, with the spread of the repeats' own ratios, each a pair measured back to back; where a phase has
no such variant, its one exllamav3 variant, and the page says the states differ), the memory roofline of the step
with the variant's own state bytes (bench/roofline.py), the levels same_run.py refused and why, how idle engines
and compiles were kept out of the levels, and each release's adapter against its base, P8 on against off, P12
against without.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from report import level_parser, plot_levels, read_inputs, spread, with_notes, write_csv, write_table  # noqa: E402

METRICS = {"per_request": "per_request_tok_s", "decode": "decode_tok_s", "ttft": "ttft_mean_s"}
SSM_FLAG = "--mamba-ssm-cache-dtype"
WIDTH = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# the goals the page reports (asserted by no test): per request over exllamav3 at the same state width, N = 1 and 8-64
GOALS = ((1, 1, 1.10), (8, 64, 1.5))


def is_exllamav3(variant: dict) -> bool:
    return "exllamav3_generator.py" in " ".join(variant.get("command", []))


def state_of(variant: dict, config: dict) -> str:
    """The variant's GDN state dtype: as same_run.py recorded it, else from its command (runs before it did)."""
    if variant.get("state_dtype"):
        return variant["state_dtype"]
    command = variant.get("command", [])
    if is_exllamav3(variant):
        flag = "--state-dtype"
        return command[command.index(flag) + 1] if flag in command[:-1] else "float16"
    if SSM_FLAG in command[:-1]:
        return command[command.index(SSM_FLAG) + 1]
    text = config.get("text_config", config)
    return text.get("mamba_ssm_dtype") or text.get("dtype") or "bfloat16"


def merge(runs: list[dict], names: list[str]) -> dict:
    """Several phases' runs as one: each variant and row tagged with its phase (1, 2, ...), which ``names`` names."""
    out = {"variants": {}, "runs": [], "summary": {}, "phases": names}
    for i, run in enumerate(runs, 1):
        for key in ("model", "formula", "prompt", "output", "bandwidth", "checks"):
            if key in run and key not in out:
                out[key] = run[key]
        for name, v in run["variants"].items():
            if name in out["variants"]:
                raise ValueError(f"variant {name} is in two runs")
            out["variants"][name] = {**v, "phase": i}
            out["summary"][name] = run["summary"].get(name, {})
        out["runs"] += [{**r, "phase": i} for r in run.get("runs", [])]
        out.setdefault("compiles", []).extend({**c, "phase": i} for c in run.get("compiles", []))
        out.setdefault("compile_check", []).append(run.get("compile_check"))
        out.setdefault("stopped", []).append(run.get("stopped"))
        if "pause_idle" in run:  # idle engines stopped only where every phase stopped them
            out["pause_idle"] = out.get("pause_idle", True) and run["pause_idle"]
    return out


def refuse(run: dict, spec: str) -> None:
    """``--refuse NAME=N:REASON``: mark a level of a run recorded before same_run.py checked its levels as refused
    (its rows keep REASON, the summary drops them), as the checks would have: for example run 25's exllamav3 at
    N = 32, whose cache held 24 of 32 jobs."""
    import statistics

    name, _, rest = spec.partition("=")
    level, _, reason = rest.partition(":")
    if name not in run["variants"] or not level.isdigit() or not reason:
        raise ValueError(f"--refuse takes NAME=N:REASON with NAME a variant of the run, got {spec!r}")
    rows = [r for r in run["runs"] if r["variant"] == name and r.get("concurrency") == int(level)]
    for r in rows:
        r["refused"] = [*(r.get("refused") or []), reason]
    summary = {"refused": {"rows": len(rows)}}
    for metric in METRICS.values():
        kept = [r[metric] for r in rows if not r["refused"] and r.get(metric) is not None]
        if kept:
            summary[metric] = {"median": statistics.median(kept), "min": min(kept), "max": max(kept)}
    run["summary"].setdefault(name, {})[level] = summary


def reported(run: dict, name: str, n: int) -> list[dict]:
    return [r for r in run["runs"] if r["variant"] == name and r.get("concurrency") == n and not r.get("refused")]


def matched_exllamav3(run: dict, name: str, states: dict) -> tuple[str | None, bool]:
    """The exllamav3 variant a variant is divided by: of its phase, the one whose state has as many bytes (True),
    else the phase's only one (False: the states differ); (None, False) where there is none to divide by."""
    v = run["variants"][name]
    if is_exllamav3(v):
        return None, False
    x3 = [n for n, w in run["variants"].items() if is_exllamav3(w) and w.get("phase") == v.get("phase")]
    same = [n for n in x3 if WIDTH.get(states[n]) == WIDTH.get(states[name])]
    if same:
        return same[0], True
    return (x3[0], False) if len(x3) == 1 else (None, False)


def rows(run: dict, inputs: dict, bandwidth: float | None) -> list[dict]:
    import roofline

    from hybrid_exl3_fixes.doctor import parse_config

    shape = parse_config(inputs["config.json"])[0]
    config = inputs["config.json"]
    ns = sorted({int(n) for levels in run["summary"].values() for n in levels})
    prompt, output = run.get("prompt", 512), run.get("output", 256)
    states = {name: state_of(v, config) for name, v in run["variants"].items()}
    roofs = {}
    if bandwidth:
        for state in set(states.values()):
            rs = roofline.roofline(copy.copy(shape), inputs["tensors"], bandwidth, ns, prompt, output, state)
            roofs[state] = {r["concurrency"]: r for r in rs}
    out = []
    for name, levels in run["summary"].items():
        ref, same_state = matched_exllamav3(run, name, states)
        for n in ns:
            s = levels.get(str(n))
            if not s or "per_request_tok_s" not in s:
                continue
            kept = reported(run, name, n)
            row = {"variant": name, "phase": run["variants"][name].get("phase", 1), "state_dtype": states[name]}
            row.update(
                concurrency=n,
                repeats=len(kept)
                or s.get("repeats")
                or sum(1 for r in run["runs"] if r["variant"] == name and r.get("concurrency") == n),
            )
            each = [r["per_request_tok_s"] for r in sorted(kept, key=repeat_of) if r.get("per_request_tok_s")]
            row["each_repeat"] = " / ".join(str(v) for v in each)
            for key, metric in METRICS.items():
                stat = s.get(metric) or {}
                row.update({key: stat.get("median"), f"{key}_min": stat.get("min"), f"{key}_max": stat.get("max")})
            active = [min(r.get("active", n), r.get("active_jobs", n)) for r in kept if "active" in r]
            row["active_min"] = min(active) if active else None
            row["refused"] = (s.get("refused") or {}).get("rows", 0)
            row["exllamav3"], row["exllamav3_same_state"] = ref, same_state
            ref_med = ((run["summary"].get(ref) or {}).get(str(n)) or {}).get("per_request_tok_s", {}).get("median")
            row["over_exllamav3"] = round(row["per_request"] / ref_med, 3) if ref_med else None
            paired = repeat_ratios(run, name, ref, n) if ref_med else []
            row["over_exllamav3_min"] = min(paired, default=row["over_exllamav3"])
            row["over_exllamav3_max"] = max(paired, default=row["over_exllamav3"])
            r = roofs.get(states[name], {}).get(n)
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


def repeat_of(row: dict) -> int:
    return row.get("repeat", 0)


def repeat_ratios(run: dict, name: str, ref: str, n: int) -> list[float]:
    """NAME's per-request tok/s over REF's at level N, one ratio per repeat both reported in one phase: the two ran
    back to back in that repeat (same_run.py alternates the variants' order), so these ratios' spread is the
    comparison's own."""
    speed = {
        (r["variant"], r.get("phase", 1), r["repeat"]): r.get("per_request_tok_s")
        for r in run.get("runs", [])
        if r.get("concurrency") == n and r.get("variant") in (name, ref) and not r.get("refused")
    }
    return sorted(
        round(speed[name, p, k] / speed[ref, p, k], 3)
        for (v, p, k) in speed
        if v == name and speed[name, p, k] and speed.get((ref, p, k))
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
    """(numerator, denominator, what) variant pairs of one phase: NAME-lora, NAME-lora-tuned and NAME-lora-experts
    over NAME, NAME-lora-tuned and NAME-lora-experts over NAME-lora, NAME-p12 and NAME-keep over NAME, NAME over
    NAME-nop8."""
    out = []
    for n, v in run["variants"].items():
        for suffix, kind, what in PAIRS:
            base = n[: -len(suffix)]
            if n.endswith(suffix) and base in run["variants"] and run["variants"][base].get("phase") == v.get("phase"):
                out.append((n, base, what) if kind == "adapter" else (base, n, what))
    return out


def engines_table(run: dict, states: dict) -> list[str]:
    head = ("variant", "engine", "state", "phase", "ready (s)", "weights GiB", "KV pool GiB", "KV tokens")
    md = ["| " + " | ".join((*head, "attention block", "note")) + " |"]
    md.append("|---|---|---|---|---|---|---|---|---|---|")
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
            extra = f"; cache {v['cache_tokens']} tokens, batch {v['max_batch_size']}" if v.get("cache_tokens") else ""
            note = f"load {v['load_s']} s, warm-up {v.get('warmup_s')} s{extra}" + (f"; {note}" if note else "")
        weights, pool = (v.get(k, "-") for k in ("weights_gib", "kv_reserved_gib"))
        cells = [name, engine, states[name], v.get("phase", 1), ready, weights, pool, tokens, block, note]
        md.append("| " + " | ".join(str(c) for c in cells) + " |")
    return md


def checks_text(run: dict) -> list[str]:
    """How the run kept idle engines and compiles out of the levels, from what its JSON records; and what it
    refused."""
    md = []
    if "pause_idle" in run:
        md.append(
            "Idle engines: "
            + (
                "while one variant was measured, every other was stopped (SIGSTOP of its process tree, bench/pause.py) "
                "and resumed before its own levels; each row records which were stopped."
                if run["pause_idle"]
                else "left running while another was measured (--no-pause)."
            )
        )
    watched = [c for c in run.get("compile_check") or [] if c]
    if watched:
        dirs = sorted({d for c in watched for d in c.get("watched", [])})
        inside = [c for c in run.get("compiles", []) if c.get("level")]
        outside = [c for c in run.get("compiles", []) if not c.get("level")]
        md.append(
            "Compiles: after the levels, every file the compile caches "
            + (", ".join(f"`{d}`" for d in dirs) if dirs else "(none watched)")
            + " gained since the first measured level, and every `Triton kernel JIT compilation during inference` "
            "warning in the aphrodite engines' logs (0.24's kernel JIT monitor), was matched against the levels' "
            "wall-clock windows: "
            + (
                f"{len(inside)} inside a measured level (that level refused: below)"
                if inside
                else "none inside a level"
            )
            + (f", {len(outside)} between levels" if outside else "")
            + "."
        )
    for i, cut in enumerate(run.get("stopped") or [], 1):
        if cut:
            md.append(
                f"Phase {i} reached its deadline before repeat {cut['repeat']} of N = {cut['concurrency']} "
                f"({cut['variant']}): the repeats column counts what ran."
            )
    refused = [r for r in run.get("runs", []) if r.get("refused")]
    if refused:
        md += ["", "Refused levels (left out of every figure above):", ""]
        for r in refused:
            md.append(f"- {r['variant']} N = {r['concurrency']} repeat {r['repeat']}: {'; '.join(r['refused'])}")
    return md


def goals_text(table: list[dict]) -> list[str]:
    lines = []
    for name in dict.fromkeys(r["variant"] for r in table):
        rs = {r["concurrency"]: r for r in table if r["variant"] == name and r["exllamav3_same_state"]}
        if not rs:
            continue
        ref = next(iter(rs.values()))["exllamav3"]
        for lo, hi, goal in GOALS:
            got = [(n, r["over_exllamav3"]) for n, r in sorted(rs.items()) if lo <= n <= hi and r["over_exllamav3"]]
            if got:
                worst = min(v for _, v in got)
                each = ", ".join(f"{v} at {n}" for n, v in got)
                span = f"N = {lo}" if lo == hi else f"N = {lo}-{hi}"
                lines.append(
                    f"- {name} / {ref}, {span}, at least {goal}x per request: {each} "
                    f"({'met' if worst >= goal else 'not met'})"
                )
    return ["", "Goals at the same state width (reported, not asserted):", "", *lines] if lines else []


def markdown(run: dict, table: list[dict], bandwidth_source: str | None, title: str) -> list[str]:
    states = {r["variant"]: r["state_dtype"] for r in table}
    for name, v in run["variants"].items():
        states.setdefault(name, v.get("state_dtype") or "-")
    md = [f"# Same-run comparison: {title}", "", *engines_table(run, states)]
    md += ["", "Formula: " + " ".join(run.get("formula", "").split()), ""]
    checks = checks_text(run)
    md += [*checks, ""] if checks else []
    x3 = any(is_exllamav3(v) for v in run["variants"].values())
    roof = all("roofline_per_request" in r for r in table)
    md += [
        f"Roofline: bench/roofline.py with the copy bandwidth {bandwidth_source}, prompt {run.get('prompt', 512)} "
        f"+ output {run.get('output', 256)}, each variant's own GDN state bytes; the weights a step reads leave out "
        "the vision tower and the MTP head and count the expected distinct routed experts of N x k routes."
        if roof
        else "Roofline: none (no copy bandwidth measured in this run or on this GPU kind).",
        "",
        (
            "| variant | state | N | repeats | per-request tok/s, median (min-max) | each repeat | decode tok/s | "
            "TTFT s | all N active | "
            + ("/ exllamav3 | " if x3 else "")
            + ("roofline per request | of roofline |" if roof else "")
        ).rstrip(),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if x3 else "") + ("---|---|" if roof else ""),
    ]
    for r in sorted(table, key=lambda r: (r["concurrency"], r["phase"], r["variant"])):
        cells = [spread({"median": r[k], "min": r[f"{k}_min"], "max": r[f"{k}_max"]}) for k in METRICS]
        over = {"median": r["over_exllamav3"], "min": r["over_exllamav3_min"], "max": r["over_exllamav3_max"]}
        ratio = ""
        if x3:
            ratio = spread(over) + ("" if r["exllamav3_same_state"] or not r["over_exllamav3"] else " (state differs)")
            ratio += " | "
        active = f"{r['active_min']}/{r['concurrency']}" if r["active_min"] is not None else "-"
        active += f", {r['refused']} refused" if r["refused"] else ""
        of = f"{r['roofline_per_request']} | {r['of_roofline']} |" if roof else ""
        row = (
            f"| {r['variant']} | {r['state_dtype']} | {r['concurrency']} | {r['repeats']} | {cells[0]} | "
            f"{r['each_repeat'] or '-'} | {cells[1]} | {cells[2]} | {active} | "
        )
        md.append(f"{row}{ratio}{of}".rstrip())
    md += goals_text(table)
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
    if not roof:
        return md
    md += [
        "",
        "| state | N | weights GB/step | KV GB/step | state GB/step | roofline step ms |",
        "|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in sorted(table, key=lambda r: (r["state_dtype"], r["concurrency"])):
        if (r["state_dtype"], r["concurrency"]) in seen:
            continue
        seen.add((r["state_dtype"], r["concurrency"]))
        md.append(
            f"| {r['state_dtype']} | {r['concurrency']} | {r['weight_gb']} | {r['kv_gb']} | {r['state_gb']} | "
            f"{r['roofline_step_ms']} |"
        )
    return md


def main(argv: list[str] | None = None) -> int:
    import json
    import lzma

    p = level_parser(__doc__, bandwidth_required=False, many=True)
    p.add_argument(
        "--refuse",
        action="append",
        default=[],
        metavar="NAME=N:REASON",
        help="a level of an older run (recorded before same_run.py checked its levels) refused, with its reason",
    )
    args = p.parse_args(argv)
    for f in (*args.run, args.inputs, args.bandwidth_file):
        if f is not None and not f.is_file():
            p.error(f"{f}: no such file")
    try:
        run = merge([json.loads(f.read_text()) for f in args.run], [f.name for f in args.run])
        for spec in args.refuse:
            refuse(run, spec)
        inputs = read_inputs(args.inputs)
        if args.bandwidth_file:
            bandwidth = json.loads(args.bandwidth_file.read_text())["copy_bandwidth_gbps"]
            source = f"in `{args.bandwidth_file}`"
        elif run.get("bandwidth"):
            bandwidth = run["bandwidth"]["copy_bandwidth_gbps"]
            source = (
                f"{bandwidth} GB/s, measured on the run's GPU before its engines started (bench/roofline.py --measure)"
            )
        else:
            bandwidth, source = None, None
        table = rows(run, inputs, bandwidth)
    except (ValueError, KeyError, TypeError, AttributeError, lzma.LZMAError) as e:
        p.error(f"cannot read the run: {type(e).__name__}: {e}")
    if not table:
        p.error(f"{', '.join(map(str, args.run))}: no measured level")
    stem = args.stem or "compare_" + Path(run.get("model", "model")).parent.name
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", table)
    md = with_notes(markdown(run, table, source, args.title or stem), args.note)
    write_table(args.out / f"{stem}.md", md)
    panels = [("per_request", "tokens/s per request"), ("decode", "decode tokens/s (all requests)")]
    plot_levels(table, args.out / f"{stem}.png", args.title or stem, panels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
