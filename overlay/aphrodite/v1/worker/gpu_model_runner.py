"""P15: prompt logprobs are computed from the target's hidden states before a GPU drafter can overwrite them.

Why:     With speculative decoding by a drafter that runs a model on the GPU (MTP, EAGLE, a draft model), the
         runner's ``sample_tokens`` proposes the drafts *before* ``_bookkeeping_sync``, and the bookkeeping then
         computes the step's prompt logprobs from ``hidden_states`` (``_get_prompt_logprobs_dict(hidden_states[:n],
         ...)``). In the default compiled mode that tensor is the output of the target's CUDA graph, in the graph
         memory pool that every captured graph shares, and the drafter's own graph replay may reuse that memory: the
         prompt logprobs are then computed from whatever the drafter left there (NaN or values off by thousands),
         while the sampled tokens, computed before the drafter ran, are right. Same order in 0.20.0 - 0.24.1
         (``gpu_model_runner.py`` ``sample_tokens``: 0.21.0 lines 3942-3958 before 4019; 0.24.1 4367-4401 before
         4433). Reported upstream as vllm-project/vllm#53488; the symptom and its evidence on this project's
         models: docs/upstream/mtp-prompt-logprobs-graph-pool.md.
How:     Wrap ``propose_draft_token_ids``: when requests of the step want prompt logprobs and the bookkeeping has not
         computed them yet, compute them first, from the hidden states as the target left them, and keep the
         result for the step; wrap ``_get_prompt_logprobs_dict`` so that the bookkeeping's call of that step takes
         the kept result instead of computing it again (the function is not idempotent: it fills and clears each
         request's chunk buffers). Steps without prompt-logprob requests, drafters that run after the bookkeeping
         (n-gram on the CPU, ``disable_padded_drafter_batch``) and engines without speculative decoding are
         unchanged: the original functions run as they are.
Probe:   the live ``sample_tokens`` calls the GPU drafter before ``_bookkeeping_sync``, and the bookkeeping computes
         prompt logprobs from its ``hidden_states`` argument (source order; the bug lives in CUDA graph memory, so
         the behaviour is tested on the GPU: tests/gpu/test_mtp_server.py, the ``-noP15`` control cells).
Upstream: vllm-project/vllm#53520 (open); the upstream-ready diff is patches/0015-mtp-prompt-logprobs-graph-pool.patch.
Retire when: an aphrodite release computes prompt logprobs before the drafter runs (or from a copy) and is the
         oldest supported one.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from hybrid_exl3_fixes.registry import Drift, Live, Patch, Target, tag, tags_of

MODULE = "aphrodite.v1.worker.gpu_model_runner"
PROPOSE = Target(
    MODULE,
    "GPUModelRunner.propose_draft_token_ids",
    params=(
        "self",
        "scheduler_output",
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
        "spec_decode_metadata",
        "common_attn_metadata",
        "slot_mappings",
    ),
)
PROMPT_LOGPROBS = Target(
    MODULE, "GPUModelRunner._get_prompt_logprobs_dict", params=("self", "hidden_states", "num_scheduled_tokens")
)
# on each runner: (the step's num_scheduled_tokens dict, its prompt logprobs) computed before the drafter ran
KEPT = "_hybrid_exl3_fixes_prompt_logprobs"
# on each runner: the num_scheduled_tokens dict of the last step whose prompt logprobs were computed
DONE = "_hybrid_exl3_fixes_prompt_logprobs_step"
PADDED_CALL = "propose_draft_token_ids(sampled_token_ids)"  # sample_tokens' inner call on the padded-drafter path


def drafter_runs_first(sample_tokens: Any, bookkeeping: Any) -> bool:
    """True when ``sample_tokens`` calls the padded GPU drafter before ``_bookkeeping_sync`` and the bookkeeping
    computes prompt logprobs from its ``hidden_states``; False when it computes them before the drafter (or not in the
    bookkeeping). Raises Drift when the sources cannot be read or hold neither call."""
    try:
        sample, book = inspect.getsource(sample_tokens), inspect.getsource(bookkeeping)
    except (OSError, TypeError) as exc:
        raise Drift(f"the runner's sources cannot be read ({exc})") from exc
    call = re.search(r"(?<!def )" + re.escape(PADDED_CALL), sample)  # the call, not the inner function's def
    draft, bookkeep = (call.start() if call else -1), sample.find("self._bookkeeping_sync(")
    if draft < 0 or bookkeep < 0:
        raise Drift("sample_tokens no longer calls the padded drafter and _bookkeeping_sync by these names")
    early = sample.find("_get_prompt_logprobs_dict(")
    if 0 <= early < draft:
        return False
    return draft < bookkeep and re.search(r"_get_prompt_logprobs_dict\(\s*hidden_states\[", book) is not None


def probe_prompt_logprobs_after_drafter(live: dict[str, Live]) -> bool:
    """True when the drafter runs before the bookkeeping's prompt logprobs and P15's pair is not in place (after
    apply the sources are unchanged: the pair is recognised by its tag)."""
    if all("P15" in tags_of(live[t.key].raw) for t in (PROPOSE, PROMPT_LOGPROBS)):
        return False
    owner = live[PROPOSE.key].owner
    return drafter_runs_first(owner.sample_tokens, owner._bookkeeping_sync)


def guarded(original_propose, original_prompt_logprobs):
    """The pair of replacements (``propose_draft_token_ids``, ``_get_prompt_logprobs_dict``) around the originals
    given: the prompt logprobs of a step are computed once, before the drafter runs when it runs first."""

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *a, **k):
        step = scheduler_output.num_scheduled_tokens
        if getattr(self, "num_prompt_logprobs", None) and self.__dict__.get(DONE) is not step:
            total = scheduler_output.total_num_scheduled_tokens
            self.__dict__[KEPT] = (step, original_prompt_logprobs(self, hidden_states[:total], step))
            self.__dict__[DONE] = step
        return original_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *a, **k)

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        kept = self.__dict__.pop(KEPT, None)
        if kept is not None and kept[0] is num_scheduled_tokens:
            return kept[1]
        self.__dict__[DONE] = num_scheduled_tokens
        return original_prompt_logprobs(self, hidden_states, num_scheduled_tokens)

    return propose_draft_token_ids, _get_prompt_logprobs_dict


def build(live: dict[str, Live]) -> dict[str, Any]:
    propose, prompt_logprobs = live[PROPOSE.key].function, live[PROMPT_LOGPROBS.key].function
    new_propose, new_prompt_logprobs = guarded(propose, prompt_logprobs)
    return {
        PROPOSE.key: tag("P15", new_propose, propose),
        PROMPT_LOGPROBS.key: tag("P15", new_prompt_logprobs, prompt_logprobs),
    }


PATCH = Patch(
    id="P15",
    slug="mtp-prompt-logprobs-graph-pool",
    title="prompt logprobs read before the GPU drafter reuses the target's CUDA graph memory",
    upstream="https://github.com/vllm-project/vllm/pull/53520 (open)",
    fixed_in=None,
    retire_when="an aphrodite release computes prompt logprobs before the drafter runs and is the oldest supported one",
    targets=(PROPOSE, PROMPT_LOGPROBS),
    probe=probe_prompt_logprobs_after_drafter,
    build=build,
    checks_tag_after_apply=True,
    symptom="with MTP in the default compiled mode, prompt logprobs NaN (HTTP 400) or far off",
)
