"""A checkpoint whose MTP head agrees with the model's own greedy continuation at a chosen rate (make-tiny
``--mtp-acceptance P``).

Random weights give an MTP head that almost never agrees with the trunk, so a served acceptance near 0 measures
only speculative decoding's cost. This writer shapes the unquantized tensors of a make-tiny checkpoint (its EXL3
tensors stay random trellises, as exllamav3's format allows any) so that:

- **the trunk's greedy next token is a fixed function of the current token**, ``next(t) = cycle(t)``, one cycle
  through the ordinary tokens 0..499 (never a special or filler token). Every output projection (attention
  ``o_proj``, GDN ``out_proj``, each MLP's or expert's ``down_proj``, the MTP layer's too) has its EXL3 output scale
  ``svh`` divided by ``QUIET``, so every decoder layer adds a small fraction of the embedding to the residual
  stream; the final norm's weight is 0 (Qwen3.5's RMSNorm scales by ``1 + weight``); and the ``lm_head`` row of
  ``cycle(t)`` points along the embedding of ``t``;
- **the MTP head predicts ``cycle(t)`` from the embedding of ``t`` for a chosen share ``P`` of the tokens and a wrong
  token for the rest.** ``pre_fc_norm_hidden`` is -1 (scale 0: the head ignores the trunk's hidden state),
  ``pre_fc_norm_embedding`` and ``mtp.norm`` 0, so the head's last hidden state points along
  ``a(t) = norm(e_t) @ W_fc[:hidden]`` (the random EXL3 ``mtp.fc`` decoded, as the engine computes it). The row of
  ``cycle(t)`` also points along ``a(t)`` where ``t`` is *right*; where ``t`` is *wrong* (a random subset of
  ``round((1 - P) * 500)`` tokens) the row of ``cycle(cycle(t))`` does instead.

A draft from token ``t`` is therefore accepted exactly when ``t`` is right, so along any greedy continuation the
head's teacher-forced agreement is the share of right tokens visited: ``P`` over the whole cycle. Because the
wrong tokens are placed at random along the cycle, which tokens a speculative decoder's steps visit does not
depend on where they are: the engine's per-position acceptance (accepted at position 1 / drafts) is ``P`` in
expectation, and the mean accepted length at ``k`` speculative tokens ``P + P^2 + ... + P^k``
(:func:`expected_acceptance`). Each row carries one to three unit directions of magnitude ``LOGIT`` (in logits
after the final norm); inner products of random directions in 256 dimensions are about 1/16, so the chosen token
leads by several nats at every position (checked on the dense twin in tests/unit/test_mtp_acceptance.py).
"""

from __future__ import annotations

from .tinyspec import PUBLISHED_TEXT_FIXED, SPECIAL_TOKENS

ORDINARY = min(SPECIAL_TOKENS.values())  # tokens 0..499: make-tiny's vocabulary below its special tokens
QUIET = 64.0  # every output projection's svh divided by this
LOGIT = 8.0  # the chosen token's logit, in nats above an unrelated token's (about)
OUT_PROJECTIONS = ("self_attn.o_proj", "linear_attn.out_proj", "down_proj")


def check_rate(rate: float) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ValueError(f"mtp_acceptance must be a number from 0 to 1, got {rate!r}")
    if not 0 <= rate <= 1:
        raise ValueError(f"mtp_acceptance must be from 0 to 1, got {rate}")


def cycle_and_wrong(rate: float, seed: int) -> tuple[list[int], list[bool]]:
    """``(nxt, wrong)``: the trunk's greedy successor of each ordinary token (one cycle through all of them, in a
    seeded random order) and whether the MTP head is wrong at it (a seeded random subset of exactly
    ``round((1 - rate) * ORDINARY)`` tokens)."""
    import random

    check_rate(rate)
    rng = random.Random(seed * 7919 + 17)
    order = list(range(ORDINARY))
    rng.shuffle(order)
    nxt = [0] * ORDINARY
    for i, t in enumerate(order):
        nxt[t] = order[(i + 1) % ORDINARY]
    wrong = [False] * ORDINARY
    for t in rng.sample(range(ORDINARY), round((1.0 - rate) * ORDINARY)):
        wrong[t] = True
    return nxt, wrong


def expected_acceptance(rate: float, k: int) -> dict:
    """What a speculative decoder with ``k`` tokens a step should log on this checkpoint, in expectation: the
    acceptance at each draft position (accepted there / drafts) and the mean accepted length per step."""
    per_position = [rate**j for j in range(1, k + 1)]
    return {"per_position": [round(p, 4) for p in per_position], "mean_accepted": round(sum(per_position), 4)}


def is_out_projection(prefix: str) -> bool:
    return prefix.endswith(OUT_PROJECTIONS)


def shape(spec, exl3_state: dict, dense_state: dict | None, torch, codec) -> dict:
    """Shape the written state in place (module docstring); ``dense_state`` (the dense twin's, float32; None when
    no twin is written) gets the same values. Returns the manifest's ``mtp_acceptance`` entry."""
    rate = spec.mtp_acceptance
    nxt, wrong = cycle_and_wrong(rate, spec.seed)
    gen = torch.Generator().manual_seed(spec.seed * 1000 + 999)
    emb_key, norm_key = "model.language_model.embed_tokens.weight", "model.language_model.norm.weight"
    keep = exl3_state[emb_key].dtype
    # quiet decoder layers: the output scale of every output projection, and the dense twin's weight decoded again
    for key in [k for k in exl3_state if k.endswith(".svh") and is_out_projection(k[: -len(".svh")])]:
        prefix = key[: -len(".svh")]
        exl3_state[key] = (exl3_state[key].float() / QUIET).to(torch.float16)
        if dense_state is not None and prefix + ".weight" in dense_state:
            weight = codec.dense_weight(codec.linear_tensors(exl3_state, prefix))
            dense_state[prefix + ".weight"] = weight.t().contiguous()
    emb = torch.randn(spec.vocab, spec.hidden, generator=gen).to(keep)
    exl3_state[emb_key] = emb
    exl3_state[norm_key] = torch.zeros(spec.hidden, dtype=keep)
    if spec.mtp_layers:
        exl3_state["mtp.pre_fc_norm_hidden.weight"] = torch.full((spec.hidden,), -1.0, dtype=keep)
        exl3_state["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(spec.hidden, dtype=keep)
        exl3_state["mtp.norm.weight"] = torch.zeros(spec.hidden, dtype=keep)
    # the directions the trunk's and the head's last hidden states take for each ordinary token
    e = emb[:ORDINARY].float()
    trunk = torch.nn.functional.normalize(e, dim=-1)
    head = torch.zeros_like(trunk)
    if spec.mtp_layers:
        # y = x @ W; the embedding comes first in the head's concat
        w_top = codec.dense_weight(codec.linear_tensors(exl3_state, "mtp.fc"))[: spec.hidden]
        rms = e.pow(2).mean(-1, keepdim=True).add(PUBLISHED_TEXT_FIXED["rms_norm_eps"]).rsqrt()
        head = torch.nn.functional.normalize((e * rms) @ w_top, dim=-1)
    rows = torch.zeros(spec.vocab, spec.hidden)
    for t in range(ORDINARY):
        rows[nxt[t]] += trunk[t]
        if spec.mtp_layers:
            rows[nxt[nxt[t]] if wrong[t] else nxt[t]] += head[t]
    scale = LOGIT / spec.hidden**0.5  # the final norm leaves a hidden state of norm sqrt(hidden)
    head_dtype = exl3_state["lm_head.weight"].dtype
    exl3_state["lm_head.weight"] = (rows * scale).to(head_dtype)
    if dense_state is not None:
        for key in (emb_key, norm_key, "lm_head.weight"):
            dense_state[key] = exl3_state[key].to(torch.float32)
    return {
        "rate": rate,
        "right_tokens": ORDINARY - sum(wrong),
        "ordinary_tokens": ORDINARY,
        "quiet": QUIET,
        "logit": LOGIT,
        "expected": {f"k{k}": expected_acceptance(rate, k) for k in (1, 2, 3)},
    }
