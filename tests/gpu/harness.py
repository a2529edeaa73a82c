"""Helpers of the GPU suite (imported as `harness`; kept out of conftest.py so the name is unique)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS: dict = {}


def run_engine(case: dict, workdir: Path, name: str, env_extra: dict | None = None, timeout: int = 900) -> dict:
    """Run engine_case.py in a fresh process; returns its RESULT plus the full output."""
    case_path = workdir / f"{name}.json"
    case_path.write_text(json.dumps(case))
    env = dict(os.environ)
    env.pop("HYBRID_EXL3_FIXES_DISABLE", None)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_case.py"), str(case_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"ok": False, "stage": "crash", "error": f"exit {proc.returncode}"}
    result["output"] = output
    return result


def compare(prompt_logprobs: list, ref) -> dict:
    """max |d logprob| over aphrodite's top-k at each prompt position, and argmax agreement."""
    max_diff, argmax_same, positions = 0.0, 0, 0
    for pos, entry in enumerate(prompt_logprobs):
        if entry is None:
            continue
        row = ref[pos - 1]
        positions += 1
        for token, lp in entry.items():
            max_diff = max(max_diff, abs(lp - float(row[int(token)])))
        best = max(entry.items(), key=lambda kv: kv[1])[0]
        argmax_same += int(int(best) == int(row.argmax()))
    return {"max_abs_dlogprob": max_diff, "argmax_agree": argmax_same, "positions": positions}


class Reference:
    """HF transformers + PEFT on the dense twin (float32, on the GPU): log-probabilities of any token
    sequence with no adapter or with any adapter make-tiny wrote (all loaded once, switched by name)."""

    def __init__(self, tiny: Path, adapters: tuple[str, ...] = ("lora-a", "lora-b"), device: str = "cuda"):
        import json

        import torch
        import transformers
        from peft import PeftModel

        # Qwen3_5ForConditionalGeneration, or Qwen3_5MoeForConditionalGeneration for a MoE twin
        arch = json.loads((tiny / "dense" / "config.json").read_text())["architectures"][0]
        base = getattr(transformers, arch).from_pretrained(tiny / "dense", dtype=torch.float32).to(device).eval()
        # an adapter on the routed experts (make-tiny's lora-experts: keys per expert) has no PEFT module to load
        # into on transformers' fused experts: PEFT takes its other keys, ``merged_experts`` adds the expert deltas
        # to the fused weights, exactly W + (alpha / r) B A per expert
        self.expert_deltas = {name: expert_lora(tiny / name) for name in adapters}
        self.expert_deltas = {name: d for name, d in self.expert_deltas.items() if d}
        folders = {
            name: without_experts(tiny / name) if name in self.expert_deltas else tiny / name for name in adapters
        }
        model = PeftModel.from_pretrained(base, folders[adapters[0]], adapter_name=adapters[0])
        for name in adapters[1:]:
            model.load_adapter(folders[name], adapter_name=name)
        self.model, self.torch, self.cache = model.eval(), torch, {}
        self.tiny, self.arch, self.device = tiny, arch, device
        self.dropped: tuple[str, ...] = ()  # module-name suffixes whose LoRA deltas ``dropping`` removed
        self.experts_off = False  # ``without_expert_deltas``: the reference of an engine that ignored them

    def without_expert_deltas(self):
        """A context in which adapters on the routed experts keep only their other deltas."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.experts_off = True
            try:
                yield self
            finally:
                self.experts_off = False

        return scope()

    def merged_experts(self, adapter: str):
        """A context in which ``adapter``'s expert deltas are added to the fused expert weights (restored after)."""
        import contextlib

        torch = self.torch
        base = self.model.get_base_model()

        @contextlib.contextmanager
        def scope():
            saved = {}
            with torch.no_grad():
                for (path, param, expert, rows), delta in self.expert_deltas[adapter].items():
                    weight = getattr(fused_experts(base, path, param), param)
                    if (path, param) not in saved:
                        saved[path, param] = weight.detach().clone()
                    weight[expert, rows[0] : rows[1]] += delta.to(weight.device, weight.dtype)
            try:
                yield
            finally:
                with torch.no_grad():
                    for (path, param), weight in saved.items():
                        getattr(fused_experts(base, path, param), param).copy_(weight)

        return scope()

    def dropping(self, suffixes: tuple[str, ...]):
        """A context in which the LoRA deltas of the modules named ``*suffixes`` (every adapter) are off, by
        PEFT's per-adapter scaling set to 0: the reference of an engine that ignored those modules."""
        import contextlib

        layers = [m for n, m in self.model.named_modules() if n.endswith(suffixes) and hasattr(m, "scaling")]
        assert layers, f"no LoRA layer ends with {suffixes}"

        @contextlib.contextmanager
        def scope():
            saved = [dict(m.scaling) for m in layers]
            for m in layers:
                m.scaling = {k: 0.0 for k in m.scaling}
            self.dropped = tuple(suffixes)
            try:
                yield self
            finally:
                for m, scaling in zip(layers, saved):
                    m.scaling = scaling
                self.dropped = ()

        return scope()

    def bf16_spread(self, prompt_ids: list[list[int]]) -> float:
        """How far HF itself moves from this float32 reference when it runs in bfloat16 (the engine's
        activation dtype): max |d logprob| of each prompt token and of each position's top-1 token, base
        model. The floor under any bfloat16 engine's error on this checkpoint (make-tiny's qwen3.6-35b-a3b, where
        8 of 32 experts are chosen per token and near-ties flip: 0.87 over a cell's prompts; tiny-moe: 0.029)."""
        import transformers

        torch = self.torch
        bf16 = getattr(transformers, self.arch).from_pretrained(self.tiny / "dense", dtype=torch.bfloat16)
        bf16 = bf16.cuda().eval()
        worst = 0.0
        for ids in prompt_ids:
            ref = self.logprobs(ids, None)
            with torch.no_grad():
                low = bf16(input_ids=torch.tensor([ids]).cuda()).logits[0].float().log_softmax(-1).cpu()
            rows = torch.arange(len(ids) - 1)
            for tokens in (torch.tensor(ids[1:]), ref[:-1].argmax(-1)):
                worst = max(worst, (ref[rows, tokens] - low[rows, tokens]).abs().max().item())
        del bf16
        torch.cuda.empty_cache()
        return worst

    def max_tokens_per_expert(self, prompt_ids: list[list[int]]) -> int | None:
        """The most tokens one routed expert of one layer receives when ``prompt_ids`` are prefilled together in
        one batch, by the base model's router (HF's TopKRouter returns logits, scores and the chosen experts);
        None for a dense twin. Above 128 a CUDA-graph batch of those prompts overflows EXL3's fused kernel."""
        torch = self.torch
        routers = [m for m in self.model.modules() if type(m).__name__.endswith("TopKRouter")]
        if not routers:
            return None
        counts: dict[int, torch.Tensor] = {}

        def hook(module, args, output):
            chosen = output[2].reshape(-1).cpu()
            counts[id(module)] = counts.get(id(module), 0) + torch.bincount(chosen, minlength=module.num_experts)

        handles = [r.register_forward_hook(hook) for r in routers]
        try:
            with torch.no_grad(), self.model.disable_adapter():
                for ids in prompt_ids:
                    self.model(input_ids=torch.tensor([ids], device=self.device))
        finally:
            for handle in handles:
                handle.remove()
        return int(max(int(c.max()) for c in counts.values()))

    def logprobs(self, ids: list[int], adapter: str | None):
        """(len(ids), vocab) log-softmax rows: row i is the distribution of token i + 1."""
        import contextlib

        key = (tuple(ids), adapter, self.dropped, self.experts_off)
        if key not in self.cache:
            torch = self.torch
            if adapter is not None:
                self.model.set_adapter(adapter)
            merged = adapter in self.expert_deltas and not self.experts_off
            with (
                torch.no_grad(),
                self.model.disable_adapter() if adapter is None else contextlib.nullcontext(),
                self.merged_experts(adapter) if merged else contextlib.nullcontext(),
            ):
                logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0]
            self.cache[key] = logits.float().log_softmax(-1).cpu()
        return self.cache[key]


def fused_experts(base, path: str, param: str):
    """transformers' experts module at ``path`` that holds ``param``, under any PEFT ParamWrappers an adapter in the
    target_parameters form put around it (each keeps the wrapped module as ``base_layer``)."""
    module = base.get_submodule(path)
    while param not in module._parameters and hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def expert_lora(folder: Path) -> dict:
    """A PEFT adapter's routed-expert deltas as transformers' fused experts hold them: {(experts module path, param,
    expert, (first row, end row)): (alpha / r) B @ A} (gate rows [0, I) and up rows [I, 2I) of ``gate_up_proj``
    (E, 2I, H), all of ``down_proj`` (E, H, I)); {} for an adapter without expert keys."""
    import json
    import re

    from safetensors.torch import load_file

    state = load_file(str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    pattern = re.compile(r"base_model\.model\.(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.lora_A\.weight$")
    out = {}
    for key, a in state.items():
        match = pattern.match(key)
        if not match:
            continue
        path, expert, which = match.group(1), int(match.group(2)), match.group(3)
        delta = scale * (state[key.replace(".lora_A.", ".lora_B.")].float() @ a.float())  # (out, in)
        rows = delta.shape[0]
        first = rows if which == "up" else 0  # up follows gate in gate_up_proj
        out[(path, "down_proj" if which == "down" else "gate_up_proj", expert, (first, first + rows))] = delta
    return out


def without_experts(folder: Path) -> Path:
    """A copy of a PEFT adapter folder without its routed-expert keys (beside it, ``<name>-no-experts``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest = folder.parent / f"{folder.name}-no-experts"
    if not dest.exists():
        dest.mkdir()
        shutil.copy(folder / "adapter_config.json", dest / "adapter_config.json")
        state = load_file(str(folder / "adapter_model.safetensors"))
        kept = {k: v for k, v in state.items() if ".mlp.experts." not in k}
        save_file(kept, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest


def token_id(token: str) -> int:
    """A served token with ``return_tokens_as_token_ids``: "token_id:123" -> 123."""
    return int(token.rsplit(":", 1)[1])


def served_completion(choice: dict) -> dict:
    """A /v1/completions choice (``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs``
    and optionally ``prompt_logprobs``) as token ids and {token id: logprob} per position."""
    lp = choice.get("logprobs") or {}
    generated = []
    for token, sampled, top in zip(
        lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    ):
        entry = {token_id(t): v for t, v in (top or {}).items()}
        entry[token_id(token)] = sampled
        generated.append(entry)
    prompt = [
        None if d is None else {int(t): v["logprob"] for t, v in d.items()} for d in choice.get("prompt_logprobs") or []
    ]
    return {
        "prompt_ids": choice.get("prompt_token_ids") or [],
        "ids": choice.get("token_ids") or [],
        "prompt": prompt,
        "generated": generated,
    }


def served_chat_logprobs(content: list[dict]) -> list[dict]:
    """/v1/chat/completions ``logprobs.content`` (``return_tokens_as_token_ids``) -> {id: logprob} per position."""
    rows = []
    for item in content or []:
        entry = {token_id(t["token"]): t["logprob"] for t in item.get("top_logprobs") or []}
        entry[token_id(item["token"])] = item["logprob"]
        rows.append(entry)
    return rows


def compare_served(
    reference: Reference,
    adapter: str | None,
    prompt_ids: list[int],
    ids: list[int],
    generated: list[dict],
    prompt: list | None = None,
) -> dict:
    """Served log-probabilities against the reference at every reported entry: the prompt positions
    (``prompt`` as served: None first) and each generated position, scored on the served tokens
    themselves, so a greedy near-tie that picked another token does not count as a difference."""
    if len(ids) != len(generated):
        raise AssertionError(f"{len(ids)} generated tokens but {len(generated)} logprob rows")
    rows = reference.logprobs(list(prompt_ids) + list(ids[:-1]) if ids else list(prompt_ids), adapter)
    diffs = {"prompt": 0.0, "generated": 0.0}
    counts = {"prompt": 0, "generated": 0}
    argmax = 0
    for part, entries, offset in (("prompt", prompt or [], -1), ("generated", generated, len(prompt_ids) - 1)):
        for pos, entry in enumerate(entries):
            if not entry:
                continue
            row = rows[pos + offset]
            counts[part] += 1
            diffs[part] = max(diffs[part], max(abs(lp - float(row[t])) for t, lp in entry.items()))
            if part == "generated":
                argmax += int(max(entry, key=entry.get) == int(row.argmax()))
    return {
        "max_abs_dlogprob": max(diffs.values()),
        "prompt_max": diffs["prompt"],
        "generated_max": diffs["generated"],
        "prompt_positions": counts["prompt"],
        "generated_positions": counts["generated"],
        "generated_argmax_agree": argmax,
    }
