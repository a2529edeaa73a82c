"""doctor: checks, memory plan formulas, exit codes (CPU, files only)."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import APHRODITE_VERSION, HAS_APHRODITE
from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
from hybrid_exl3_fixes.doctor import diagnose

QWEN36_27B_TEXT = {  # the second deployment's model, as the issue gives it
    "num_hidden_layers": 64,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_size": 5120,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    dest = tmp_path_factory.mktemp("d") / "tiny"
    write_tiny(dest, TinySpec(bits=4, codebook="mcg"))
    return dest / "exl3"


def levels(report):
    return {f.check: f.level for f in report.findings}


def test_27b_hybrid_economics(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN36_27B_TEXT})
    )
    plan = diagnose(tmp_path, check_overlay=False).plan
    assert plan["kv_bytes_per_token"] == 64 * 1024  # 16 full layers x 4 x 256 x 2 x 2 B
    # the GDN state in the activations' dtype (bfloat16) unless mamba_ssm_dtype says otherwise (run 11)
    assert plan["recurrent_state_bytes_per_sequence"] == 72 * 1024 * 1024  # 48 layers x 1.5 MiB
    assert plan["state_bytes_per_sequence"] < 75 * 1024 * 1024  # + the small conv state
    assert plan["image_tokens_per_image"] == 16384
    fp8 = diagnose(tmp_path, kv_dtype="fp8", check_overlay=False).plan
    assert fp8["kv_bytes_per_token"] == 32 * 1024
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": {**QWEN36_27B_TEXT, "mamba_ssm_dtype": "float32"},
            }
        )
    )
    fp32 = diagnose(tmp_path, check_overlay=False).plan
    assert (
        fp32["recurrent_state_bytes_per_sequence"] == 144 * 1024 * 1024 and "mamba_ssm_dtype" in fp32["state_formula"]
    )


def test_27b_on_four_24g_cards(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN36_27B_TEXT})
    )
    report = diagnose(tmp_path, gpu_mem=24, gpus=4, tp=4, max_model_len=131072, check_overlay=False)
    p = report.plan
    # a 24 GB card gets the small batch defaults; every term is in the plan with its formula
    assert (p["engine"]["max_num_batched_tokens"], p["engine"]["max_num_seqs"]) == (2048, 256)
    assert set(p["terms"]) >= {"requested", "weights", "activation_peak", "non_torch", "cudagraphs"}
    assert all(t["formula"] and t["basis"] for t in p["terms"].values())
    assert p["kv_pool_bytes"] == p["terms"]["requested"]["bytes"] - sum(
        t["bytes"] for k, t in p["terms"].items() if k != "requested"
    )
    # per rank: 4 KV heads / TP 4 = 1; the block holds a whole GDN state page
    assert p["layout"]["page_bytes_per_token"] == 2 * 1 * 256 * 2
    assert p["max_concurrency_at_context"] == min(int(p["max_concurrency"]), 256)
    assert levels(report)["processor"] == "BLOCK"  # no processor files in this folder
    assert report.exit_code == 2


def test_tiny_checkpoint_is_clean_text_only(tiny):
    report = diagnose(tiny, gpu_mem=12, tp=2, max_model_len=512, language_model_only=True, check_overlay=False)
    assert report.exit_code == 0, [f.__dict__ for f in report.findings]
    assert levels(report)["exl3"] == "OK"
    assert report.plan["exl3_weight_bytes"] > 0


def test_make_tiny_checkpoint_is_clean_with_default_options(tiny):
    # make-tiny writes the processor files the published repositories carry, so the default (vision on) passes
    report = diagnose(tiny, check_overlay=False)
    assert report.exit_code == 0 and levels(report)["processor"] == "OK", [f.__dict__ for f in report.findings]


def test_missing_processor_files_are_named(tiny, tmp_path):
    folder = tmp_path / "noproc"
    shutil.copytree(tiny, folder)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (folder / name).unlink()
    report = diagnose(folder, check_overlay=False)
    msg = next(f.message for f in report.findings if f.check == "processor")
    assert "preprocessor_config.json" in msg and "video_preprocessor_config.json" in msg and report.exit_code == 2


def test_tp_that_cuts_a_hadamard_block(tiny):
    report = diagnose(tiny, tp=4, language_model_only=True, check_overlay=False)
    assert levels(report)["tp-alignment"] == "BLOCK"
    assert "in_proj_qkv: 256 / TP 4 = 64" in next(f.message for f in report.findings if f.check == "tp-alignment")


def test_tensor_storage_mismatch_and_head_bits_trap(tiny, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(tiny, broken)
    q = json.loads((broken / "quantization_config.json").read_text())
    first = next(iter(q["tensor_storage"].values()))
    first["stored_tensors"]["model.ghost.trellis"] = {"shape": [1, 1, 64]}
    (broken / "quantization_config.json").write_text(json.dumps(q))
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"]["head_bits"] = 6
    (broken / "config.json").write_text(json.dumps(cfg))
    report = diagnose(broken, language_model_only=True, check_overlay=False)
    assert levels(report)["exl3"] == "BLOCK" and "model.ghost.trellis" in next(
        f.message for f in report.findings if f.check == "exl3"
    )
    assert levels(report)["head_bits"] == "BLOCK"


def test_no_config_and_bad_config(tmp_path):
    assert diagnose(tmp_path, check_overlay=False).exit_code == 2
    (tmp_path / "config.json").write_text("{not json")
    report = diagnose(tmp_path, check_overlay=False)
    assert (
        report.exit_code == 2 and "config.json is not valid JSON: Expecting property name" in report.findings[0].message
    )


def test_cli_json(tiny, capsys):
    from hybrid_exl3_fixes.cli import main

    code = main(["doctor", str(tiny), "--language-model-only", "--json", "--gpu-mem", "12"])
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit_code"] and out["plan"]["kv_bytes_per_token"] == 2048


@pytest.mark.parametrize(
    "checkpoint, dtype, p4, expected",
    [
        ("bfloat16", "auto", None, "OK"),  # exllamav3's output of a Qwen3.5/3.6 model: measured, serves
        ("bfloat16", "auto", "APPLIED", "OK"),
        ("float16", "auto", "APPLIED", "OK"),  # measured: P4 removes the crash
        ("float16", "auto", "UPSTREAM_FIXED", "OK"),
        ("float16", "auto", "DISABLED", "WARN"),  # measured: the crash without P4
        ("float16", "auto", None, "WARN"),  # overlay not evaluated: no claim it is fixed
        ("bfloat16", "float16", "DISABLED", "WARN"),  # measured: --dtype float16 crashes a bfloat16 checkpoint
        ("bfloat16", "half", "DRIFTED", "WARN"),
        ("float16", "bfloat16", "DISABLED", "OK"),  # measured: --dtype bfloat16 serves a float16 checkpoint
    ],
)
def test_compiled_mode_warns_only_for_float16_activations_without_p4(tiny, checkpoint, dtype, p4, expected):
    from hybrid_exl3_fixes.doctor import Report, check_compiled_mode

    config = json.loads((tiny / "config.json").read_text())
    config = {**config, "dtype": checkpoint, "text_config": {**config["text_config"], "dtype": checkpoint}}
    for enable_lora in (False, True):
        report = Report(str(tiny))
        check_compiled_mode(report, config, enable_lora, dtype, p4)
        assert levels(report) == {"compiled-mode": expected}
        msg = report.findings[0].message
        if expected == "WARN":
            assert "--dtype bfloat16" in msg and "--enforce-eager" in msg and "illegal memory access" in msg
        else:
            assert "--enforce-eager" not in msg  # no advice that costs speed
    dense = {**config, "quantization_config": None}
    quiet = Report(str(tiny))
    check_compiled_mode(quiet, dense, False, dtype, p4)
    assert quiet.findings == []  # the dense twin compiles


def test_doctor_on_a_bfloat16_checkpoint_says_ok_and_on_a_float16_one_names_the_trigger(tmp_path, capsys):
    """End to end: a make-tiny (bfloat16, as exllamav3 writes) checkpoint gets
    OK; a float16 one gets OK where P4 runs (the installed aphrodite has the bug and the overlay fixes it)
    and WARN where P4 is switched off."""
    import os

    from hybrid_exl3_fixes.cli import main

    for dtype in ("bfloat16", "float16"):
        write_tiny(tmp_path / dtype, TinySpec(dtype=dtype), dense=False)
    cases = (
        ("bfloat16", {}, "OK"),
        ("float16", {}, "OK"),
        ("float16", {"HYBRID_EXL3_FIXES_DISABLE": "P4"}, "WARN"),
        ("float16", {"APHRODITE_PLUGINS": "some_other_plugin"}, "WARN"),
    )  # the engine would not load P4
    for dtype, env, expected in cases:
        os.environ.update(env)
        try:
            import hybrid_exl3_fixes

            hybrid_exl3_fixes.undo_all()
            hybrid_exl3_fixes.REGISTRY.results.clear()
            report = diagnose(tmp_path / dtype / "exl3", language_model_only=True)
        finally:
            for key in env:
                os.environ.pop(key, None)
            hybrid_exl3_fixes.undo_all()
            hybrid_exl3_fixes.REGISTRY.results.clear()
        if "APHRODITE_PLUGINS" in env:
            assert levels(report)["overlay"] == "WARN" and "APHRODITE_PLUGINS" in report.findings[-1].message
        found = levels(report).get("compiled-mode")
        from helpers import HAS_APHRODITE

        if not HAS_APHRODITE:  # P4 NOT_APPLICABLE: float16 is warned, bfloat16 is fine
            expected = "OK" if dtype == "bfloat16" else "WARN"
        assert found == expected, (dtype, env, report.findings)
    # the CLI takes --dtype: a bfloat16 checkpoint served as float16 without P4 is warned, exit 1
    os.environ["HYBRID_EXL3_FIXES_DISABLE"] = "P4"
    try:
        capsys.readouterr()
        code = main(
            ["doctor", str(tmp_path / "bfloat16" / "exl3"), "--language-model-only", "--dtype", "float16", "--json"]
        )
    finally:
        os.environ.pop("HYBRID_EXL3_FIXES_DISABLE", None)
        hybrid_exl3_fixes.undo_all()
        hybrid_exl3_fixes.REGISTRY.results.clear()
    out = json.loads(capsys.readouterr().out)
    compiled = [f for f in out["findings"] if f["check"] == "compiled-mode"]
    assert [f["level"] for f in compiled] == ["WARN"] and "--dtype float16" in compiled[0]["message"]
    assert code == out["exit_code"] == 1


@pytest.mark.parametrize(
    "dtype, width, folder",
    [
        ("auto", 2, "exl3"),
        ("bfloat16", 2, "exl3"),
        ("float16", 2, "exl3"),
        ("half", 2, "exl3"),
        ("float32", 4, "dense"),
        ("float", 4, "dense"),
    ],
)
def test_every_dtype_choice_plans(tmp_path, capsys, dtype, width, folder):
    """Each --dtype aphrodite accepts for the checkpoint (config/model.py ModelDType; EXL3 only float16 and bfloat16)
    gives a plan: ``float`` is float32 and ``half`` float16, and the KV cache (``auto``), the conv state and the
    activations are kept in that dtype, in the plan's figures and in its printed formula alike."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec())
    args = ["doctor", str(tmp_path / "t" / folder), "--language-model-only", "--gpu-mem", "24", "--dtype", dtype]
    code = main([*args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit_code"] in (0, 1), out["findings"]
    plan = out["plan"]
    assert plan["kv_bytes_per_token"] == 1 * 2 * 256 * 2 * width  # tiny: 1 full layer, 2 KV heads of 256
    assert plan["kv_formula"].endswith(f"x {width} B")
    assert plan["layout"]["block_size"] > 0 and plan["kv_cache_tokens"] > 0
    expected = {"auto": "bfloat16", "half": "float16", "float": "float32"}.get(dtype, dtype)
    assert plan["engine"]["dtype"] == expected
    assert plan["conv_state_bytes_per_sequence"] == 3 * 1024 * 3 * width  # 3 GDN layers x 1024 channels x 3
    assert f"x {width} B" in plan["terms"]["activation_peak"]["formula"]
    main(args)
    printed = capsys.readouterr().out
    assert f"x 2 (K,V) x {width} B" in printed and "unexpected" not in printed


def test_activations_count_the_dtype_bytes(tmp_path):
    """The activation term grows with the activations' width: float32 holds more than bfloat16 on the same model."""
    from hybrid_exl3_fixes import doctor
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "t", TinySpec())
    peaks = {
        d: doctor.diagnose(tmp_path / "t" / "dense", gpu_mem=24, dtype=d, language_model_only=True).plan["terms"][
            "activation_peak"
        ]["bytes"]
        for d in ("bfloat16", "float32")
    }
    assert peaks["float32"] > peaks["bfloat16"], peaks


@pytest.mark.parametrize("dtype", ["float32", "float"])
@pytest.mark.parametrize("release", ["0.20.0", "0.21.0", "0.24.1"])
def test_exl3_in_float32_is_blocked(tmp_path, capsys, dtype, release):
    """Every release's Exl3Config.get_supported_act_dtypes is [float16, bfloat16] and the engine refuses any other at
    start-up: doctor says so as a BLOCK, prints the flag that works, and plans nothing for a start that cannot
    happen (no compiled-mode OK, no memory OK)."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    model = str(tmp_path / "t" / "exl3")
    code = main(["doctor", model, "--gpu-mem", "80", "--dtype", dtype, "--release", release, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit_code"] == 2
    blocked = [f for f in out["findings"] if f["check"] == "dtype"]
    assert [f["level"] for f in blocked] == ["BLOCK"], out["findings"]
    assert "float32" in blocked[0]["message"] and "--dtype bfloat16" in blocked[0]["message"]
    assert not [f for f in out["findings"] if f["check"] in ("compiled-mode", "memory") and f["level"] == "OK"]
    assert not out["plan"]
    main(["doctor", model, "--gpu-mem", "80", "--dtype", dtype, "--release", release])
    assert "result: blocking problems" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_APHRODITE, reason="the installed release's Exl3Config is what the table must match")
def test_the_dtype_table_is_the_installed_release_s():
    """overlay/compat.py's EXL3_ACT_DTYPES is what this lane's Exl3Config.get_supported_act_dtypes returns."""
    import torch
    from aphrodite.model_executor.layers.quantization.exl3 import Exl3Config

    from hybrid_exl3_fixes.compat import exl3_act_dtypes

    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    assert tuple(names[d] for d in Exl3Config().get_supported_act_dtypes()) == exl3_act_dtypes(APHRODITE_VERSION)


@pytest.mark.parametrize("release", ["9.9.9", "0.19.0"])
def test_a_release_outside_the_tested_ones_is_a_warning(tmp_path, capsys, release):
    """--release outside 0.20.0-0.24.1: the plan still comes, with a WARN that names the tested range."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    code = main(["doctor", str(tmp_path / "t" / "exl3"), "--gpu-mem", "24", "--release", release, "--json"])
    out = json.loads(capsys.readouterr().out)
    warned = [f for f in out["findings"] if f["check"] == "release"]
    assert [f["level"] for f in warned] == ["WARN"] and "0.20.0 - 0.24.1" in warned[0]["message"], out["findings"]
    assert code == out["exit_code"] >= 1 and out["plan"]["kv_cache_tokens"] > 0


@pytest.mark.parametrize("release", ["0.20.0", "0.24.1"])
def test_a_tested_release_is_not_warned_about(tmp_path, capsys, release):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    main(["doctor", str(tmp_path / "t" / "exl3"), "--gpu-mem", "24", "--release", release, "--json"])
    assert not [f for f in json.loads(capsys.readouterr().out)["findings"] if f["check"] == "release"]


@pytest.mark.parametrize("damage", ["truncated", "emptied", "removed"])
def test_weights_doctor_could_not_read_are_not_an_ok_plan(tmp_path, capsys, damage):
    """A shard cut short or emptied, or no shard at all: the plan with --gpu-mem counts too few weights, so its pool
    is larger than the engine's; the memory finding says so (never OK)."""
    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    model = tmp_path / "t" / "exl3"
    shard = next(model.glob("*.safetensors"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "emptied":
        shard.write_bytes(b"")
    else:
        shard.unlink()
    from hybrid_exl3_fixes.cli import main

    code = main(["doctor", str(model), "--gpu-mem", "24", "--json"])
    out = json.loads(capsys.readouterr().out)
    memory = [f for f in out["findings"] if f["check"] == "memory"]
    assert [f["level"] for f in memory] == ["WARN"], out["findings"]
    assert "weights" in memory[0]["message"] and code == out["exit_code"] >= 1


def test_the_printed_pins_parse_as_the_engine_s_flag(tmp_path, capsys):
    """Both pins doctor prints are pasted as they are: ``--kv-cache-memory-bytes N``, no thousands separators (the
    engine's flag, aphrodite engine/arg_utils.py, takes an integer); where aphrodite is installed, its own parser
    takes them."""
    import re

    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
    from hybrid_exl3_fixes.cli import main

    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    main(["doctor", str(tmp_path / "t" / "exl3"), "--gpu-mem", "24"])
    printed = capsys.readouterr().out
    pins = re.findall(r"^  pin .*?(--kv-cache-memory\S*) (\S+)", printed, re.M)
    assert len(pins) == 2, printed
    for flag, value in pins:
        assert flag == "--kv-cache-memory-bytes" and value.isdigit(), (flag, value)
    if HAS_APHRODITE:
        # the flag's own converter, as EngineArgs.add_cli_args registers it (the whole parser infers a device)
        import argparse

        from aphrodite.config import CacheConfig
        from aphrodite.engine.arg_utils import get_kwargs

        parse = get_kwargs(CacheConfig)["kv_cache_memory_bytes"]["type"]
        for _, value in pins:
            assert parse(value) == int(value)
        with pytest.raises(argparse.ArgumentTypeError):
            parse(f"{int(pins[0][1]):,}")  # the form doctor printed before: the engine refuses it


def test_every_flag_has_help():
    """doctor --help and make-tiny --help describe what they do and every argument (argparse prints nothing for an
    argument without help, and a metavar made from its dest)."""
    import argparse

    from hybrid_exl3_fixes import cli

    parser = cli.build_parser()
    assert "``" not in parser.description
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("doctor", "make-tiny"):
        sub = subparsers.choices[name]
        assert sub.description, name
        missing = [a.dest for a in sub._actions if not isinstance(a, argparse._HelpAction) and not a.help]
        assert missing == [], (name, missing)
        assert "_GIVEN" not in sub.format_help(), name


def test_status_lists_patches_by_number():
    """status prints P1 .. P16 in number order, though the registry applies P9 before P7 (P7 wraps it)."""
    import hybrid_exl3_fixes as overlay
    from hybrid_exl3_fixes.registry import patch_number

    ids = [p.id for p in overlay.PATCHES]
    assert ids.index("P9") < ids.index("P7")  # the apply order (Patch.after)
    expected = [
        "P1",
        "P2",
        "P2b",
        "P3",
        "P4",
        "P5",
        "P6",
        "P7",
        "P8",
        "P9",
        "P10",
        "P11",
        "P12",
        "P13",
        "P14",
        "P15",
        "P16",
    ]
    assert sorted(ids, key=patch_number) == expected


def test_one_options_object_and_the_command_line_agree(tiny):
    """diagnose takes one Options (or its fields as keywords, the same thing); the command line's defaults are
    Options' defaults, so `doctor DIR` and diagnose(DIR) plan the same engine."""
    import dataclasses

    from hybrid_exl3_fixes.cli import build_parser
    from hybrid_exl3_fixes.doctor import Options

    by_object = diagnose(tiny, Options(gpu_mem=24, tp=2, check_overlay=False))
    by_keywords = diagnose(tiny, gpu_mem=24, tp=2, check_overlay=False)
    assert by_object.plan == by_keywords.plan and by_object.exit_code == by_keywords.exit_code
    args = build_parser().parse_args(["doctor", str(tiny)])
    cli_names = {"gpu_memory_utilization": "utilization", "enable_prefix_caching": "prefix_caching"}
    defaults = {cli_names.get(k, k): v for k, v in vars(args).items()}
    for f in dataclasses.fields(Options):
        if f.name not in ("check_overlay", "image_limit"):  # image_limit: --limit-mm-per-prompt's image count
            assert defaults[f.name] == f.default, f.name
    assert args.limit_mm_per_prompt is None and Options.image_limit == 999  # aphrodite's count for an unset modality


READ_ONLY = """
import json, sys
from hybrid_exl3_fixes.doctor import diagnose
import hybrid_exl3_fixes as overlay
report = diagnose(sys.argv[1], language_model_only=True)
print(json.dumps({"aphrodite": "aphrodite" in sys.modules, "torch": "torch" in sys.modules,
                  "results": len(overlay.REGISTRY.results), "overlay": [f.message for f in report.findings
                  if f.check == "overlay"]}))
"""


def test_doctor_patches_nothing_in_its_own_process(tiny):
    """The overlay's table comes from a fresh `status --json` process: doctor's own process imports neither
    aphrodite nor torch and applies no patch, and still reports what the engine's processes will do."""
    import subprocess
    import sys

    from helpers import HAS_APHRODITE, aphrodite_site, subprocess_env

    proc = subprocess.run(
        [sys.executable, "-c", READ_ONLY, str(tiny)],
        env=subprocess_env(aphrodite_site() if HAS_APHRODITE else None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["aphrodite"] is False and out["torch"] is False and out["results"] == 0, out
    assert out["overlay"] and "hybrid-exl3-fixes: applied=" in out["overlay"][0], out


def test_p12s_kept_weights_are_planned_when_opted_in(tiny, monkeypatch):
    """HYBRID_EXL3_FIXES_EXL3_KEEP (P12's opt-in) adds the float16 copies of the EXL3 linear layers to the plan,
    inside "Model loading took", up to the budget; a bad value is a WARN and plans nothing."""
    from hybrid_exl3_fixes.decisions import p12_mid_batch as midbatch
    from hybrid_exl3_fixes.doctor.memory import arithmetic

    base = diagnose(tiny, gpu_mem=24, check_overlay=False)
    assert "exl3_kept_weights" not in base.plan["terms"]
    monkeypatch.setenv(midbatch.KEEP_ENV, "all")
    kept = diagnose(tiny, gpu_mem=24, check_overlay=False)
    term = kept.plan["terms"]["exl3_kept_weights"]
    named = kept_tensors(tiny).items()
    trellis = [t for n, t in named if n.endswith(".trellis") and ".experts." not in n and not n.startswith("mtp.")]
    assert trellis and term["bytes"] == sum(2 * t["shape"][0] * 16 * t["shape"][1] * 16 for t in trellis)
    assert kept.plan["kv_pool_bytes"] == base.plan["kv_pool_bytes"] - term["bytes"]
    assert "exl3_kept_weights" in arithmetic.LOADING_TERMS and levels(kept)["exl3-keep"] == "OK"
    assert kept.plan["uncertainty"]["terms"]["exl3_kept_weights"]["low"] == term["bytes"]  # maybe none is kept
    monkeypatch.setenv(midbatch.KEEP_ENV, "0.001")
    assert diagnose(tiny, gpu_mem=24, check_overlay=False).plan["terms"]["exl3_kept_weights"]["bytes"] <= 2**30 // 1000
    monkeypatch.setenv(midbatch.KEEP_ENV, "lots")
    bad = diagnose(tiny, gpu_mem=24, check_overlay=False)
    assert levels(bad)["exl3-keep"] == "WARN" and "exl3_kept_weights" not in bad.plan["terms"]


def kept_tensors(folder):
    from hybrid_exl3_fixes.doctor.base import Report
    from hybrid_exl3_fixes.doctor.files import read_weights

    return read_weights(Report(str(folder)), folder)
