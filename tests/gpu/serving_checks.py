"""What every server suite shares (test_server.py, test_moe_server.py, test_mtp_server.py): the flags each suite
server starts with, the fleet started at once, the openai clients, the prompts, and the served answers checked
against HF transformers + PEFT (``harness.Reference``) alone and mixed. test_server.py's docstring says why each
shared flag differs from the engine's default."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from harness import Reference, compare_served, served_completion
from hybrid_exl3_fixes.checkpoint.tinyspec import GDN_GATE_TARGETS
from server import Server

START_TIMEOUT = float(os.environ.get("HXF_SERVER_START_TIMEOUT", "1500"))
MAX_MODEL_LEN = 2048
# the cell runs with the engine's defaults: no --gdn-prefill-backend triton, no --language-model-only
ENGINE_DEFAULTS = "<engine defaults>"

# max |d logprob| against HF + PEFT, every cell (at most 0.044 in any cell of runs 10 and 17, fp8 KV included:
# docs/gpu-runs/2026-12-01-run10 and 2026-12-02-run17)
TOLERANCE = 0.15
# how far the served lora-ab is from a reference without its in_proj_a / in_proj_b deltas
GATES_OFF = "lora-ab vs reference without in_proj_a/b"


def shared_args(served: str, deviations: bool = True) -> list[str]:
    """What every suite server is started with (test_server.py's docstring says why each differs from the default);
    ``deviations=False`` leaves out --gdn-prefill-backend triton and --language-model-only."""
    if not deviations:
        return shared_args(served)[:-3]
    return [
        "--served-model-name",
        served,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--gpu-memory-utilization",
        "0.03",
        "--kv-cache-memory-bytes",
        str(2 << 30),
        "--gdn-prefill-backend",
        "triton",
        "--language-model-only",
    ]


def lora_args(folder: Path, adapters) -> list[str]:
    return ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "4"] + [
        "--lora-modules",
        *(f"{name}={folder / name}" for name in adapters),
    ]


def start_fleet(cells, build, base_port: int, workdir: Path) -> dict[str, Server]:
    """One server per cell (``build(cell)`` -> model, args, env), all started at once; HXF_SERVER_CELLS
    narrows them. Each has a compile cache of its own: servers that start together must not write one
    cache entry at once."""
    only = [c for c in os.environ.get("HXF_SERVER_CELLS", "").split(",") if c]
    servers = {}
    for i, cell in enumerate(cells):
        if only and cell not in only:
            continue
        model, args, env = build(cell)
        env = {"APHRODITE_CACHE_ROOT": str(workdir / "aphrodite-cache" / cell), **env}
        servers[cell] = Server(cell, model, args, base_port + i, workdir / f"server-{cell}.log", env)
        servers[cell].start()
    return servers


def ready(fleet, cell) -> Server:
    if cell not in fleet:
        pytest.skip(f"{cell} not selected (HXF_SERVER_CELLS)")
    server = fleet[cell]
    if not server.wait_ready(START_TIMEOUT):
        raise AssertionError(f"{cell} did not start: {server.root_error() or 'no error line'}\n{server.text()[-3000:]}")
    return server


def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def aclient(server: Server):
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def prompts(n: int, seed: int, low: int = 12, high: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 500) for _ in range(rng.randrange(low, high))] for _ in range(n)]


COMPLETION_EXTRA = {"return_token_ids": True, "return_tokens_as_token_ids": True}


def complete(server: Server, model: str, ids: list[int], max_tokens: int = 8, prompt_logprobs: bool = True) -> dict:
    extra = dict(COMPLETION_EXTRA, **({"prompt_logprobs": 5} if prompt_logprobs else {}))
    resp = client(server).completions.create(
        model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0, logprobs=5, extra_body=extra
    )
    return served_completion(resp.model_dump()["choices"][0])


def check(reference: Reference, adapter: str | None, served: dict) -> dict:
    return compare_served(
        reference, adapter, served["prompt_ids"], served["ids"], served["generated"], served["prompt"]
    )


def worst(rows: list[dict]) -> dict:
    return {
        "max_abs_dlogprob": round(max(r["max_abs_dlogprob"] for r in rows), 4),
        "prompt_max": round(max(r.get("prompt_max", 0.0) for r in rows), 4),
        "generated_max": round(max(r.get("generated_max", 0.0) for r in rows), 4),
        "requests": len(rows),
        "prompt_positions": sum(r["prompt_positions"] for r in rows),
        "generated_positions": sum(r["generated_positions"] for r in rows),
    }


def worst_by_model(pairs) -> dict[str, float]:
    """Each model's worst max |d logprob| among (model or None for the base, ``check`` row) pairs."""
    out: dict[str, float] = {}
    for model, row in pairs:
        out[model or "base"] = round(max(out.get(model or "base", 0.0), row["max_abs_dlogprob"]), 4)
    return out


def answers_dump(pairs) -> list[dict]:
    """(model or None, served answer or the exception it raised) pairs as JSON-ready rows."""
    return [
        {"model": m or "base", **r} if not isinstance(r, Exception) else {"model": m or "base", "error": repr(r)}
        for m, r in pairs
    ]


async def gather_completions(
    server: Server, jobs: list[tuple[str, list[int]]], max_tokens: int, prompt_logprobs: bool
) -> list:
    """Submit every job at once; each result is the parsed choice or the exception it raised."""
    api = aclient(server)
    extra = dict(COMPLETION_EXTRA, **({"prompt_logprobs": 5} if prompt_logprobs else {}))

    async def one(model, ids):
        resp = await api.completions.create(
            model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0, logprobs=5, extra_body=extra
        )
        return served_completion(resp.model_dump()["choices"][0])

    try:
        return await asyncio.gather(*(one(m, ids) for m, ids in jobs), return_exceptions=True)
    finally:
        await api.close()


def alone_and_mixed(
    server: Server, reference, adapters: list, served: str, info: dict, save, keep: dict | None = None
) -> list[str]:
    """Each model (None: the base) alone on three prompts, then 16 requests mixing them at once, against
    ``reference``; fills ``info`` (``save()`` after each step, so a failure later keeps what was measured)
    with the worst |delta| per step, the overall max, and how far the first adapter is from the base
    model's reference. Returns the requests that failed; ``keep`` (a dict) receives the 16 mixed answers as
    (model, answer) pairs under "16 mixed"."""
    name = {None: served}
    rows, answers = {}, {}
    for adapter in adapters:
        answers[adapter] = [complete(server, name.get(adapter, adapter), ids) for ids in prompts(3, 1)]
        rows[adapter] = [check(reference, adapter, served) for served in answers[adapter]]
        info[f"alone {adapter or 'base'}"] = worst(rows[adapter])
        save()
    mix = [adapters[i % len(adapters)] for i in range(16)]
    jobs = [(name.get(a, a), ids) for a, ids in zip(mix, prompts(16, 2))]
    results = asyncio.run(gather_completions(server, jobs, 8, True))
    failed = [repr(r) for r in results if isinstance(r, Exception)]
    if keep is not None:
        keep["16 mixed"] = list(zip(mix, results))
    mixed = [check(reference, a, r) for a, r in zip(mix, results) if not isinstance(r, Exception)]
    info["16 mixed"] = (
        {**worst(mixed), "failed": len(failed)} if mixed else {"failed": len(failed), "first": failed[:1]}
    )
    # each model's worst among the 16, so that a wrong one is named
    info["16 mixed"]["by model"] = worst_by_model(
        zip([a for a, r in zip(mix, results) if not isinstance(r, Exception)], mixed)
    )
    info["max_abs_dlogprob"] = round(max(r["max_abs_dlogprob"] for r in [*mixed, *sum(rows.values(), [])]), 4)
    info["tolerance"] = TOLERANCE
    first = next((a for a in adapters if a is not None), None)
    if first:  # each adapter must differ from the base model by much more than the tolerance
        base = check(reference, None, complete(server, first, prompts(1, 1)[0]))
        info[f"{first} vs base reference"] = round(base["max_abs_dlogprob"], 4)
    if "lora-ab" in adapters:  # and its in_proj_a / in_proj_b deltas must be applied, not dropped:
        # the same three served answers, against a reference without those deltas
        with reference.dropping(GDN_GATE_TARGETS):
            off = [check(reference, "lora-ab", served) for served in answers["lora-ab"]]
        info[GATES_OFF] = worst(off)["max_abs_dlogprob"]
    save()
    return failed
