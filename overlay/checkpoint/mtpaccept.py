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

**Several rates in one checkpoint** (``--mtp-acceptance 0.63,0.85``): the ordinary tokens are split into equal
contiguous pools (:func:`token_pools`: 0..249 and 250..499), each a cycle of its own with its own wrong subset, so
that a request whose prompt is drawn from one pool follows that pool's cycle at that pool's rate. One set of engines
then measures every rate (bench/same_run.py ``--pool``), which a GPU that holds one set of engines needs. With one
rate the pool is all 500 tokens and the tensors are those written before pools existed.

**Full depth** (checkpoint/stream.py): the same tensors, layer by layer, with a float16 ``lm_head`` (an EXL3 head
would need the quantizer to hold these rows); the 64 quieted layers of the 27B leave the embedding's direction
dominant, as the engines' logged acceptance at the chosen rate shows (docs/make-tiny.md).
"""

from __future__ import annotations

from .tinyspec import PUBLISHED_TEXT_FIXED, SPECIAL_TOKENS

ORDINARY = min(SPECIAL_TOKENS.values())  # tokens 0..499: make-tiny's vocabulary below its special tokens
QUIET = 64.0  # every output projection's svh divided by this
LOGIT = 8.0  # the chosen token's logit, in nats above an unrelated token's (about)
OUT_PROJECTIONS = ("self_attn.o_proj", "linear_attn.out_proj", "down_proj")
MAX_POOLS = 4  # rates in one checkpoint: 125 tokens a cycle at the most


def rates_of(rate) -> tuple[float, ...]:
    """The chosen rates: one number, or a sequence of them (one token pool each, :func:`token_pools`)."""
    return tuple(rate) if isinstance(rate, (tuple, list)) else (rate,)


def check_rate(rate) -> None:
    rates = rates_of(rate)
    if not rates or len(rates) > MAX_POOLS:
        raise ValueError(f"mtp_acceptance takes 1 to {MAX_POOLS} rates, got {len(rates)}")
    for one in rates:
        if isinstance(one, bool) or not isinstance(one, (int, float)):
            raise ValueError(f"mtp_acceptance must be a number from 0 to 1, got {one!r}")
        if not 0 <= one <= 1:
            raise ValueError(f"mtp_acceptance must be from 0 to 1, got {one}")


def token_pools(rate) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each rate's tokens: the ordinary tokens split into equal contiguous ranges, one a rate. Each
    range is a cycle of its own, so a request whose prompt ends in a range stays in it: one checkpoint serves every
    rate, the prompt choosing (bench/level_figures.prompts ``pool``)."""
    n = len(rates_of(rate))
    return [(ORDINARY * i // n, ORDINARY * (i + 1) // n) for i in range(n)]


def cycle_and_wrong(rate, seed: int) -> tuple[list[int], list[bool]]:
    """``(nxt, wrong)``: the trunk's greedy successor of each ordinary token (one cycle through each token pool, in a
    seeded random order) and whether the MTP head is wrong at it (a seeded random subset of exactly
    ``round((1 - rate) * pool size)`` tokens of each pool)."""
    import random

    check_rate(rate)
    rng = random.Random(seed * 7919 + 17)
    nxt, wrong = [0] * ORDINARY, [False] * ORDINARY
    for (lo, hi), one in zip(token_pools(rate), rates_of(rate)):
        order = list(range(lo, hi))
        rng.shuffle(order)
        for i, t in enumerate(order):
            nxt[t] = order[(i + 1) % len(order)]
        for t in rng.sample(range(lo, hi), round((1.0 - one) * (hi - lo))):
            wrong[t] = True
    return nxt, wrong


def expected_acceptance(rate: float, k: int) -> dict:
    """What a speculative decoder with ``k`` tokens a step should log on this checkpoint, in expectation: the
    acceptance at each draft position (accepted there / drafts) and the mean accepted length per step."""
    per_position = [rate**j for j in range(1, k + 1)]
    return {"per_position": [round(p, 4) for p in per_position], "mean_accepted": round(sum(per_position), 4)}


def is_out_projection(prefix: str) -> bool:
    return prefix.endswith(OUT_PROJECTIONS)


def quiet(svh, torch):
    """An output projection's ``svh`` divided by QUIET (its output QUIET times smaller), float16 as exllamav3 keeps
    it."""
    return (svh.float() / QUIET).to(torch.float16)


def embedding(spec, torch):
    """The embedding the cycle is built on: standard normal, seeded by the spec, in the spec's dtype."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + 999)
    return torch.randn(spec.vocab, spec.hidden, generator=gen).to(getattr(torch, spec.dtype))


def mtp_norms(spec, torch) -> dict:
    """The MTP head's norms: ``pre_fc_norm_hidden`` -1 (scale 0: the trunk's hidden state ignored), the others 0."""
    keep = getattr(torch, spec.dtype)
    return {
        "mtp.pre_fc_norm_hidden.weight": torch.full((spec.hidden,), -1.0, dtype=keep),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(spec.hidden, dtype=keep),
        "mtp.norm.weight": torch.zeros(spec.hidden, dtype=keep),
    }


def head(spec, emb, fc_top, torch, dtype):
    """The ``lm_head`` (vocab x hidden, ``dtype``): the row of ``cycle(t)`` along the trunk's direction for ``t``, and
    the row the MTP head picks from ``t`` along ``a(t)`` (``fc_top``: the decoded ``mtp.fc``'s embedding half, I x O;
    None without an MTP head); every other row 0."""
    nxt, wrong = cycle_and_wrong(spec.mtp_acceptance, spec.seed)
    e = emb[:ORDINARY].float().cpu()
    trunk = torch.nn.functional.normalize(e, dim=-1)
    rows = torch.zeros(ORDINARY, spec.hidden)
    if fc_top is not None:
        rms = e.pow(2).mean(-1, keepdim=True).add(PUBLISHED_TEXT_FIXED["rms_norm_eps"]).rsqrt()
        a = torch.nn.functional.normalize((e * rms) @ fc_top.float().cpu(), dim=-1)
    for t in range(ORDINARY):
        rows[nxt[t]] += trunk[t]
        if fc_top is not None:
            rows[nxt[nxt[t]] if wrong[t] else nxt[t]] += a[t]
    out = torch.zeros(spec.vocab, spec.hidden, dtype=dtype)
    out[:ORDINARY] = (rows * (LOGIT / spec.hidden**0.5)).to(dtype)  # the final norm leaves a norm of sqrt(hidden)
    return out


def manifest_entry(spec) -> dict:
    rates = rates_of(spec.mtp_acceptance)
    _, wrong = cycle_and_wrong(spec.mtp_acceptance, spec.seed)
    pools = [
        {
            "rate": one,
            "tokens": [lo, hi],
            "right_tokens": hi - lo - sum(wrong[lo:hi]),
            "expected": {f"k{k}": expected_acceptance(one, k) for k in (1, 2, 3)},
        }
        for (lo, hi), one in zip(token_pools(spec.mtp_acceptance), rates)
    ]
    return {
        "rate": spec.mtp_acceptance if len(rates) == 1 else list(rates),
        "right_tokens": ORDINARY - sum(wrong),
        "ordinary_tokens": ORDINARY,
        "quiet": QUIET,
        "logit": LOGIT,
        "expected": pools[0]["expected"],
        "pools": pools,
    }


def shape(spec, exl3_state: dict, dense_state: dict | None, torch, codec) -> dict:
    """Shape the written state in place (module docstring); ``dense_state`` (the dense twin's, float32; None when
    no twin is written) gets the same values. Returns the manifest's ``mtp_acceptance`` entry."""
    emb_key, norm_key = "model.language_model.embed_tokens.weight", "model.language_model.norm.weight"
    # quiet decoder layers: the output scale of every output projection, and the dense twin's weight decoded again
    for key in [k for k in exl3_state if k.endswith(".svh") and is_out_projection(k[: -len(".svh")])]:
        prefix = key[: -len(".svh")]
        exl3_state[key] = quiet(exl3_state[key], torch)
        if dense_state is not None and prefix + ".weight" in dense_state:
            weight = codec.dense_weight(codec.linear_tensors(exl3_state, prefix))
            dense_state[prefix + ".weight"] = weight.t().contiguous()
    keep = exl3_state[emb_key].dtype
    exl3_state[emb_key] = emb = embedding(spec, torch).to(keep)
    exl3_state[norm_key] = torch.zeros(spec.hidden, dtype=keep)
    fc_top = None
    if spec.mtp_layers:
        exl3_state.update(mtp_norms(spec, torch))
        # y = x @ W; the embedding comes first in the head's concat
        fc_top = codec.dense_weight(codec.linear_tensors(exl3_state, "mtp.fc"))[: spec.hidden]
    exl3_state["lm_head.weight"] = head(spec, emb, fc_top, torch, exl3_state["lm_head.weight"].dtype)
    if dense_state is not None:
        for key in (emb_key, norm_key, "lm_head.weight"):
            dense_state[key] = exl3_state[key].to(torch.float32)
    return manifest_entry(spec)
