"""The MTP same-run page: one known-acceptance checkpoint served by aphrodite with and without MTP speculative
decoding (and with an adapter) beside exllamav3 drafting with the same MTP head, from ci/stages/mtp-compare.sh's
bench/same_run.py phases.

    python3 bench/mtp_report.py PHASE1.json [PHASE2.json ...] --manifest MANIFEST.json --out bench/results \
        [--stem NAME] [--title "..."] [--note "..."]...

Per token pool (one chosen acceptance rate of make-tiny ``--mtp-acceptance``, checkpoint/mtpaccept.py), concurrency
and variant: every reported repeat's per-request tok/s (bench/level_figures.py's one formula), their median and
spread, decode tok/s, the engine's own acceptance over those repeats (aphrodite: accepted / draft tokens from its
speculative counters, and per draft position; exllamav3: its jobs' accepted / (accepted + rejected) draft tokens)
beside what the chosen rate gives (``(P + ... + P^k) / k`` of the draft tokens), the ratio to exllamav3 at the same
draft size measured in the same phase (each repeat's own pair, alternated back to back; its spread), and MTP's gain
over the same engine without drafting in that phase. A variant's draft size: aphrodite's
``num_speculative_tokens`` (``--speculative-config``), exllamav3's ``draft_tokens`` (same_run.py
``--exllamav3-draft``; 0 for the process itself, its MTP head loaded but not drafting). Between phases only ratios
are compared, each taken inside its own phase, and exllamav3 without drafting, measured in every phase, shows how
far the phases' conditions differ. Writes ``STEM.md`` and ``STEM.csv``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from compare_report import is_exllamav3  # noqa: E402
from report import spread, write_csv, write_table  # noqa: E402

# the goals the page reports (asserted by no test): aphrodite over exllamav3 per request at the same draft size
GOALS = {1: 1.10, 8: 1.5}


def draft_size(variant: dict) -> int:
    """aphrodite's num_speculative_tokens (0 without --speculative-config), exllamav3's draft tokens a level."""
    if "draft_tokens" in variant:
        return int(variant["draft_tokens"])
    command = variant.get("command", [])
    if "--speculative-config" in command[:-1]:
        return int(json.loads(command[command.index("--speculative-config") + 1])["num_speculative_tokens"])
    return 0


def engine(name: str, variant: dict) -> str:
    if is_exllamav3(variant):
        return "exllamav3"
    return "aphrodite + LoRA" if "--enable-lora" in variant.get("command", []) else "aphrodite"


def expected(rate: float, k: int) -> float | None:
    """The share of draft tokens accepted at rate ``rate`` with ``k`` draft tokens a step: (P + ... + P^k) / k."""
    return round(sum(rate**j for j in range(1, k + 1)) / k, 4) if k else None


def acceptance(rows: list[dict]) -> tuple[float | None, list[float]]:
    """The engine's own share of draft tokens accepted over ``rows``, and aphrodite's per position."""
    acc = tot = 0.0
    per: list[list[float]] = []
    for r in rows:
        if r.get("spec"):
            acc += r["spec"]["accepted_tokens"]
            tot += r["spec"]["draft_tokens"]
            per.append([p * r["spec"]["drafts"] for p in r["spec"]["per_position"]] + [r["spec"]["drafts"]])
        elif "draft_accepted" in r:
            acc += r["draft_accepted"]
            tot += r["draft_accepted"] + r["draft_rejected"]
    positions = []
    if per:
        drafts = sum(p[-1] for p in per)
        positions = [round(sum(p[j] for p in per) / drafts, 3) for j in range(len(per[0]) - 1)] if drafts else []
    return (round(acc / tot, 4) if tot else None), positions


def paired(rows: dict, num: str, den: str) -> list[float]:
    """num / den per-request tok/s per repeat where both were reported (the two ran back to back)."""
    return sorted(
        round(rows[num][k] / rows[den][k], 3) for k in rows.get(num, {}) if k in rows.get(den, {}) and rows[den][k]
    )


def table(phases: list[dict], rates: dict) -> list[dict]:
    out = []
    for p, run in enumerate(phases, 1):
        variants = run["variants"]
        kept = [r for r in run.get("runs", []) if not r.get("refused") and r.get("per_request_tok_s")]
        keys = sorted({(r.get("pool"), r["concurrency"]) for r in kept}, key=lambda k: (str(k[0]), k[1]))
        for pool, n in keys:
            level = [r for r in kept if r.get("pool") == pool and r["concurrency"] == n]
            speed = {}
            for r in level:
                speed.setdefault(r["variant"], {})[r["repeat"]] = r["per_request_tok_s"]
            x3_at = {draft_size(v): name for name, v in variants.items() if is_exllamav3(v)}
            base_of = {}
            for name, v in variants.items():  # the same engine (and adapter) without drafting, in this phase
                if draft_size(v) == 0:
                    base_of[engine(name, v)] = name
            for name, v in variants.items():
                rows = [r for r in level if r["variant"] == name]
                if not rows:
                    continue
                k = draft_size(v)
                each = [r["per_request_tok_s"] for r in sorted(rows, key=lambda r: r["repeat"])]
                decode = [r["decode_tok_s"] for r in rows if r.get("decode_tok_s")]
                got, positions = acceptance(rows)
                row = {"phase": p, "pool": pool, "rate": rates.get(pool), "concurrency": n, "variant": name}
                row.update(engine=engine(name, v), draft=k, repeats=len(rows), each_repeat=" / ".join(map(str, each)))
                row.update(
                    per_request=round(statistics.median(each), 1),
                    per_request_min=min(each),
                    per_request_max=max(each),
                    decode=round(statistics.median(decode), 1) if decode else None,
                    active_min=min(min(r.get("active", n), r.get("active_jobs", n)) for r in rows),
                    acceptance=got,
                    acceptance_expected=expected(rates[pool], k) if pool in rates and k else None,
                    per_position=" / ".join(map(str, positions)),
                )
                ref = x3_at.get(k) if not is_exllamav3(v) else None
                ratios = paired(speed, name, ref) if ref else []
                row["exllamav3"] = ref
                row["over_exllamav3"] = round(statistics.median(ratios), 3) if ratios else None
                row["over_exllamav3_min"], row["over_exllamav3_max"] = (
                    (ratios[0], ratios[-1]) if ratios else (None, None)
                )
                base = base_of.get(engine(name, v))
                gains = paired(speed, name, base) if base and k else []
                row["over_no_mtp"] = round(statistics.median(gains), 3) if gains else None
                row["over_no_mtp_min"], row["over_no_mtp_max"] = (gains[0], gains[-1]) if gains else (None, None)
                lora_base = next(
                    (b for b, w in variants.items() if engine(b, w) == "aphrodite" and draft_size(w) == k), None
                )
                adapter = paired(speed, name, lora_base) if row["engine"] == "aphrodite + LoRA" and lora_base else []
                row["lora_over_base"] = round(statistics.median(adapter), 3) if adapter else None
                out.append(row)
    return out


def markdown(phases: list[dict], rows: list[dict], rates: dict, title: str) -> list[str]:
    md = [f"# {title}", ""]
    md += ["| phase | variant | engine | draft | state | ready (s) | note |", "|---|---|---|---|---|---|---|"]
    for p, run in enumerate(phases, 1):
        for name, v in run["variants"].items():
            note = (v.get("error") or "")[:160].replace("|", "/")
            ready = v.get("ready_s") if v.get("started") else "did not start"
            md.append(
                f"| {p} | {name} | {engine(name, v)} | {draft_size(v)} | {v.get('state_dtype')} | {ready} | {note} |"
            )
    pools = ", ".join(
        f"{n} = tokens {lo}-{hi - 1} at {rates.get(n)}" for n, (lo, hi) in phases[0].get("pools", {}).items()
    )
    md += ["", f"Token pools (chosen MTP acceptance): {pools}.", ""]
    md += ["Formula: " + " ".join(phases[0].get("formula", "").split()), ""]
    head = (
        "| rate | N | phase | variant | draft | per-request tok/s, median (min-max) | each repeat | decode tok/s | "
        "all N active | acceptance (engine) | expected | per position | / exllamav3 same draft | / no MTP | "
        "LoRA / base |"
    )
    md += [head, "|" + "---|" * 15]
    for r in sorted(rows, key=lambda r: (str(r["rate"]), r["concurrency"], r["phase"], r["engine"], r["draft"])):
        cells = [
            r["rate"],
            r["concurrency"],
            r["phase"],
            r["variant"],
            r["draft"],
            spread({"median": r["per_request"], "min": r["per_request_min"], "max": r["per_request_max"]}),
            r["each_repeat"],
            r["decode"] if r["decode"] is not None else "-",
            f"{r['active_min']}/{r['concurrency']}",
            r["acceptance"] if r["acceptance"] is not None else "-",
            r["acceptance_expected"] if r["acceptance_expected"] is not None else "-",
            r["per_position"] or "-",
            spread({"median": r["over_exllamav3"], "min": r["over_exllamav3_min"], "max": r["over_exllamav3_max"]}),
            spread({"median": r["over_no_mtp"], "min": r["over_no_mtp_min"], "max": r["over_no_mtp_max"]}),
            r["lora_over_base"] if r["lora_over_base"] is not None else "-",
        ]
        md.append("| " + " | ".join(str(c) for c in cells) + " |")
    md += ["", "Goals (reported, not asserted): aphrodite per request over exllamav3 at the same draft size and rate,"]
    md += ["at least 1.10x at N = 1 and 1.5x at N = 8; MTP's gain on aphrodite at least exllamav3's.", ""]
    for r in rows:
        if r["engine"] == "aphrodite" and r["draft"] and r["concurrency"] in GOALS and r["over_exllamav3"]:
            goal = GOALS[r["concurrency"]]
            x3 = next(
                (
                    x
                    for x in rows
                    if x["engine"] == "exllamav3"
                    and x["draft"] == r["draft"]
                    and x["phase"] == r["phase"]
                    and x["pool"] == r["pool"]
                    and x["concurrency"] == r["concurrency"]
                ),
                None,
            )
            gain = f"; MTP gain {r['over_no_mtp']} against exllamav3's {x3['over_no_mtp']}" if x3 else ""
            md.append(
                f"- rate {r['rate']}, N = {r['concurrency']}, k = {r['draft']}: {r['over_exllamav3']}x exllamav3 "
                f"({'met' if r['over_exllamav3'] >= goal else 'not met'}, goal {goal}){gain}"
            )
    refused = [r for run in phases for r in run.get("runs", []) if r.get("refused")]
    if refused:
        md += ["", "Refused levels (left out of every figure above):", ""]
        for r in refused:
            md.append(
                f"- {r['variant']} {r.get('pool')} N = {r['concurrency']} repeat {r['repeat']}: "
                + "; ".join(r["refused"])
            )
    for p, run in enumerate(phases, 1):
        if run.get("stopped"):
            cut = run["stopped"]
            md.append(
                f"- Phase {p} reached its deadline before repeat {cut['repeat']} ({cut.get('pool')}, "
                f"N = {cut['concurrency']})."
            )
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="same_run.py's JSON, one a phase, in phase order")
    p.add_argument("--manifest", type=Path, required=True, help="the checkpoint's manifest.json (its chosen rates)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stem", default="mtp_compare")
    p.add_argument("--title", default="MTP speculative decoding beside exllamav3's, one run")
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    for f in (*args.runs, args.manifest):
        if not f.is_file():
            p.error(f"{f}: no such file")
    try:
        phases = [json.loads(f.read_text()) for f in args.runs]
        pools = json.loads(args.manifest.read_text())["mtp_acceptance"]["pools"]
        spans = phases[0].get("pools", {})
        rates = {n: next(q["rate"] for q in pools if q["tokens"] == list(span)) for n, span in spans.items()}
        rows = table(phases, rates)
    except (ValueError, KeyError, TypeError, StopIteration) as e:
        p.error(f"cannot read the runs: {type(e).__name__}: {e}")
    if not rows:
        p.error("no measured level in the runs")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.stem}.csv", rows)
    write_table(args.out / f"{args.stem}.md", markdown(phases, rows, rates, args.title) + ["", *args.note])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
