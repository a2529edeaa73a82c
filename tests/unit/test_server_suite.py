"""The GPU server suite's own machinery on the CPU (fake inputs): response parsing, the alignment of
served log-probabilities with the reference's rows, and the Server process handling against a
stand-in `aphrodite` command. The suite itself needs the GPU (tests/gpu/test_server.py)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from helpers import ROOT, free_port, install_fake_aphrodite

sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from harness import compare_served, served_chat_logprobs, served_completion, token_id  # noqa: E402
from server import Server  # noqa: E402


class TableReference:
    """Fake reference: row i is a fixed distribution that depends on (i, adapter), so an off-by-one
    in compare_served's indexing shows up as a difference."""

    def __init__(self, vocab=16):
        self.vocab = vocab
        self.asked = []

    def row(self, i, adapter):
        g = torch.Generator().manual_seed(i * 7 + (0 if adapter is None else 3))
        return torch.randn(self.vocab, generator=g).log_softmax(-1)

    def logprobs(self, ids, adapter):
        self.asked.append((list(ids), adapter))
        return torch.stack([self.row(i, adapter) for i in range(len(ids))])


def served_like(ref, adapter, prompt_ids, ids, k=3, shift=0):
    """What a correct server would report (or, with shift, one that is off by ``shift`` positions)."""
    rows = ref.logprobs(prompt_ids + ids[:-1], adapter)

    def top(i, token):
        row = rows[i + shift] if 0 <= i + shift < len(rows) else rows[i]
        entry = {int(t): float(row[t]) for t in row.topk(k).indices}
        entry[token] = float(row[token])
        return entry

    prompt = [None] + [top(i - 1, prompt_ids[i]) for i in range(1, len(prompt_ids))]
    generated = [top(len(prompt_ids) - 1 + j, t) for j, t in enumerate(ids)]
    return prompt, generated


def test_compare_served_lines_up_prompt_and_generated_positions():
    ref = TableReference()
    prompt_ids, ids = [1, 5, 2, 9], [4, 4, 7]
    prompt, generated = served_like(ref, "lora-a", prompt_ids, ids)
    got = compare_served(ref, "lora-a", prompt_ids, ids, generated, prompt)
    assert got["max_abs_dlogprob"] < 1e-6 and got["prompt_positions"] == 3 and got["generated_positions"] == 3
    assert ref.asked[-1] == ([1, 5, 2, 9, 4, 4], "lora-a")  # the served tokens themselves, last one excluded
    off = compare_served(ref, "lora-a", prompt_ids, ids, *served_like(ref, "lora-a", prompt_ids, ids, shift=1)[::-1])
    assert off["max_abs_dlogprob"] > 0.1
    other = compare_served(ref, None, prompt_ids, ids, generated, prompt)  # another adapter's reference
    assert other["max_abs_dlogprob"] > 0.1
    with pytest.raises(AssertionError, match="2 generated tokens but 3"):
        compare_served(ref, None, prompt_ids, ids[:2], generated)


def test_served_response_parsing():
    choice = {
        "prompt_token_ids": [3, 4],
        "token_ids": [7, 8],
        "prompt_logprobs": [
            None,
            {
                "4": {"logprob": -1.5, "rank": 2, "decoded_token": "x"},
                "6": {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
            },
        ],
        "logprobs": {
            "tokens": ["token_id:7", "token_id:8"],
            "token_logprobs": [-0.1, -2.0],
            "top_logprobs": [{"token_id:7": -0.1, "token_id:1": -3.0}, {"token_id:2": -0.3}],
        },
    }
    got = served_completion(choice)
    assert got == {
        "prompt_ids": [3, 4],
        "ids": [7, 8],
        "prompt": [None, {4: -1.5, 6: -0.5}],
        "generated": [{7: -0.1, 1: -3.0}, {2: -0.3, 8: -2.0}],
    }
    content = [
        {
            "token": "token_id:9",
            "logprob": -0.2,
            "top_logprobs": [{"token": "token_id:9", "logprob": -0.2}, {"token": "token_id:3", "logprob": -1.9}],
        }
    ]
    assert served_chat_logprobs(content) == [{9: -0.2, 3: -1.9}]
    assert token_id("token_id:123") == 123


FAKE_APHRODITE = textwrap.dedent('''\
    #!{python}
    """Stand-in for `aphrodite run MODEL --host H --port P ...`: MODEL "ok" serves /health,
    MODEL "crash" prints an engine-core error and exits as aphrodite's front end does."""
    import http.server, sys
    args = sys.argv[1:]
    model, port = args[1], int(args[args.index("--port") + 1])
    print("INFO 00:00:00 hybrid-exl3-fixes: applied=5 upstream_fixed=0 drifted=0 (aphrodite 0.21.0)", flush=True)
    if model == "crash":
        print("ERROR 00:00:01 torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
        print("RuntimeError: Engine core initialization failed. See root cause above.")
        sys.exit(1)
    print("INFO 00:00:01 Model loading took 12.06 GiB memory and 10.3 seconds", flush=True)
    print("INFO 00:00:02 Initial free memory 109.98 GiB, reserved 13.0 GiB memory for KV Cache", flush=True)
    print("INFO 00:00:02 GPU KV cache size: 1,234 tokens", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    ''')


@pytest.fixture
def fake_aphrodite(tmp_path, monkeypatch):
    pytest.importorskip("httpx")
    return install_fake_aphrodite(tmp_path, monkeypatch, FAKE_APHRODITE)


def test_server_start_ready_figures_and_stop(fake_aphrodite):
    port = free_port()
    server = Server("ok", "ok", ["--seed", "0"], port, fake_aphrodite / "ok.log", {"HXF_X": "1"})
    server.start()
    try:
        assert server.wait_ready(60) and server.healthy() and server.ready_s is not None
        assert server.overlay_lines() == ["applied=5 upstream_fixed=0 drifted=0 (aphrodite 0.21.0)"]
        assert server.startup_figures() == {"kv_cache_tokens": 1234.0, "weights_gib": 12.06, "kv_reserved_gib": 13.0}
        assert server.text().splitlines()[0].endswith(f"run ok --host 127.0.0.1 --port {port} --seed 0")
    finally:
        server.stop()
    assert not server.alive() and not server.healthy()


def test_server_that_dies_reports_the_engine_core_error(fake_aphrodite):
    server = Server("crash", "crash", [], free_port(), fake_aphrodite / "crash.log")
    server.start()
    assert not server.wait_ready(60)
    assert server.root_error() == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    server.stop()


def test_expert_adapter_deltas_land_on_transformers_fused_expert_weights(tmp_path):
    """The MoE suite's reference for an adapter on the routed experts (harness.expert_lora): each expert's
    (alpha / r) B A lands on the rows of transformers' fused ``gate_up_proj`` (gate, then up) and ``down_proj`` of
    the dense twin, whose shapes it must match; the copy PEFT loads keeps every key but the experts'."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from harness import expert_lora, without_experts
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    spec = TinySpec.preset("tiny-moe")
    write_tiny(tmp_path / "m", spec)
    deltas = expert_lora(tmp_path / "m" / "lora-experts")
    text = AutoConfig.from_pretrained(tmp_path / "m" / "dense").text_config
    inter, hidden = text.moe_intermediate_size, text.hidden_size
    layers = len(spec.layer_types)
    assert len(deltas) == layers * spec.experts * 3 and expert_lora(tmp_path / "m" / "lora-a") == {}
    for (path, param, expert, (first, end)), delta in deltas.items():
        assert path.startswith("model.language_model.layers.") and path.endswith(".mlp.experts")
        assert 0 <= expert < spec.experts
        if param == "gate_up_proj":  # (E, 2I, H)
            assert delta.shape == (inter, hidden) and (first, end) in ((0, inter), (inter, 2 * inter))
        else:  # down_proj (E, H, I)
            assert param == "down_proj" and delta.shape == (hidden, inter) and (first, end) == (0, hidden)
    state = load_file(str(tmp_path / "m" / "lora-experts" / "adapter_model.safetensors"))
    key = next(k for k in state if ".mlp.experts.1.up_proj.lora_A." in k)
    path = key.removeprefix("base_model.model.").split(".1.up_proj")[0]
    b = state[key.replace("lora_A", "lora_B")].float()
    assert torch.allclose(deltas[(path, "gate_up_proj", 1, (inter, 2 * inter))], 2.0 * b @ state[key].float())
    kept = load_file(str(without_experts(tmp_path / "m" / "lora-experts") / "adapter_model.safetensors"))
    assert kept and set(kept) == {k for k in state if ".mlp.experts." not in k}


def as_fused_form(src, dest, experts: int) -> None:
    """``src`` (make-tiny's lora-experts: keys per expert, rank r) rewritten in PEFT's target_parameters form at rank
    2r, the same deltas: gate and up share the fused lora_A, so A' = [A_gate; A_up], B' = diag(B_gate, B_up); every
    other module zero-padded to 2r; lora_alpha doubled with the rank, so the scale stays."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    r = config["r"]
    out, per_expert = {}, {}
    for key, value in state.items():
        match = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.lora_([AB])\.weight$", key)
        if match:
            per_expert[(match.group(1), int(match.group(2)), match.group(3), match.group(4))] = value.float()
        elif ".lora_A." in key:
            out[key] = torch.cat([value, torch.zeros_like(value)])
        else:
            out[key] = torch.cat([value, torch.zeros_like(value)], dim=1)
    for path in sorted({k[0] for k in per_expert}):
        a_gu, b_gu, a_d, b_d = [], [], [], []
        for e in range(experts):
            p = {(w, h): per_expert[(path, e, w, h)] for w in ("gate", "up", "down") for h in "AB"}
            a_gu.append(torch.cat([p["gate", "A"], p["up", "A"]]))
            b_gu.append(torch.block_diag(p["gate", "B"], p["up", "B"]))
            a_d.append(torch.cat([p["down", "A"], torch.zeros_like(p["down", "A"])]))
            b_d.append(torch.cat([p["down", "B"], torch.zeros_like(p["down", "B"])], dim=1))
        for sub, a, b in ((".base_layer", a_gu, b_gu), ("", a_d, b_d)):
            out[f"{path}{sub}.lora_A.weight"] = torch.cat(a).to(torch.float16)  # (E x 2r, in), expert-major
            out[f"{path}{sub}.lora_B.weight"] = torch.stack(b, dim=-1).reshape(b[0].shape[0], -1).to(torch.float16)
    dest.mkdir()
    save_file(out, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.update(r=2 * r, lora_alpha=2 * config["lora_alpha"])
    config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (dest / "adapter_config.json").write_text(json.dumps(config))


def test_the_merged_expert_reference_is_what_peft_computes_for_the_same_deltas(tmp_path):
    """The MoE cells' reference for the per-expert form (its deltas merged into transformers' fused experts,
    harness.Reference.merged_experts) against PEFT's own ParamWrappers holding the same deltas in the fused form,
    both on the tiny MoE's dense twin in float32 on the CPU; and the merge undone after each use."""
    pytest.importorskip("peft", reason="peft is the reference the GPU suite compares against")
    from harness import Reference
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    spec = TinySpec.preset("tiny-moe")
    write_tiny(tmp_path / "m", spec)
    as_fused_form(tmp_path / "m" / "lora-experts", tmp_path / "m" / "lora-experts-as-3d", spec.experts)
    ref = Reference(tmp_path / "m", ("lora-a", "lora-experts", "lora-experts-as-3d"), device="cpu")
    experts = ref.model.get_base_model().model.language_model.layers[0].mlp.experts
    while "gate_up_proj" not in experts._parameters:
        experts = experts.base_layer
    before = experts.gate_up_proj.detach().clone()
    ids = [5, 17, 42, 7, 99, 3, 250, 11]
    merged, peft_form = ref.logprobs(ids, "lora-experts"), ref.logprobs(ids, "lora-experts-as-3d")
    assert torch.equal(experts.gate_up_proj, before)  # restored
    assert (merged - peft_form).abs().max().item() < 1e-3
    with ref.without_expert_deltas():
        off = ref.logprobs(ids, "lora-experts")
    assert (merged - off).abs().max().item() > 0.1  # the expert deltas matter here
