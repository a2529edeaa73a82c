"""GPU suite (marker cuda): the tiny EXL3 hybrid checkpoints in a real aphrodite engine.

Skips with a reason on a machine without CUDA or without loadable aphrodite kernels. Results
(measured differences, outcomes) are collected into $HXF_GPU_RESULTS (JSON) for ci/gpu.sh's
summary (the run's record under docs/gpu-runs/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import RESULTS


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (run make test-gpu on a GPU host)"
    # the compiled kernels: aphrodite._C up to 0.21, aphrodite._C_stable_libtorch from 0.22 (the 0.24.1 wheel has
    # no _C; run 14 skipped every 0.24.1 cell here on "No module named 'aphrodite._C'")
    import importlib

    errors = []
    for name in ("aphrodite._C", "aphrodite._C_stable_libtorch"):
        try:
            importlib.import_module(name)
            return None
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{name}: {exc}")
    return f"aphrodite's compiled kernels do not load here ({'; '.join(errors)})"


def pytest_collection_modifyitems(config, items):
    reason = _cuda_reason()
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.cuda)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def save_results() -> None:
    path = os.environ.get("HXF_GPU_RESULTS")
    if path and RESULTS:
        Path(path).write_text(json.dumps(RESULTS, indent=2, default=str))


def pytest_sessionfinish(session, exitstatus):
    save_results()


@pytest.fixture(scope="session")
def record():
    """record(name, **values): kept in RESULTS and written out at once, so a run stopped by the
    device call's time limit still leaves every measurement made so far."""

    def put(name, **values):
        RESULTS.setdefault(name, {}).update(values)
        save_results()

    return put


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    root = os.environ.get("HXF_GPU_WORK")
    return Path(root) if root else tmp_path_factory.mktemp("gpu")


@pytest.fixture(scope="session")
def tiny(workdir):
    """The default tiny checkpoint set: 4 bits, mcg, two adapters."""
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    dest = workdir / "tiny-mcg-4"
    if not (dest / "manifest.json").exists():
        write_tiny(dest, TinySpec(bits=4, codebook="mcg", seed=0))
    return dest


PROMPTS = [
    "The hybrid model reads three linear layers for every full one.",
    "EXL3 trellis codes: small, fast, exact enough?",
    "LoRA adapters ride on top of quantized projections.",
]


@pytest.fixture(scope="session")
def prompt_ids(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "dense")
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="session")
def reference(tiny, prompt_ids):
    """HF transformers (+ PEFT) log-probabilities on the dense twin, float32 on the GPU:
    {adapter name or None: [per prompt: tensor (len, vocab)]}."""
    import torch
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    out = {}
    for adapter in (None, "lora-a", "lora-b"):
        model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny / "dense", dtype=torch.float32).cuda().eval()
        if adapter:
            model = PeftModel.from_pretrained(model, tiny / adapter).eval()
        with torch.no_grad():
            out[adapter] = [
                model(input_ids=torch.tensor([ids]).cuda()).logits[0].float().log_softmax(-1).cpu()
                for ids in prompt_ids
            ]
        del model
        torch.cuda.empty_cache()
    return out
