"""bench/compare_report.py on the 35B-A3B checkpoint's real config and header table (run 20's inputs, written on the
H200 by make-tiny) with a same_run.py result of made-up figures (a fake input: the run's numbers)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import compare_report  # noqa: E402

INPUTS = ROOT / "docs" / "gpu-runs" / "2026-12-03-run20" / "inputs-qwen3.6-35b-a3b-full-3bit-exl3.json.xz"
BANDWIDTH = ROOT / "docs" / "gpu-runs" / "2026-12-01-run14" / "fulldepth" / "bandwidth.json"
MODEL = "/tmp/hxf-models/qwen3.6-35b-a3b-full-3bit/exl3"


def stat(m: float) -> dict:
    return {"median": m, "min": round(m * 0.98, 2), "max": round(m * 1.01, 2)}


def fake_run() -> dict:
    speed = {"aphrodite-0.24": 150.0, "aphrodite-0.24-lora": 120.0, "exllamav3": 200.0, "aphrodite-0.21": None}
    summary, runs = {}, []
    for name, base in speed.items():
        summary[name] = {}
        for n in (1, 8):
            if base is None:
                summary[name][str(n)] = {}
                continue
            per = round(base / (1 + n / 8), 2)
            summary[name][str(n)] = {
                "per_request_tok_s": stat(per),
                "decode_tok_s": stat(per * n),
                "ttft_mean_s": stat(0.05 * n),
            }
            runs += [{"variant": name, "concurrency": n, "repeat": k} for k in range(3)]
    aphrodite = [sys.executable, "-m", "aphrodite.entrypoints.cli.main", "run", MODEL]
    variants = {
        "aphrodite-0.24": {"command": aphrodite, "started": True, "ready_s": 300.1, "kv_cache_tokens": 70720.0},
        "aphrodite-0.24-lora": {"command": [*aphrodite, "--enable-lora"], "started": True, "ready_s": 320.0},
        "exllamav3": {
            "command": [sys.executable, "bench/exllamav3_generator.py", MODEL],
            "started": True,
            "ready_s": 80.0,
            "load_s": 30.0,
            "warmup_s": 12.0,
        },
        "aphrodite-0.21": {"command": aphrodite, "started": False, "error": "RuntimeError: out of | memory"},
    }
    return {"model": MODEL, "formula": "decode tok/s = ...", "variants": variants, "summary": summary, "runs": runs}


def report(tmp_path, run: dict, bandwidth=BANDWIDTH):
    (tmp_path / "run.json").write_text(json.dumps(run))
    args = [str(tmp_path / "run.json"), "--inputs", str(INPUTS)]
    args += ["--bandwidth-file", str(bandwidth)] if bandwidth else []
    args += ["--note", "What the JSON cannot say.", "--note", "A second paragraph."]
    assert compare_report.main([*args, "--out", str(tmp_path / "out")]) == 0
    stem = tmp_path / "out" / "compare_qwen3.6-35b-a3b-full-3bit"
    rows = {(r["variant"], int(r["concurrency"])): r for r in csv.DictReader(open(f"{stem}.csv"))}
    return rows, open(f"{stem}.md").read()


def test_levels_against_exllamav3_the_adapter_against_its_base_and_the_moe_roofline(tmp_path):
    rows, md = report(tmp_path, fake_run())
    assert len(rows) == 6 and ("aphrodite-0.21", 1) not in rows  # a variant that did not start has no row
    assert md.startswith("# Same-run comparison: compare_qwen3.6-35b-a3b-full-3bit\n\nWhat the JSON cannot say.\n\n")
    assert "A second paragraph.\n\n| variant | engine |" in md
    assert float(rows["aphrodite-0.24", 1]["over_exllamav3"]) == 0.75 and rows["exllamav3", 1]["over_exllamav3"] == ""
    # aphrodite-0.24-lora / aphrodite-0.24; the time a token grows by 1000/106.67 - 1000/133.33 ms
    assert "- N = 1: per-request 0.800, decode 0.800; a request's time per token +1.87 ms" in md
    # the routed experts a step reads grow with N (256 experts, 8 a token); the rest of the weights do not
    one, eight = float(rows["exllamav3", 1]["weight_gb"]), float(rows["exllamav3", 8]["weight_gb"])
    assert 1.2 < one < 1.6 and 3.4 < eight < 4.2
    r = rows["aphrodite-0.24", 8]
    assert float(r["of_roofline"]) == round(float(r["per_request"]) / float(r["roofline_per_request"]), 3) < 1
    assert (
        "| aphrodite-0.21 | aphrodite run | - | 1 | did not start | - | - | - | - | RuntimeError: out of / memory |"
        in md
    )
    assert (
        "| exllamav3 | exllamav3 generator | float16 | 1 | 80.0 | - | - | - | - | load 30.0 s, warm-up 12.0 s |" in md
    )
    # no exllamav3 variant keeps a float32 state here: the ratio is to the one there is, and says so
    assert (
        "| aphrodite-0.24 | float32 | 1 | 3 | 133.33 (130.66-134.66) | - | 133.33 (130.66-134.66) | 0.05 | - | "
        "0.75 (state differs) |" in md
    )


def test_a_run_without_exllamav3_has_no_ratio_column_and_its_rows_keep_their_cells(tmp_path):
    run = fake_run()
    for part in ("variants", "summary"):
        del run[part]["exllamav3"]
    run["runs"] = [r for r in run["runs"] if r["variant"] != "exllamav3"]
    _, md = report(tmp_path, run)
    head = next(line for line in md.splitlines() if line.startswith("| variant | state | N |"))
    assert "exllamav3" not in head and head.count("|") == 12
    assert (
        "| aphrodite-0.24 | float32 | 1 | 3 | 133.33 (130.66-134.66) | - | 133.33 (130.66-134.66) | 0.05 | - | " in md
    )
    rows = [line for line in md.splitlines() if line.startswith("| aphrodite-0.24")]
    assert rows and all(line.count("|") == 12 for line in rows if "aphrodite run" not in line)
    assert "- N = 8: per-request 0.800" in md  # the adapter against its base stays


def test_without_a_bandwidth_file_the_report_has_no_roofline_rather_than_another_cards(tmp_path):
    rows, md = report(tmp_path, fake_run(), bandwidth=None)
    assert len(rows) == 6 and "of_roofline" not in rows["aphrodite-0.24", 1]
    assert "Roofline: none (no copy bandwidth measured in this run or on this GPU kind)." in md
    head = next(line for line in md.splitlines() if line.startswith("| variant | state | N |"))
    assert "roofline" not in head and head.count("|") == 11
    table = [line for line in md.splitlines() if line.startswith("| aphrodite-0.24 | float32 | 1 |")]
    assert table == [
        "| aphrodite-0.24 | float32 | 1 | 3 | 133.33 (130.66-134.66) | - | 133.33 (130.66-134.66) | 0.05 | - | "
        "0.75 (state differs) |"
    ]
    assert "- N = 1: per-request 0.800, decode 0.800; a request's time per token +1.87 ms" in md
    assert "weights GB/step" not in md


def test_a_stem_names_the_files_so_a_second_run_of_one_checkpoint_keeps_the_first(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(fake_run()))
    args = [str(tmp_path / "run.json"), "--inputs", str(INPUTS), "--bandwidth-file", str(BANDWIDTH)]
    assert compare_report.main([*args, "--out", str(tmp_path / "out"), "--stem", "compare_35b-lora"]) == 0
    names = {p.name for p in (tmp_path / "out").iterdir()}  # the plot too where matplotlib is installed
    assert {"compare_35b-lora.csv", "compare_35b-lora.md"} <= names
    assert names <= {"compare_35b-lora.csv", "compare_35b-lora.md", "compare_35b-lora.png"}


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"summary": {"x": {"1": None}}, "variants": {}})])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, content):
    run = tmp_path / "run.json"
    if content is not None:
        run.write_text(content)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "compare_report.py"), str(run), "--inputs", str(INPUTS)]
    cmd += ["--bandwidth-file", str(BANDWIDTH), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("compare_report.py: error: ")
    assert not out.exists()


def test_ratios_carry_the_spread_of_the_repeats_and_a_nop8_variant_gives_p8s_before_and_after(tmp_path):
    run = fake_run()
    run["variants"]["aphrodite-0.24-nop8"] = dict(run["variants"]["aphrodite-0.24"])
    run["summary"]["aphrodite-0.24-nop8"] = {
        str(n): {k: stat(v["median"] / 1.05) for k, v in run["summary"]["aphrodite-0.24"][str(n)].items()}
        for n in (1, 8)
    }
    # each repeat's own speeds: aphrodite-0.24 at N = 1 against exllamav3 0.70, 0.75, 0.80; P8 off 1.02, 1.05, 1.08
    speeds = {"aphrodite-0.24": (140.0, 150.0, 160.0), "exllamav3": (200.0,) * 3}
    speeds["aphrodite-0.24-nop8"] = tuple(round(a / b, 4) for a, b in zip(speeds["aphrodite-0.24"], (1.02, 1.05, 1.08)))
    run["runs"] = [
        {"variant": v, "concurrency": 1, "repeat": k, "per_request_tok_s": s}
        for v, ss in speeds.items()
        for k, s in enumerate(ss)
    ]
    rows, md = report(tmp_path, run)
    r = rows["aphrodite-0.24", 1]
    assert (float(r["over_exllamav3_min"]), float(r["over_exllamav3_max"])) == (0.7, 0.8)
    assert (
        "| aphrodite-0.24 | float32 | 1 | 3 | 133.33 (130.66-134.66) | 140.0 / 150.0 / 160.0 | 133.33 (130.66-134.66) "
        "| 0.05 | - | 0.75 (0.7-0.8) (state differs) |" in md
    )
    assert "aphrodite-0.24 / aphrodite-0.24-nop8 (medians; P8 on over P8 off" in md
    # 1000/133.33 - 1000/(133.33/1.05): P8 on saves 0.38 ms a token (medians rounded to 2 decimals)
    assert (
        "- N = 1: per-request 1.050 (1.020-1.080 over the repeats), decode 1.050; a request's time per token -0.38 ms"
        in md
    )
    assert "aphrodite-0.24-lora / aphrodite-0.24 (medians; the adapter's speed as a share of its base)" in md


def test_p12_and_the_tuned_adapter_pair_with_their_bases():
    run = {"variants": dict.fromkeys(["a-0.24", "a-0.24-p12", "a-0.24-lora", "a-0.24-lora-tuned", "x3"], {})}
    found = {(num, den) for num, den, _ in compare_report.pairs(run)}
    assert found == {
        ("a-0.24-lora", "a-0.24"),
        ("a-0.24-lora-tuned", "a-0.24"),
        ("a-0.24-lora-tuned", "a-0.24-lora"),
        ("a-0.24-p12", "a-0.24"),
    }


def test_the_expert_adapter_pairs_with_its_base_and_with_the_adapter_without_experts():
    run = {"variants": dict.fromkeys(["a-0.24", "a-0.24-lora", "a-0.24-lora-experts"], {})}
    assert {(num, den) for num, den, _ in compare_report.pairs(run)} == {
        ("a-0.24-lora", "a-0.24"),
        ("a-0.24-lora-experts", "a-0.24"),
        ("a-0.24-lora-experts", "a-0.24-lora"),
    }


RUN25 = ROOT / "docs" / "gpu-runs" / "2026-12-05-run25" / "inputs-qwen3.6-27b-full-3bit-exl3.json.xz"
MODEL27 = "/tmp/hxf-models/qwen3.6-27b-full/exl3"


def phase(speeds: dict, states: dict, *, refused: dict | None = None) -> dict:
    """One same_run.py JSON (fake figures): ``speeds`` variant -> {N: [per-request tok/s of each repeat]}, every
    repeat streaming all N at once unless ``refused`` names (variant, N, repeat) -> reasons."""
    import statistics

    runs, summary, variants = [], {}, {}
    for name, levels in speeds.items():
        x3 = name.startswith("exllamav3")
        cmd = [sys.executable, "bench/exllamav3_generator.py" if x3 else "aphrodite", MODEL27]
        variants[name] = {"command": cmd, "started": True, "ready_s": 100.0, "state_dtype": states[name]}
        summary[name] = {}
        for n, each in levels.items():
            rows = []
            for k, v in enumerate(each):
                why = (refused or {}).get((name, n, k), [])
                row = {"variant": name, "repeat": k, "concurrency": n, "per_request_tok_s": v, "decode_tok_s": v * n}
                row.update(ttft_mean_s=0.1, active=n, refused=why, **({"active_jobs": n} if x3 else {}))
                rows.append(row)
            runs += rows
            kept = [r["per_request_tok_s"] for r in rows if not r["refused"]]
            summary[name][str(n)] = {
                "per_request_tok_s": {"median": statistics.median(kept), "min": min(kept), "max": max(kept)},
                "decode_tok_s": {"median": statistics.median(kept) * n, "min": min(kept) * n, "max": max(kept) * n},
                "ttft_mean_s": {"median": 0.1, "min": 0.1, "max": 0.1},
                **({"refused": {"rows": len(rows) - len(kept)}} if len(kept) < len(rows) else {}),
            }
    return {
        "model": MODEL27,
        "formula": "one formula",
        "prompt": 128,
        "output": 64,
        "variants": variants,
        "runs": runs,
        "summary": summary,
        "bandwidth": {"copy_bandwidth_gbps": 3000.0},
        "pause_idle": True,
        "compile_check": {"watched": ["/tmp/hxf-triton-0.24"], "jit_monitor_logs": list(speeds)},
        "compiles": [{"what": "/tmp/hxf-triton-0.24/x.json", "when": 1.0, "level": None}],
    }


def two_phases(tmp_path, refused=None):
    """The float32-state pair in one phase, the 2-byte pair in another, as an 80 GB card runs them."""
    a = phase(
        {
            "aphrodite-0.24": {1: [52.0, 52.5, 53.0, 52.2, 52.4], 8: [48.0] * 5},
            "exllamav3-fp32": {1: [50.0, 50.0, 52.0, 51.0, 50.0], 8: [30.0, 31.0, 29.0, 30.0, 30.0]},
        },
        {"aphrodite-0.24": "float32", "exllamav3-fp32": "float32"},
        refused=refused,
    )
    b = phase(
        {"aphrodite-0.24-bf16state": {1: [54.0] * 5, 8: [50.0] * 5}, "exllamav3": {1: [52.0] * 5, 8: [32.0] * 5}},
        {"aphrodite-0.24-bf16state": "bfloat16", "exllamav3": "float16"},
    )
    files = []
    for i, run in enumerate((a, b), 1):
        files.append(tmp_path / f"phase{i}.json")
        files[-1].write_text(json.dumps(run))
    out = tmp_path / "out"
    argv = [*map(str, files), "--inputs", str(RUN25), "--out", str(out), "--stem", "sound"]
    assert compare_report.main(argv) == 0
    rows = {(r["variant"], int(r["concurrency"])): r for r in csv.DictReader(open(out / "sound.csv"))}
    return rows, (out / "sound.md").read_text()


def test_each_variant_is_divided_by_the_exllamav3_of_its_phase_with_as_many_state_bytes(tmp_path):
    rows, md = two_phases(tmp_path)
    r = rows["aphrodite-0.24", 1]
    assert r["exllamav3"] == "exllamav3-fp32" and r["exllamav3_same_state"] == "True"
    assert float(r["over_exllamav3"]) == round(52.4 / 50.0, 3)
    # repeat by repeat, within the phase: 52.0/50, 52.5/50, 53/52, 52.2/51, 52.4/50
    assert (float(r["over_exllamav3_min"]), float(r["over_exllamav3_max"])) == (1.019, 1.05)
    b = rows["aphrodite-0.24-bf16state", 8]
    assert b["exllamav3"] == "exllamav3" and float(b["over_exllamav3"]) == round(50 / 32, 3)
    assert "| aphrodite-0.24 | float32 | 1 | 5 | 52.4 (52.0-53.0) | 52.0 / 52.5 / 53.0 / 52.2 / 52.4 |" in md
    assert "| 1/1 | 1.048 (1.019-1.05) |" in md and "(state differs)" not in md
    assert "- aphrodite-0.24 / exllamav3-fp32, N = 1, at least 1.1x per request: 1.048 at 1 (not met)" in md
    assert "- aphrodite-0.24-bf16state / exllamav3, N = 8-64, at least 1.5x per request: 1.562 at 8 (met)" in md


def test_each_engine_has_the_roofline_of_its_own_state_and_the_runs_own_bandwidth(tmp_path):
    rows, md = two_phases(tmp_path)
    fp32, fp16 = rows["exllamav3-fp32", 8], rows["exllamav3", 8]
    assert float(fp32["state_gb"]) > 1.9 * float(fp16["state_gb"]) and fp32["weight_gb"] == fp16["weight_gb"]
    assert float(fp32["roofline_per_request"]) < float(fp16["roofline_per_request"])
    assert rows["aphrodite-0.24-bf16state", 8]["state_gb"] == fp16["state_gb"]  # 2 bytes a value both
    assert "3000.0 GB/s, measured on the run's GPU before its engines started" in md
    # the MTP head is out of the weights: the whole checkpoint less the embedding table, head and all
    assert float(rows["exllamav3", 1]["weight_gb"]) < 10.2
    assert "| float16 | 8 |" in md and "| float32 | 8 |" in md and "| bfloat16 | 8 |" in md


def test_refused_repeats_are_out_of_every_figure_and_listed_with_their_reason(tmp_path):
    why = {("exllamav3-fp32", 8, 2): ["at most 6 of 8 requests streamed at once"]}
    rows, md = two_phases(tmp_path, refused=why)
    x3 = rows["exllamav3-fp32", 8]
    assert x3["repeats"] == "4" and x3["refused"] == "1" and x3["each_repeat"] == "30.0 / 31.0 / 30.0 / 30.0"
    # aphrodite's repeat 2 has no partner: 4 ratios, not 5
    assert (float(rows["aphrodite-0.24", 8]["over_exllamav3_min"]), len(x3["each_repeat"].split(" / "))) == (1.548, 4)
    assert "- exllamav3-fp32 N = 8 repeat 2: at most 6 of 8 requests streamed at once" in md
    assert "| 8/8, 1 refused |" in md
    assert "SIGSTOP" in md and "none inside a level, 2 between levels" in md  # one a phase


def test_variants_of_different_phases_are_never_divided_by_each_other(tmp_path):
    rows, _ = two_phases(tmp_path)
    assert rows["aphrodite-0.24", 8]["exllamav3"] == "exllamav3-fp32"
    run = compare_report.merge(
        [{"variants": {"a-lora": {}}, "summary": {}}, {"variants": {"a": {}}, "summary": {}}], ["1", "2"]
    )
    assert compare_report.pairs(run) == []  # the adapter and its base ran in different phases


def test_a_variant_name_in_two_phases_is_refused(tmp_path):
    one = phase({"a": {1: [1.0]}}, {"a": "float32"})
    for name in ("p1.json", "p2.json"):
        (tmp_path / name).write_text(json.dumps(one))
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "compare_report.py"),
        str(tmp_path / "p1.json"),
        str(tmp_path / "p2.json"),
    ]
    r = subprocess.run([*cmd, "--inputs", str(RUN25), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "variant a is in two runs" in r.stderr and "Traceback" not in r.stderr


def test_a_level_of_an_older_run_can_be_refused_with_its_reason(tmp_path):
    run = fake_run()
    run["runs"] = [{**r, "per_request_tok_s": 100.0} for r in run["runs"]]
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "out"
    argv = [str(tmp_path / "run.json"), "--inputs", str(INPUTS), "--out", str(out), "--stem", "old"]
    assert compare_report.main([*argv, "--refuse", "exllamav3=8:its cache held 6 of 8 jobs"]) == 0
    rows = {(r["variant"], int(r["concurrency"])) for r in csv.DictReader(open(out / "old.csv"))}
    assert ("exllamav3", 8) not in rows and ("exllamav3", 1) in rows
    md = (out / "old.md").read_text()
    assert "- exllamav3 N = 8 repeat 0: its cache held 6 of 8 jobs" in md
    assert (
        "| aphrodite-0.24 | float32 | 8 | 3 | 75.0 (73.5-75.75) | 100.0 / 100.0 / 100.0 | 600.0 (588.0-606.0) | " in md
    )
    with pytest.raises(SystemExit):
        compare_report.main([*argv, "--refuse", "nobody=8:x"])
