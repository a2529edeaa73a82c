"""P11 (the LoRA logits-processor wrapper for an EXL3 lm_head) against the real aphrodite-engine modules of the
lane's release (CPU).

Every release's ``from_layer_logits_processor`` reads ``lm_head.weight``; an EXL3 head (``head_bits``: every
exllamav3 conversion) has none. 0.24+ wrap Qwen3.5/3.6's ``lm_head`` whenever LoRA is on, so there the engine
stops at start-up (docs/upstream/lora-exl3-lm-head.md). The real ParallelLMHead, Exl3LinearMethod, LogitsProcessor,
LoRAConfig and the TP group of one (gloo, in tests/unit/p11_worker.py's own process); the head's EXL3 tensors are
a random codec linear, loaded through aphrodite's own weight loader."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import APHRODITE_VERSION, needs_aphrodite, subprocess_env

pytestmark = needs_aphrodite

WORKER = Path(__file__).with_name("p11_worker.py")
MODULE = "hybrid_exl3_fixes.aphrodite.lora.utils"


@pytest.fixture(scope="module")
def built():
    """The worker's report: the wrapper built without and with the overlay, for an EXL3 and a plain head."""
    import aphrodite

    site = Path(aphrodite.__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(WORKER)], env=subprocess_env(site), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_release_stops_on_an_exl3_head(built):
    assert built["release_exl3"] == {"error": "AttributeError: 'ParallelLMHead' object has no attribute 'weight'"}


def test_with_the_overlay_the_wrapper_is_built_for_an_exl3_head(built):
    assert built["status"] == "APPLIED"
    wrapper = built["overlay_exl3"]
    assert wrapper["type"] == "LogitsProcessorWithLoRA", wrapper
    # max_loras 2, rank 8, hidden 128, vocab 256: the stacks the manager loads adapters into
    assert wrapper["lora_a"] == [2, 1, 8, 128] and wrapper["lora_b"] == [2, 1, 256, 8]
    # the LoRA dtype, on the device of the head's EXL3 tensors; the wrapper does not hold the head
    assert wrapper["dtype"] == wrapper["lora_dtype"] == "torch.bfloat16"
    assert wrapper["device"] == "cpu" and wrapper["keeps_head"] is False


def test_a_head_with_a_weight_goes_to_the_original_unchanged(built):
    assert built["release_plain"]["type"] == "LogitsProcessorWithLoRA"
    assert built["overlay_plain"] == built["release_plain"]


def test_the_probe_finds_its_own_fix_and_undo_restores(overlay):
    from aphrodite.lora import model_manager, utils

    original = utils.from_layer_logits_processor
    assert model_manager.from_layer_logits_processor is original
    p11 = importlib.import_module(MODULE)
    live = {t.key: overlay.REGISTRY._resolve(t) for t in p11.PATCH.targets}
    assert p11.PATCH.probe(live) is True
    result = {r.patch.id: r for r in overlay.apply_all()}["P11"]
    assert result.status.value == "APPLIED", result.reason
    assert model_manager.from_layer_logits_processor is utils.from_layer_logits_processor is not original
    live = {t.key: overlay.REGISTRY._resolve(t) for t in p11.PATCH.targets}
    assert p11.PATCH.probe(live) is False
    overlay.undo_all()
    assert model_manager.from_layer_logits_processor is utils.from_layer_logits_processor is original


def test_the_stand_in_weight_holds_no_memory():
    import torch

    from hybrid_exl3_fixes.shared import fake_exl3_layer

    p11 = importlib.import_module(MODULE)
    head = p11.fake_exl3_head()
    weight = p11.weight_stand_in(head, type("Config", (), {"lora_dtype": torch.bfloat16})())
    assert weight.shape == (64, 16) and weight.dtype == torch.bfloat16 and weight.stride() == (0, 0)
    assert p11.has_no_weight(head) and not p11.has_no_weight(torch.nn.Linear(2, 2))
    assert p11.weight_stand_in(fake_exl3_layer(), object()).dtype == torch.float16  # lora_dtype still "auto"


def test_qwen3_5_reaches_it_from_0_24():
    """Why 0.24+ is where users meet it: the Qwen3.5/3.6 model class lists lm_head among its LoRA embedding
    modules, so the manager wraps the head whatever the adapter targets. Read from the release's source (importing
    the model module needs packages the CPU suite does not install)."""
    import ast
    import importlib.util

    tree = ast.parse(
        Path(importlib.util.find_spec("aphrodite").origin)
        .with_name("model_executor")
        .joinpath("models", "qwen3_5.py")
        .read_text()
    )
    listed = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.Assign)
        and any(getattr(t, "id", None) == "embedding_modules" for t in item.targets)
        and "lm_head" in ast.literal_eval(item.value)
    ]
    if APHRODITE_VERSION.startswith("0.24"):
        assert listed == ["Qwen3_5ForCausalLMBase"], listed  # Qwen3_5ForCausalLM and the MoE class inherit it
    else:
        assert not listed, listed
