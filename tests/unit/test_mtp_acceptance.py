"""make-tiny ``--mtp-acceptance`` (checkpoint/mtpaccept.py) on the dense twin, on the CPU: the trunk's greedy
continuation is the checkpoint's cycle, and the MTP head, computed as aphrodite's Qwen3_5MultiTokenPredictor computes
it (its EXL3 tensors decoded by the reference codec; transformers has no MTP head), agrees with that continuation on
exactly the right tokens it visits, which over the cycle are the chosen share."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RATE = 0.7
PROMPT, NEW = 12, 48


@pytest.fixture(scope="module")
def accept(tmp_path_factory):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    dest = tmp_path_factory.mktemp("accept") / "ck"
    manifest = write_tiny(dest, TinySpec(mtp_acceptance=RATE, adapters=()))
    return dest, manifest


def rms(x, weight):
    return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * (1 + weight.float())


def exl3_state(folder):
    """Every tensor of the EXL3 folder ``folder/exl3``, one file or shards."""
    from safetensors.torch import load_file

    state = {}
    for shard in sorted((folder / "exl3").glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


def mtp_predictions(state, model, ids):
    """Token i + 2 as the MTP head predicts it from the trunk's hidden state at i and the embedding of token i + 1
    (qwen3_5_mtp.py: pre-fc norms, fc over [embedding, hidden], one full-attention layer, norm, the shared head)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    from hybrid_exl3_fixes.checkpoint import codec

    def dense(prefix):
        return codec.dense_weight(codec.linear_tensors(state, prefix)).t().contiguous()

    text = model.config.text_config
    layer = hf.Qwen3_5DecoderLayer(text, len(text.layer_types) - 1).eval()
    weights = {}
    for key in layer.state_dict():
        full = "mtp.layers.0." + key
        weights[key] = state[full].float() if full in state else dense(full.removesuffix(".weight"))
    layer.load_state_dict(weights)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        emb = model.get_input_embeddings()(ids)[0]
        x = torch.cat(
            [
                rms(emb[1:], state["mtp.pre_fc_norm_embedding.weight"]),
                rms(hidden[:-1], state["mtp.pre_fc_norm_hidden.weight"]),
            ],
            -1,
        )
        y = x @ dense("mtp.fc").t()
        n = y.shape[0]
        pos = torch.arange(n)[None]
        rotary = model.model.language_model.rotary_emb(y[None], pos[None].expand(3, 1, -1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        z = layer(y[None], position_embeddings=rotary, attention_mask=mask, position_ids=pos)
        z = z[0] if isinstance(z, tuple) else z
        return (rms(z[0], state["mtp.norm.weight"]) @ model.lm_head.weight.t()).argmax(-1)


def test_the_trunk_follows_the_cycle_and_the_head_agrees_on_the_right_tokens(accept):
    from hybrid_exl3_fixes.checkpoint.mtpaccept import cycle_and_wrong

    folder, manifest = accept
    nxt, wrong = cycle_and_wrong(RATE, 0)
    assert manifest["mtp_acceptance"]["right_tokens"] == 500 - round(0.3 * 500)
    assert sum(not w for w in wrong) / len(wrong) == pytest.approx(RATE)
    arch = json.loads((folder / "dense" / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(folder / "dense", dtype=torch.float32).eval()
    prompt = torch.randint(0, 500, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0].log_softmax(-1)
        ids = model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)
    top = logits.topk(2, -1)
    assert top.indices[:, 0].tolist() == [nxt[t] for t in prompt[0].tolist()]  # at every prompt position
    assert float((top.values[:, 0] - top.values[:, 1]).min()) > 2.0  # far from a near-tie
    generated = ids[0, PROMPT:].tolist()
    assert all(b == nxt[a] for a, b in zip([prompt[0, -1].item(), *generated], generated))
    predicted = mtp_predictions(exl3_state(folder), model, ids)
    # prediction i is for token i + 2, made from token i + 1: right exactly where token i + 1 is a right token
    for i in range(PROMPT - 1, ids.shape[1] - 2):
        current = ids[0, i + 1].item()
        assert (predicted[i].item() == ids[0, i + 2].item()) == (not wrong[current]), i


def test_a_rate_outside_zero_to_one_is_refused(tmp_path):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    with pytest.raises(ValueError, match="from 0 to 1"):
        write_tiny(tmp_path / "x", TinySpec(mtp_acceptance=1.5))
    with pytest.raises(ValueError, match="MTP head"):
        write_tiny(tmp_path / "y", TinySpec(mtp_acceptance=0.5, mtp_layers=0))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def dense_twin(folder, dest):
    """The full-depth writer's EXL3 folder decoded into a float32 HF folder (the writer has no dense twin): every
    EXL3 linear's exact weight (the reference codec), every other tensor as it is."""
    from safetensors.torch import save_file

    from hybrid_exl3_fixes.checkpoint import codec

    state = exl3_state(folder)
    prefixes = {k.removesuffix(".trellis") for k in state if k.endswith(".trellis")}
    dense = {k: v.float() for k, v in state.items() if k.rsplit(".", 1)[0] not in prefixes and not k.startswith("mtp.")}
    for prefix in prefixes - {p for p in prefixes if p.startswith("mtp.")}:
        dense[prefix + ".weight"] = codec.dense_weight(codec.linear_tensors(state, prefix)).t().contiguous()
    cfg = json.loads((folder / "exl3" / "config.json").read_text())
    cfg.pop("quantization_config", None)
    dest.mkdir()
    text = {**cfg["text_config"], "dtype": "float32"}
    (dest / "config.json").write_text(json.dumps({**cfg, "dtype": "float32", "text_config": text}))
    save_file(dense, str(dest / "model.safetensors"))
    return state


def test_full_depth_writer_serves_two_rates_by_token_pool(tmp_path):
    """write_full with two rates: a float16 head in its own shard, and each pool's prompts follow that pool's cycle
    with the MTP head right exactly on its right tokens (on 8 layers of the tiny width, on the CPU)."""
    from hybrid_exl3_fixes.checkpoint.mtpaccept import cycle_and_wrong
    from hybrid_exl3_fixes.checkpoint.stream import write_full
    from hybrid_exl3_fixes.checkpoint.tinyspec import TinySpec

    rates = (0.6, 0.9)
    layers = (("linear_attention",) * 3 + ("full_attention",)) * 2
    manifest = write_full(tmp_path / "ck", TinySpec(layer_types=layers, mtp_acceptance=rates), device="cpu")
    pools = manifest["mtp_acceptance"]["pools"]
    got = [(p["rate"], p["tokens"], p["right_tokens"]) for p in pools]
    assert got == [(0.6, [0, 250], 150), (0.9, [250, 500], 225)]
    assert manifest["spec"]["head_bits"] is None
    state = dense_twin(tmp_path / "ck", tmp_path / "dense")
    assert state["lm_head.weight"].dtype == torch.float16 and not any(k.startswith("lm_head.trellis") for k in state)
    nxt, wrong = cycle_and_wrong(rates, 0)
    arch = json.loads((tmp_path / "dense" / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    for (lo, hi), seed in zip(((0, 250), (250, 500)), (5, 6)):
        prompt = torch.randint(lo, hi, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ids = model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)
        generated = ids[0, PROMPT:].tolist()
        assert all(lo <= b < hi and b == nxt[a] for a, b in zip([prompt[0, -1].item(), *generated], generated))
        predicted = mtp_predictions(state, model, ids)
        for i in range(PROMPT - 1, ids.shape[1] - 2):
            assert (predicted[i].item() == ids[0, i + 2].item()) == (not wrong[ids[0, i + 1].item()]), (lo, i)


def test_one_rate_keeps_the_tensors_written_before_pools():
    """One rate is one pool of all 500 tokens, drawn as before pools existed: the same cycle for the same seed."""
    from hybrid_exl3_fixes.checkpoint.mtpaccept import cycle_and_wrong

    nxt, wrong = cycle_and_wrong(0.7, 0)
    assert (nxt, wrong) == cycle_and_wrong((0.7,), 0)
    seen, t = set(), 0
    while t not in seen:  # one cycle through every ordinary token
        seen.add(t)
        t = nxt[t]
    assert len(seen) == 500 and sum(wrong) == 150
