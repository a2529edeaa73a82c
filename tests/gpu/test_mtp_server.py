"""MTP speculative decoding on EXL3 hybrids through the real `aphrodite run`, reached over HTTP with the openai client.

Checkpoints as make-tiny writes them in the published configs' form (bfloat16 config, ``mamba_ssm_dtype: float32``,
``mtp_num_hidden_layers: 1``, the MTP head in EXL3 at ``mtp_bits`` 4 as exllamav3 quantizes it, the tiny vision
tower): the dense ``tiny`` (the server suite's), the MoE ``tiny-moe`` (the MoE suite's), and ``accept70`` /
``accept40``, dense checkpoints whose MTP head agrees with the model's greedy continuation at 0.7 / 0.4
(make-tiny ``--mtp-acceptance``, checkpoint/mtpaccept.py).

Every cell starts with the engine's defaults (default compiled mode, default attention and GDN prefill backends,
the vision tower loaded) but for what lets twenty servers share one GPU at once: a pinned 2 GiB KV pool
(``--kv-cache-memory-bytes``, so that no server profiles memory while another starts), ``--gpu-memory-utilization
0.03`` and ``--max-num-seqs 256`` (the engine's own default on GPUs below 70 GiB; 0.24.1's default on an H100, 1024,
needs more state blocks than a 2 GiB pool holds with MTP: docs/gpu-runs/2026-12-06-run30). ``-triton`` cells add
the suite's older deviations (``--gdn-prefill-backend triton --language-model-only``), a labelled extra.

Per cell: base and each adapter alone (three prompts, prompt logprobs included), then 16 requests mixing them at
once, against HF transformers + PEFT on the dense twin (TOLERANCE, as the server suites'); the greedy tokens are kept
so that :func:`test_mtp_is_lossless` can hold every MTP cell against its ``-nomtp`` twin (the same engine, flags and
requests without ``--speculative-config``): the same tokens, or a first difference where HF's two best tokens are
within NEAR_TIE. ``-noP15`` cells run without P15 (docs/upstream/mtp-prompt-logprobs-graph-pool.md) and record what
the engine serves then. The ``accept*`` cells send 32 requests of 96 tokens at once, read the engine's own
speculative-decoding counters from /metrics, and hold its per-position acceptance against the chosen rate.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import openai
import pytest
from serving_checks import (
    TOLERANCE,
    check,
    complete,
    gather_completions,
    lora_args,
    prompts,
    shared_args,
    start_fleet,
    worst,
)
from test_moe_server import aphrodite_minor

from harness import Reference

START_TIMEOUT = float(os.environ.get("HXF_SERVER_START_TIMEOUT", "1500"))
BASE_PORT = 8300 + int(os.environ.get("HXF_PORT_OFFSET", "0"))
SERVED = "tiny-mtp"
ADAPTERS = ("lora-a", "lora-b")
P15_OFF = {"HYBRID_EXL3_FIXES_DISABLE": "P15"}
NEAR_TIE = 0.02  # nats: a first greedy difference where HF's top two are closer than this is a near-tie
ACCEPT_POINTS = 0.05  # the engine's position-1 acceptance within 5 points of the chosen rate
TRITON = ["--gdn-prefill-backend", "triton", "--language-model-only"]
# checkpoint name: (make-tiny preset, TinySpec overrides)
CHECKPOINTS = {
    "dense": ("tiny", {}),
    "moe": ("tiny-moe", {}),
    "accept70": ("tiny", {"mtp_acceptance": 0.7}),
    "accept40": ("tiny", {"mtp_acceptance": 0.4}),
}


def mtp(k: int) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})]


# name: checkpoint, adapters, num_speculative_tokens (None: no MTP), extra args, extra env
CELLS = {
    "dense-nomtp": ("dense", ADAPTERS, None, [], {}),
    "dense-mtp1": ("dense", ADAPTERS, 1, [], {}),
    "dense-mtp3": ("dense", ADAPTERS, 3, [], {}),
    "dense-mtp3-noP15": ("dense", ADAPTERS, 3, [], P15_OFF),
    "moe-nomtp": ("moe", ADAPTERS, None, [], {}),
    "moe-mtp1": ("moe", ADAPTERS, 1, [], {}),
    "moe-mtp3": ("moe", ADAPTERS, 3, [], {}),
    "moe-mtp3-noP15": ("moe", ADAPTERS, 3, [], P15_OFF),
    "moe-nomtp-triton": ("moe", ADAPTERS, None, TRITON, {}),
    "moe-mtp3-triton": ("moe", ADAPTERS, 3, TRITON, {}),
    "moe-mtp3-triton-noP15": ("moe", ADAPTERS, 3, TRITON, P15_OFF),
    "accept70-mtp1": ("accept70", (), 1, [], {}),
    "accept70-mtp3": ("accept70", (), 3, [], {}),
    "accept40-mtp3": ("accept40", (), 3, [], {}),
}
SERVED_IDS: dict[str, dict] = {}  # cell -> {(model, prompt index): greedy ids}, filled by test_mtp_cell


def is_control(cell: str) -> bool:
    """A ``-noP15`` cell: served without P15."""
    return CELLS[cell][4] == P15_OFF


def twin_of(cell: str) -> str | None:
    """The ``-nomtp`` cell with the same checkpoint and flags (None for the acceptance cells: the cycle is theirs)."""
    name, _, k, extra, _ = CELLS[cell]
    if k is None or name.startswith("accept"):
        return None
    return f"{name}-nomtp" + ("-triton" if extra == TRITON else "")


def server_args(cell: str, folder: Path) -> tuple[str, list[str], dict]:
    name, adapters, k, extra, env = CELLS[cell]
    args = shared_args(SERVED, deviations=False) + ["--max-num-seqs", "256"]
    args += lora_args(folder, adapters) if adapters else []
    args += mtp(k) if k else []
    return str(folder / "exl3"), args + extra, env


@pytest.fixture(scope="session")
def mtp_models(workdir):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    def folder(name: str) -> Path:
        preset, overrides = CHECKPOINTS[name]
        dest = workdir / f"mtp-{name}"
        if not (dest / "manifest.json").exists():
            write_tiny(dest, TinySpec.preset(preset, **overrides))
        return dest

    return folder


@pytest.fixture(scope="session")
def mtp_fleet(mtp_models, workdir):
    servers = start_fleet(list(CELLS), lambda c: server_args(c, mtp_models(CELLS[c][0])), BASE_PORT, workdir)
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def mtp_references(mtp_models):
    built = {}

    def reference(name: str) -> Reference:
        if name not in built:
            built[name] = Reference(mtp_models(name), ADAPTERS)
        return built[name]

    return reference


def spec_counters(server) -> dict:
    """aphrodite's speculative-decoding counters (bench/level_checks.spec_counters): drafts, draft tokens, accepted
    tokens, and accepted tokens per draft position."""
    import httpx
    import level_checks  # bench/, on the path through server.py

    return {"per_pos": {}, **level_checks.spec_counters(httpx.get(server.url + "/metrics", timeout=30).text)}


def serving(fleet, cell: str, record):
    """The cell's server once it is up, and its start-up record; skips a cell not selected, fails one that did not
    start with the engine's own error."""
    if cell not in fleet:
        pytest.skip(f"{cell} not selected (HXF_SERVER_CELLS)")
    server = fleet[cell]
    info = started(server, cell, record)
    if not info["started"]:
        raise AssertionError(f"{cell}: {info['root_error']}\n{server.text()[-2000:]}")
    return server, info


def started(server, cell: str, record) -> dict:
    up = server.wait_ready(START_TIMEOUT)
    name, adapters, k, extra, env = CELLS[cell]
    info = {
        "checkpoint": f"{name} (make-tiny {CHECKPOINTS[name][0]} {CHECKPOINTS[name][1] or ''})".replace(" )", ")"),
        "num_speculative_tokens": k,
        "adapters": list(adapters),
        "extra": " ".join(extra),
        "env": " ".join(f"{a}={b}" for a, b in env.items()),
        "started": up,
        "ready_s": server.ready_s,
        "overlay": sorted(set(server.overlay_lines())),
        "mtp_resolved": "Qwen3_5MTP" in server.text() or "Qwen3_5MoeMTP" in server.text(),
        "no_draft_group": "no KV cache group could be identified as the draft" in server.text(),
        **server.startup_figures(),
    }
    if not up:
        info["root_error"] = server.root_error()[:600]
    record(f"mtp {cell}", **info)
    return info


@pytest.mark.parametrize("cell", [c for c in CELLS if not c.startswith("accept")])
def test_mtp_cell(cell, mtp_fleet, mtp_references, record):
    """Base and each adapter alone, then 16 mixed at once, prompt and generated logprobs against HF + PEFT; a
    ``-noP15`` cell records what it serves and, on 0.20 - 0.21, must show the write-up's corruption."""
    server, info = serving(mtp_fleet, cell, record)
    name, adapters, k, _, _ = CELLS[cell]
    reference = mtp_references(name)
    kept, failed, rows = {}, [], {}
    models = [None, *adapters]
    control = is_control(cell)
    for model in models:
        answers, errors = [], []
        for ids in prompts(3, 1):
            try:
                answers.append(complete(server, model or SERVED, ids))
            except openai.APIStatusError as exc:  # a -noP15 control's NaN prompt logprobs: HTTP 400
                if not control:
                    raise
                errors.append(f"{exc.status_code}: {exc.message}"[:200])
        kept.update({(model, i): a["ids"] for i, a in enumerate(answers)})
        rows[model] = [check(reference, model, a) for a in answers]
        info[f"alone {model or 'base'}"] = {**(worst(rows[model]) if answers else {}), "failed": len(errors)}
        if errors:
            info[f"alone {model or 'base'}"]["first_failure"] = errors[0]
        record(f"mtp {cell}", **info)
    mix = [models[i % len(models)] for i in range(16)]
    jobs = [(m or SERVED, ids) for m, ids in zip(mix, prompts(16, 2))]
    results = asyncio.run(gather_completions(server, jobs, 8, True))
    failed = [repr(r)[:300] for r in results if isinstance(r, Exception)]
    mixed = []
    for i, (m, r) in enumerate(zip(mix, results)):
        if not isinstance(r, Exception):
            kept[(m, 100 + i)] = r["ids"]
            mixed.append(check(reference, m, r))
    info["16 mixed"] = {**(worst(mixed) if mixed else {}), "failed": len(failed), "first_failure": failed[:1]}
    every = [*mixed, *sum(rows.values(), [])]
    info["max_abs_dlogprob"] = round(max(r["max_abs_dlogprob"] for r in every), 4) if every else None
    info["decode_max"] = round(max(r["generated_max"] for r in every), 4) if every else None
    info["prompt_max"] = round(max(r["prompt_max"] for r in every), 4) if every else None
    info["tolerance"] = TOLERANCE
    if k:
        info["spec_counters"] = spec_counters(server)
    record(f"mtp {cell}", **info)
    asked = {**dict(enumerate(prompts(3, 1))), **{100 + i: p for i, p in enumerate(prompts(16, 2))}}
    SERVED_IDS[cell] = {"ids": kept, "prompts": asked}
    server.stop()
    if control:  # prompt logprobs read after the drafter (docs/upstream/mtp-prompt-logprobs-graph-pool.md)
        failures = len(failed) + sum(v.get("failed", 0) for k, v in info.items() if k.startswith("alone "))
        wrong = failures or (info["max_abs_dlogprob"] or 0) > TOLERANCE
        if aphrodite_minor() <= (0, 21):
            assert wrong, f"{cell} served right without P15: {info}"
        return
    assert not failed, failed[:3]
    assert info["max_abs_dlogprob"] < TOLERANCE, info


def test_mtp_is_lossless(record):
    """Each MTP cell's greedy tokens are its ``-nomtp`` twin's on the same requests, or differ first at a near-tie."""
    compared = 0
    for cell in CELLS:
        twin = twin_of(cell)
        if twin is None or cell not in SERVED_IDS or twin not in SERVED_IDS or is_control(cell):
            continue
        mine, theirs = SERVED_IDS[cell]["ids"], SERVED_IDS[twin]["ids"]
        same = sum(mine[key] == theirs.get(key) for key in mine)
        differ = [key for key in mine if key in theirs and mine[key] != theirs[key]]
        record(f"mtp lossless {cell} vs {twin}", requests=len(mine), same=same, differ=[str(k) for k in differ])
        compared += 1
        SERVED_IDS[cell]["differ"] = differ
    if not compared:
        pytest.skip("no MTP cell and its -nomtp twin both served (HXF_SERVER_CELLS)")


def test_differences_are_near_ties(mtp_references, record):
    """Where an MTP cell and its twin differ, HF's top-two gap at the first differing position is below NEAR_TIE."""
    checked = []
    for cell, kept in SERVED_IDS.items():
        for key in kept.get("differ", []):
            twin = SERVED_IDS[twin_of(cell)]["ids"][key]
            mine = kept["ids"][key]
            j = next(i for i, (a, b) in enumerate(zip(mine, twin)) if a != b)
            model = key[0]
            rows = mtp_references(CELLS[cell][0]).logprobs(list(kept["prompts"][key[1]]) + mine[:j], model)
            top = rows[-1].topk(2).values
            gap = float(top[0] - top[1])
            checked.append({"cell": cell, "request": str(key), "position": j, "hf_top2_gap": round(gap, 4)})
    record("mtp lossless near-ties", differences=checked)
    assert all(c["hf_top2_gap"] < NEAR_TIE for c in checked), checked


@pytest.mark.parametrize("cell", [c for c in CELLS if c.startswith("accept")])
def test_acceptance_at_the_chosen_rate(cell, mtp_fleet, mtp_models, mtp_references, record):
    """32 requests of 96 greedy tokens at once: every token follows the checkpoint's cycle (the trunk's own greedy
    continuation, so MTP changed nothing), and the engine's position-1 acceptance is the chosen rate within 5
    points; every 8th request against HF (prompt and generated logprobs)."""
    from hybrid_exl3_fixes.checkpoint.mtpaccept import cycle_and_wrong

    server, info = serving(mtp_fleet, cell, record)
    name, _, k, _, _ = CELLS[cell]
    manifest = json.loads((mtp_models(name) / "manifest.json").read_text())
    rate = manifest["mtp_acceptance"]["rate"]
    nxt, _ = cycle_and_wrong(rate, manifest["spec"]["seed"])
    before = spec_counters(server)
    jobs = [(SERVED, ids) for ids in prompts(32, 9, 8, 16)]
    results = asyncio.run(gather_completions(server, jobs, 96, False))
    after = spec_counters(server)
    failed = [repr(r)[:300] for r in results if isinstance(r, Exception)]
    answered = [r for r in results if not isinstance(r, Exception)]
    follows = sum(
        all(a < len(nxt) and b == nxt[a] for a, b in zip([p[-1], *r["ids"]], r["ids"]))
        for (_, p), r in zip(jobs, answered)
    )
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    per_pos = [
        round((after["per_pos"].get(j, 0) - before["per_pos"].get(j, 0)) / drafts, 4) if drafts else None
        for j in range(k)
    ]
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    sampled = [check(mtp_references(name), None, complete(server, SERVED, jobs[i][1], 16)) for i in range(0, 32, 8)]
    info.update(
        chosen_rate=rate,
        expected=manifest["mtp_acceptance"]["expected"][f"k{k}"],
        drafts=drafts,
        per_position_acceptance=per_pos,
        mean_accepted=round(accepted / drafts, 4) if drafts else None,
        requests_following_the_cycle=f"{follows} of {len(answered)}",
        failed=len(failed),
        checked_against_hf=worst(sampled),
    )
    record(f"mtp {cell}", **info)
    server.stop()
    assert not failed and follows == len(answered) == 32, (failed[:2], follows)
    assert drafts > 0 and abs(per_pos[0] - rate) <= ACCEPT_POINTS, info
    assert info["checked_against_hf"]["max_abs_dlogprob"] < TOLERANCE, info
