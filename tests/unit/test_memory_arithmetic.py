"""doctor's memory plan (overlay/doctor/memory/arithmetic.py) against aphrodite's own start-up logs of runs 10 and 11
(committed under docs/gpu-runs/; bench/memory_plan_report.py builds the same table)."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import memory_plan_report as report  # noqa: E402

ROWS = report.rows()


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "layout"], ids=lambda r: r["name"])
def test_kv_layout_matches_the_engine_exactly(row):
    """Pinned pools: block size, KV tokens and concurrency are the engine's arithmetic, to the token."""
    got = report.evaluate(row)
    for key in ("block_size", "kv_cache_tokens", "max_concurrency"):
        assert got[f"{key} ratio"] == 1.0, (key, got)


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "pool"], ids=lambda r: r["name"])
def test_whole_plan_within_5_percent_of_the_logged_pool_and_capacity(row):
    got = report.evaluate(row)
    for key in ("available_kv_gib", "kv_cache_tokens"):
        assert got[f"{key} logged"], (key, got)
        assert abs(got[f"{key} ratio"] - 1) <= 0.05, (key, got)


def test_the_previous_plan_was_far_off_on_a_24g_card():
    """What doctor said before this plan (total x utilization - weights) for the 9B on a 24 GB card: 30 %
    above the pool the engine logged."""
    row = next(r for r in ROWS if r["name"].startswith("9b-24g ("))
    weights = sum(t["bytes"] for n, t in row["tensors"].items() if ".visual." not in n)
    previous = (24 * 0.9 * report.GIB - weights) / report.GIB
    assert previous / report.logged(row["text"])["available_kv_gib"] > 1.25


def test_batch_defaults_follow_the_gpu_size():
    from hybrid_exl3_fixes.doctor.memory.arithmetic import Engine, capture_sizes

    small, big = Engine(24), Engine(141)
    assert (small.max_num_batched_tokens, small.max_num_seqs) == (2048, 256)
    assert (big.max_num_batched_tokens, big.max_num_seqs) == (8192, 1024)
    piecewise, full = capture_sizes(small)
    assert (len(piecewise), piecewise[-1], len(full), full[-1]) == (51, 512, 35, 256)  # the 9B's log


def test_doctor_json_carries_every_term(tmp_path, capsys):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    args = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--language-model-only", "--gpu-mem", "24"]
    main([*args, "--enable-lora", "--max-loras", "4", "--max-num-batched-tokens", "4096", "--enforce-eager"])
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert set(plan["terms"]) == {
        "requested",
        "weights",
        "lora_buffers",
        "load_overhead",
        "activation_peak",
        "non_torch",
        "cudagraphs",
        "runner_buffers",
    }
    assert plan["terms"]["lora_buffers"]["bytes"] > 0 and plan["terms"]["cudagraphs"]["bytes"] == 0
    assert plan["engine"]["max_num_batched_tokens"] == 4096 and plan["engine"]["enforce_eager"] is True
    assert plan["pin_kv_cache_memory"] == plan["kv_pool_bytes"] - 150 * (1 << 20)


def test_limit_mm_per_prompt_zero_is_text_only_and_bad_json_is_a_usage_error(tmp_path, capsys):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    base = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--gpu-mem", "24"]

    def terms(*extra):
        main([*base, *extra])
        return json.loads(capsys.readouterr().out)["plan"]["terms"]

    assert "vision_encoder" in terms()
    assert terms("--limit-mm-per-prompt", '{"image": 0, "video": 0}') == terms("--language-model-only")
    assert "vision_encoder" in terms("--limit-mm-per-prompt", '{"image": 1}')
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--limit-mm-per-prompt", "[1]"])
    assert exit_info.value.code == 2 and "not a JSON object of modality -> count" in capsys.readouterr().err


def test_the_plan_counts_the_mamba_blocks_the_engine_refused_with():
    """Run 14: the 27B at full depth with its pool pinned at 16 GiB stopped with "max_num_seqs (1024) exceeds
    available Mamba cache blocks (655)" (docs/gpu-runs/2026-12-01-run14/fulldepth/try1-contended/); at 28 GiB it
    served (its layout row above)."""
    from hybrid_exl3_fixes.doctor.memory import arithmetic

    inputs = json.loads(
        (ROOT / "docs/gpu-runs/2026-12-01-run12/fulldepth/inputs-qwen3.6-27b-full-exl3.json").read_text()
    )
    eng = arithmetic.Engine(139.8, max_model_len=832, language_model_only=True)
    layout = arithmetic.kv_layout(report.shape_of(inputs["config.json"]), eng)
    logged = ROOT / "docs/gpu-runs/2026-12-01-run14/fulldepth/try1-contended/qwen3.6-27b-full-aphrodite-base.stdout"
    assert "exceeds available Mamba cache blocks (655)" in report.read_log(logged)
    assert arithmetic.kv_capacity(layout, 16 << 30, 832)["blocks"] == 655 < eng.max_num_seqs


def test_doctor_blocks_a_pool_with_fewer_cache_blocks_than_sequences_under_cuda_graphs(tmp_path, capsys):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    base = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--language-model-only", "--gpu-mem", "24"]

    def findings(*extra):
        main([*base, *extra])
        out = json.loads(capsys.readouterr().out)
        return [f for f in out["findings"] if f["check"] == "memory"], out["plan"]

    (ok,), plan = findings()
    assert ok["level"] == "OK" and plan["capacity"]["blocks"] >= plan["engine"]["max_num_seqs"]
    too_many = plan["capacity"]["blocks"] + 1
    (blocked,), plan = findings("--max-num-seqs", str(too_many))
    assert (
        blocked["level"] == "BLOCK" and f"max_num_seqs ({too_many}) exceeds available Mamba cache" in blocked["message"]
    )
    assert f"--max-num-seqs {plan['capacity']['blocks']} or less" in blocked["message"]
    assert plan["min_kv_cache_memory_for_graphs"] > plan["kv_pool_bytes"]
    (eager,), _ = findings("--max-num-seqs", str(too_many), "--enforce-eager")  # no graphs, no such check
    assert eager["level"] == "OK"


def test_prefix_caching_holds_two_state_blocks_per_request_from_0_23(tmp_path):
    """0.23.0+ turn prefix caching on for hybrid models by default and with it the 'align' Mamba cache mode: each
    request holds two state blocks per state group (run 15's and run 17's 0.24.1 logs, run 10's 0.21.0 log
    with --enable-prefix-caching; rows above). doctor plans for the installed release, else 0.24.1."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.doctor import diagnose

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    folder = tmp_path / "t" / "exl3"

    def plan(**kw):
        return diagnose(folder, gpu_mem=24, max_model_len=2048, check_overlay=False, **kw).plan

    newest, old = plan(), plan(release="0.21.0")
    assert newest["engine"]["release"] == "0.24.1" and newest["layout"]["state_blocks_per_request"] == 2
    assert old["layout"]["state_blocks_per_request"] == 1 and not old["engine"]["prefix_caching"]
    assert plan(release="0.22.0")["layout"]["state_blocks_per_request"] == 1
    assert plan(release="0.23.0")["layout"]["state_blocks_per_request"] == 2
    assert plan(prefix_caching=False)["layout"]["state_blocks_per_request"] == 1
    assert plan(release="0.21.0", prefix_caching=True)["layout"]["state_blocks_per_request"] == 2
    # 0.22.0 and 0.23.0 differ in the default alone: the pool and blocks are the same; the requests they hold fewer
    v22, v23 = plan(release="0.22.0"), plan(release="0.23.0")
    assert v23["capacity"]["blocks"] == v22["capacity"]["blocks"]
    per = v23["layout"]["attention_groups"] * -(-2048 // v23["layout"]["block_size"])
    assert v23["capacity"]["blocks_per_request"] == per + 2 * v23["layout"]["state_groups"]
    assert v23["max_concurrency"] < v22["max_concurrency"] and newest["max_concurrency"] < old["max_concurrency"]
    assert "prefix caching on: 2 state block(s)" in newest["layout"]["formula"]


def test_mamba_ssm_cache_dtype_replaces_the_configs_state_dtype(tmp_path, capsys):
    """--mamba-ssm-cache-dtype other than auto wins over the config's mamba_ssm_dtype (aphrodite models/config.py,
    Qwen3_5ForConditionalGenerationConfig); run 18's 27B pair (rows above) is the engine's own arithmetic.
    doctor plans the override as a checkpoint whose config says bfloat16."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "f32", TinySpec(), dense=False)
    write_tiny(tmp_path / "bf16", TinySpec(ssm_dtype="bfloat16"), dense=False)

    def plan(folder, *extra):
        main(["doctor", str(tmp_path / folder / "exl3"), "--json", "--language-model-only", "--gpu-mem", "24", *extra])
        return json.loads(capsys.readouterr().out)["plan"]

    f32, bf16 = plan("f32"), plan("bf16")
    flagged = plan("f32", "--mamba-ssm-cache-dtype", "bfloat16")
    assert f32["max_concurrency"] < bf16["max_concurrency"] == flagged["max_concurrency"]
    assert flagged["layout"]["block_size"] == bf16["layout"]["block_size"] < f32["layout"]["block_size"]
    assert plan("bf16", "--mamba-ssm-cache-dtype", "float32")["max_concurrency"] == f32["max_concurrency"]
    assert plan("f32", "--mamba-ssm-cache-dtype", "auto")["max_concurrency"] == f32["max_concurrency"]
    with pytest.raises(SystemExit) as exc:
        main(["doctor", str(tmp_path / "f32" / "exl3"), "--mamba-ssm-cache-dtype", "fp8"])
    assert exc.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["latest", "0.24", "0.24.1.2", "a.b.c", ""])
def test_a_bad_release_is_refused_by_the_command_line(tmp_path, bad, capsys):
    from hybrid_exl3_fixes.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["doctor", str(tmp_path), "--release", bad])
    assert exc.value.code == 2 and "is not a release number like 0.24.1" in capsys.readouterr().err


@pytest.mark.parametrize("row", [r for r in ROWS if r["kind"] == "pool"], ids=lambda r: r["name"])
def test_every_logged_pool_lies_in_the_plans_range(row):
    """The plan's uncertainty (the sum of its terms' bounds, overlay/doctor/memory/bounds.py) covers the engine's
    own figure on every profiled row, and contains the plan's point estimate."""
    from hybrid_exl3_fixes.doctor.memory import arithmetic

    shape = report.shape_of(row["config"])
    plan = arithmetic.plan(shape, row["tensors"], row["engine"], any(n.endswith(".trellis") for n in row["tensors"]))
    u, got = plan["uncertainty"], report.logged(row["text"])
    assert u["pool_bytes"][0] <= plan["available_kv_bytes"] <= u["pool_bytes"][1]
    assert u["pool_gib"][0] - 0.01 <= got["available_kv_gib"] <= u["pool_gib"][1] + 0.01, (u["pool_gib"], got)
    assert u["kv_cache_tokens"][0] <= got["kv_cache_tokens"] <= u["kv_cache_tokens"][1]


def test_tp2_adds_nccls_connection_buffers_as_a_bound_and_doctor_prints_the_range(tmp_path, capsys):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main
    from hybrid_exl3_fixes.doctor.memory import bounds

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    plans = {}
    for tp in (1, 2):
        args = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--language-model-only", "--gpu-mem", "80"]
        main([*args, "--tp", str(tp), "--gpus", str(tp)])
        plans[tp] = json.loads(capsys.readouterr().out)["plan"]
    one, two = plans[1]["uncertainty"], plans[2]["uncertainty"]
    assert "nccl_buffers" not in plans[1]["terms"] and plans[2]["terms"]["nccl_buffers"]["bytes"] == 0
    # NCCL 2.30.7 src/init.cc: LL 512 KiB + LL128 4,915,200 B + SIMPLE 4 MiB per connection
    assert bounds.NCCL_BUFFERS_PER_CONNECTION == 9_633_792
    assert two["terms"]["nccl_buffers"]["high"] == 16 * 2 * 9_633_792
    assert (
        two["pool_minus_bytes"] >= sum(t["high"] for t in two["terms"].values()) > two["terms"]["nccl_buffers"]["high"]
    )
    assert one["max_concurrency"][0] <= plans[1]["max_concurrency"] <= one["max_concurrency"][1]
    main(["doctor", str(tmp_path / "t" / "exl3"), "--language-model-only", "--gpu-mem", "80", "--tp", "2"])
    text = capsys.readouterr().out
    assert "  pool range " in text and "  capacity range " in text and "within the terms' bounds" in text


RUN20 = ROOT / "docs" / "gpu-runs" / "2026-12-03-run20"
RUN22 = ROOT / "docs" / "gpu-runs" / "2026-12-04-run22"
RUN23 = ROOT / "docs" / "gpu-runs" / "2026-12-04-run23"


@pytest.mark.parametrize("run", [RUN22, RUN23], ids=["run22", "run23"])
@pytest.mark.parametrize("variant", ["aphrodite-0.24", "aphrodite-0.24-lora", "aphrodite-0.21", "aphrodite-0.21-lora"])
def test_full_size_exl3_moe_loading_figure_counts_each_layers_scratch(variant, run):
    """The full-size 35B-A3B (40 EXL3 MoE layers of 256 experts): every layer's scratch buffers
    (arithmetic.exl3_moe_scratch, 0.55 GiB on an H200) are inside the engine's "Model loading took" figure. Against
    the four engines of runs 22 and 23 on one H200 (the logs in docs/gpu-runs/; run 23's were held out when the term
    was written), weights + LoRA buffers + load overhead + scratch is within 0.05 GiB of what each logged
    (13.94-14.0 GiB); without the scratch term the plan was 0.5 GiB under."""
    import re

    from report import read_inputs  # bench/report.py

    from hybrid_exl3_fixes.doctor import parse_config
    from hybrid_exl3_fixes.doctor.memory import arithmetic

    inputs = read_inputs(RUN20 / "inputs-qwen3.6-35b-a3b-full-3bit-exl3.json.xz")
    text = report.read_log(run / f"qwen3.6-35b-a3b-full-3bit-{variant}.log")
    logged = float(re.search(r"Model loading took ([\d.]+) GiB", text).group(1))
    shape = parse_config(inputs["config.json"])[0]
    lora = variant.endswith("-lora")
    release = "0.21.0" if "0.21" in variant else "0.24.1"
    eng = arithmetic.Engine(139.8, lora=lora, release=release, **report.COMPARE_ENGINE)
    terms = arithmetic.plan(shape, inputs["tensors"], eng, True)["terms"]
    loading = arithmetic.loading_bytes(terms)
    assert abs(loading / arithmetic.GIB - logged) < 0.05, (loading / arithmetic.GIB, logged)
    assert terms["exl3_moe_scratch"]["bytes"] / arithmetic.GIB > 0.5  # the term the earlier plan missed


def published_vision_shape():
    from hybrid_exl3_fixes.checkpoint.stream import full_spec
    from hybrid_exl3_fixes.checkpoint.tinyspec import hf_config

    return report.shape_of(hf_config(full_spec("qwen3.6-27b-full", vision="published")))


def test_the_vision_term_restates_the_profiling_runs_encoder_budget():
    """doctor/memory/vision.py: as encoder_budget.py sizes it, the profiling run encodes one image of the processor's
    largest size (16,384 tokens, 65,536 patches for the published processor) unless the batched-token budget holds more.
    """
    from hybrid_exl3_fixes.doctor.memory import arithmetic, vision

    shape = published_vision_shape()
    assert shape.vision == dict(
        patch=16, merge=2, temporal=2, channels=3, depth=27, width=1152, intermediate=4304, heads=16, deepstack=0,
        out_hidden=5120,
    )  # fmt: skip
    assert vision.image_tokens(shape.vision) == 16384 and vision.video_tokens(shape.vision) == 12288

    def items(**engine):
        return vision.profiled_items(16384, arithmetic.Engine(141, **engine))

    assert items(max_model_len=65536) == 1  # budget max(8192, 16384): one image
    assert items(max_model_len=65536, max_num_batched_tokens=40000) == 2
    assert items(max_model_len=8192, max_num_batched_tokens=40000, max_num_seqs=1) == 1  # one prompt, one image
    assert items(max_model_len=65536, max_num_batched_tokens=40000, max_num_seqs=1, image_limit=3) == 2


def test_the_vision_term_is_the_encoders_excess_over_the_text_pass():
    """The held-out deployment's engine (a 27B-shaped bfloat16 model, TP 4, three images a prompt,
    --max-num-batched-tokens 8192): the encoder's own peak over 65,536 patches is larger than the text pass's, so
    the term is the difference, where the earlier plan had only the encoder cache (84 MB)."""
    from hybrid_exl3_fixes.doctor.memory import arithmetic, vision

    shape = published_vision_shape()
    eng = arithmetic.Engine(23.5, tp=4, max_model_len=65536, max_num_seqs=8, max_num_batched_tokens=8192, image_limit=3)
    tensors = {"model.language_model.w": {"bytes": 52 << 30}, "model.visual.w": {"bytes": 830 << 20}}
    plan = arithmetic.plan(shape, tensors, eng, exl3=False)
    text_peak = plan["terms"]["activation_peak"]["bytes"]
    n, w = 65536, 1152
    vit = n * 1536 * 2 + n * w * 2 + n * 2 * max(3 * w + 8 * w // 4, 2 * w + 2 * 4304 // 4)
    assert vision.vision_encoder(shape.vision, eng, text_peak)[2]["vit_peak"] == vit
    assert plan["terms"]["vision_encoder"]["bytes"] == vit - text_peak > 16384 * 5120 * 2
    assert 0.4 < plan["terms"]["vision_encoder"]["bytes"] / arithmetic.GIB < 0.7  # 0.52 GiB
    text_only = arithmetic.plan(
        shape, tensors, arithmetic.Engine(**{**eng.__dict__, "language_model_only": True}), False
    )
    assert "vision_encoder" not in text_only["terms"]
    # images off, video on: the video's largest item (12,288 tokens) is profiled instead
    video = arithmetic.plan(shape, tensors, arithmetic.Engine(**{**eng.__dict__, "image_limit": 0}), False)
    assert 0 < video["terms"]["vision_encoder"]["bytes"] < plan["terms"]["vision_encoder"]["bytes"]


def test_doctor_reads_the_image_limit_and_the_processors_image_size(tmp_path, capsys):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    base = ["doctor", str(tmp_path / "t" / "exl3"), "--json", "--gpu-mem", "24"]
    main([*base, "--limit-mm-per-prompt", '{"image": 3}'])
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["engine"]["image_limit"] == 3 and plan["engine"]["image_tokens"] == 16384
    assert "1 image(s) x 16,384 tokens = 65,536 patches" in plan["terms"]["vision_encoder"]["formula"]
