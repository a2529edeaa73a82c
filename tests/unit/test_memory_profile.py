"""overlay/doctor/memory/profile.py: the profiling run's and the model runner's terms per release, as read from
aphrodite's sources (0.20.0-0.24.1 in .cache/aphrodite) and measured in run 29 (bench/results/memory_plan.md)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from helpers import ROOT
from hybrid_exl3_fixes.doctor.memory import arithmetic, profile

sys.path.insert(0, str(ROOT / "bench"))
import memory_plan_report as report  # noqa: E402

RUN29 = ROOT / "docs/gpu-runs/2026-12-06-run29/cal"
V21, V23, V24 = (0, 21, 0), (0, 23, 0), (0, 24, 1)


def test_a_float_tensor_loads_in_the_models_dtype_and_an_exl3_part_as_stored():
    """run 29's bfloat16 row served a float32-stored checkpoint: the engine logged 3.48 GiB of weights, half the
    stored 6.92 GiB (--dtype auto turns a float32 config into bfloat16)."""
    f32 = {"dtype": "F32", "shape": [8, 4], "bytes": 128}
    assert profile.loaded_bytes("model.embed_tokens.weight", f32, 2) == 64
    assert profile.loaded_bytes("model.norm.weight", {"dtype": "BF16", "shape": [8], "bytes": 16}, 4) == 32
    assert profile.loaded_bytes("x.trellis", {"dtype": "I16", "shape": [1, 1, 16], "bytes": 32}, 2) == 32
    assert profile.loaded_bytes("x.suh", {"dtype": "F16", "shape": [128], "bytes": 256}, 4) == 256


def test_the_exl3_head_reconstructs_per_release_and_mode():
    """0.20.0-0.23.0: more than 32 rows reconstruct the whole head; 0.24.1: more than 144 rows, in slices of
    32,768 columns (the eager engine's measured peak), the compiled engine's measured peak the whole head's."""
    whole = 4096 * 248320 * 2
    assert profile.head_reconstruct(256, 4096, 248320, V21, eager=True)[0] == whole
    assert profile.head_reconstruct(33, 4096, 248320, V23, eager=False)[0] == whole
    assert profile.head_reconstruct(144, 4096, 248320, V24, eager=True)[0] == 0
    assert profile.head_reconstruct(256, 4096, 248320, V24, eager=True)[0] == 4096 * 32768 * 2
    assert profile.head_reconstruct(256, 4096, 248320, V24, eager=False)[0] == whole


def test_model_runner_v2s_row_buffers_count_from_0_24_1():
    shape = SimpleNamespace(vocab=248320)
    eng = arithmetic.Engine(24, max_model_len=32768, release="0.24.1")
    got, formula = profile.runner_buffers(shape, eng)
    assert got == 256 * (248320 * 4 + 7760 * 4 + 32768 * 4) and "Model Runner V2" in formula
    assert profile.runner_buffers(shape, arithmetic.Engine(24, max_model_len=32768, release="0.23.0"))[0] == 0


def test_the_eager_9b_on_0_24_1_plans_the_sliced_head():
    """The eager 9B row of run 29 (torch peak 0.44 GiB logged): the plan's peak within 0.1 GiB of it, where the
    whole head (0.21.0's rule) would plan 2.03 GiB."""
    row = next(r for r in report.cal_rows(RUN29, "0.24.1", {"9b-24g-eager"}))
    shape, exl3 = report.shape_of(row["config"]), True
    eager = arithmetic.plan(shape, row["tensors"], row["engine"], exl3)["terms"]["activation_peak"]["gib"]
    logged = json.loads((RUN29 / "9b-24g-eager.json").read_text())["logged"]["torch_peak_gib"]
    assert abs(eager - logged) < 0.1, (eager, logged)
    row["engine"].release = "0.23.0"
    assert arithmetic.plan(shape, row["tensors"], row["engine"], exl3)["terms"]["activation_peak"]["gib"] > 1.9
