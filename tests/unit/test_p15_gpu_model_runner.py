"""P15 (prompt logprobs computed before a GPU drafter runs) against the real aphrodite-engine runner of the lane's
release (CPU).

On every release 0.20.0 - 0.24.1 ``sample_tokens`` runs the padded GPU drafter (MTP, EAGLE) before
``_bookkeeping_sync``, which computes the step's prompt logprobs from ``hidden_states``; in the default compiled mode
that tensor lives in the CUDA graph pool the drafter's graphs reuse (docs/upstream/mtp-prompt-logprobs-graph-pool.md).
The step here runs the live runner methods in that order on a stand-in runner (``object.__new__``, fake inputs: one
request wanting prompt logprobs, an lm head of 8 tokens, a ``_sync_device`` that does nothing on a CPU); the
drafter's graph replay is played by overwriting the hidden states after the live ``propose_draft_token_ids`` was
called (its original then stops at the stand-in's missing drafter, after P15 has done its part)."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import needs_aphrodite

pytestmark = needs_aphrodite


@pytest.fixture(autouse=True)
def no_pinned_memory(monkeypatch):
    """0.22+ copy the prompt's ids with ``async_tensor_h2d``, which pins host memory when ``PIN_MEMORY``; on a host
    without an accelerator aphrodite's UnspecifiedPlatform still answers True and pinning raises. The value a
    CPU-only host should have (CpuPlatform's) is False, in every module holding a copy."""
    import sys

    import aphrodite.v1.outputs  # noqa: F401 - holds a copy of the constant
    import aphrodite.v1.worker.gpu_model_runner  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("aphrodite.") and getattr(module, "PIN_MEMORY", None) is True:
            monkeypatch.setattr(module, "PIN_MEMORY", False)


PROMPT = [3, 1, 4, 1, 5, 7]
VOCAB, HIDDEN = 8, 4


def runner_class():
    from aphrodite.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def stand_in_runner():
    """A runner with what ``_get_prompt_logprobs_dict`` reads for one request ``r`` in its first prefill chunk."""
    import numpy as np
    from aphrodite.v1.sample.sampler import Sampler

    runner = object.__new__(runner_class())
    head = torch.linspace(-1, 1, VOCAB * HIDDEN).reshape(VOCAB, HIDDEN)
    request = types.SimpleNamespace(prompt_token_ids=list(PROMPT), num_computed_tokens=0)
    request.in_progress_prompt_logprobs_cpu = None  # 0.24: on the request
    runner.__dict__.update(
        num_prompt_logprobs={"r": 2},
        requests={"r": request},
        input_batch=types.SimpleNamespace(req_id_to_index={"r": 0}, in_progress_prompt_logprobs_cpu={}),
        query_start_loc=types.SimpleNamespace(np=np.array([0, len(PROMPT)])),
        model=types.SimpleNamespace(compute_logits=lambda h: h @ head.t()),
        sampler=Sampler(),
        model_config=types.SimpleNamespace(logprobs_mode="raw_logprobs"),
        device=torch.device("cpu"),
        _sync_device=lambda: None,  # torch.accelerator.synchronize() has no device to wait for here
    )
    return runner


def target_hidden_states() -> torch.Tensor:
    """The target's last hidden states for the prompt's positions (fake input)."""
    return torch.arange(len(PROMPT) * HIDDEN, dtype=torch.float32).reshape(len(PROMPT), HIDDEN) / 10


def one_step(runner) -> torch.Tensor:
    """``sample_tokens``' order for one prefill step: the drafter, then the bookkeeping's prompt logprobs; returns
    the logprobs of the prompt's next tokens as the bookkeeping produced them."""
    hidden = target_hidden_states()
    step = types.SimpleNamespace(num_scheduled_tokens={"r": len(PROMPT)}, total_num_scheduled_tokens=len(PROMPT))
    with pytest.raises(AttributeError):  # the original proposer needs a drafter the stand-in lacks
        runner.propose_draft_token_ids(step, None, None, hidden, None, None, None, None, None)
    hidden.fill_(float("nan"))  # the drafter's graph replay reuses the memory of the target's output
    out = runner._get_prompt_logprobs_dict(hidden[: len(PROMPT)], step.num_scheduled_tokens)
    return out["r"].logprobs


def expected() -> torch.Tensor:
    runner = stand_in_runner()
    hidden = target_hidden_states()
    return runner._get_prompt_logprobs_dict(hidden, {"r": len(PROMPT)})["r"].logprobs


def test_the_release_runs_the_drafter_before_the_prompt_logprobs(overlay):
    from hybrid_exl3_fixes.aphrodite.v1.worker.gpu_model_runner import PATCH

    assert PATCH.probe({t.key: overlay.REGISTRY._resolve(t) for t in PATCH.targets}) is True
    assert {r.patch.id: r.status.value for r in overlay.apply_all()}["P15"] == "APPLIED"


def test_prompt_logprobs_survive_the_drafter(overlay):
    """Unpatched, the bookkeeping reads what the drafter left (NaN here; a server answers such a request with HTTP 400
    "Out of range float values are not JSON compliant: nan"); with P15 it returns what the target computed."""
    assert torch.isnan(one_step(stand_in_runner())).all()
    overlay.apply_all()
    got = one_step(stand_in_runner())
    assert torch.equal(got, expected()), (got, expected())


def test_a_step_without_prompt_logprobs_is_left_alone(overlay):
    overlay.apply_all()
    runner = stand_in_runner()
    runner.__dict__["num_prompt_logprobs"] = {}
    step = types.SimpleNamespace(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1)
    with pytest.raises(AttributeError):
        runner.propose_draft_token_ids(step, None, None, torch.zeros(1, HIDDEN), None, None, None, None, None)
    assert runner._get_prompt_logprobs_dict(torch.zeros(1, HIDDEN), step.num_scheduled_tokens) == {}
    assert "_hybrid_exl3_fixes_prompt_logprobs" not in runner.__dict__


def test_bookkeeping_first_computes_once(overlay):
    """A drafter that runs after the bookkeeping (n-gram, ``disable_padded_drafter_batch``): the bookkeeping's call
    computes, and the drafter's call does not compute again (the function fills and clears chunk state)."""
    overlay.apply_all()
    runner = stand_in_runner()
    hidden = target_hidden_states()
    step = types.SimpleNamespace(num_scheduled_tokens={"r": len(PROMPT)}, total_num_scheduled_tokens=len(PROMPT))
    first = runner._get_prompt_logprobs_dict(hidden, step.num_scheduled_tokens)
    assert torch.equal(first["r"].logprobs, expected())
    assert runner.num_prompt_logprobs == {}  # the request left the dict: a second computation would find nothing
    runner.__dict__["num_prompt_logprobs"] = {"r": 2}  # as if it had not: P15 must still not compute again
    with pytest.raises(AttributeError):
        runner.propose_draft_token_ids(step, None, None, hidden, None, None, None, None, None)
    assert "_hybrid_exl3_fixes_prompt_logprobs" not in runner.__dict__


def test_the_upstream_diff_computes_them_first(aphrodite_copy):
    """patches/0015 on the lane's 0.24.1 sources: the probe then finds nothing to fix (UPSTREAM_FIXED)."""
    import subprocess

    from helpers import APHRODITE_VERSION, ROOT, subprocess_env

    if APHRODITE_VERSION != "0.24.1":
        pytest.skip(f"0015 applies to 0.24.1; this lane has {APHRODITE_VERSION}")
    patch = ROOT / "patches" / "0015-mtp-prompt-logprobs-graph-pool.patch"
    applied = subprocess.run(["git", "apply", str(patch)], cwd=aphrodite_copy, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    probe = (
        "from aphrodite.v1.worker.gpu_model_runner import GPUModelRunner as R; "
        "from hybrid_exl3_fixes.aphrodite.v1.worker.gpu_model_runner import drafter_runs_first as f; "
        "print(f(R.sample_tokens, R._bookkeeping_sync))"
    )
    import sys

    out = subprocess.run(
        [sys.executable, "-c", probe], env=subprocess_env(aphrodite_copy), capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
