"""What every serving driver shares: the prompts of a level and the one formula its figures come from.

bench/serving_http.py (aphrodite over HTTP) and bench/exllamav3_generator.py (exllamav3's generator in its own
process) time each token the moment it reaches them and hand the same per-request spans to :func:`figures`, so
that two engines measured by bench/same_run.py are compared on one formula:

- decode tok/s = completed requests x (output - 1) / (last token of any request - first token of any request);
- per-request tok/s = mean over requests of (output - 1) / (its last token - its first token);
- active = the largest number of requests streaming at one moment: the most [first token, last token] spans that
  contain one instant. A level is a batch of N only where active == N; an engine that holds some requests back
  (a full cache, a batch limit) streams them after others have ended and shows a smaller figure.
"""

from __future__ import annotations

import statistics

FORMULA = (
    "decode tok/s = completed requests x (output - 1) / (last token of any request - first token of any request); "
    "per-request tok/s = mean over requests of (output - 1) / (its last token - its first token); each token timed "
    "the moment it reached the driver (aphrodite: the streamed chunk at the openai client; exllamav3: the result "
    "iterate() handed over)"
)


def prompts(n: int, length: int, vocab: int, seed: int = 0, pool: tuple[int, int] | None = None) -> list[list[int]]:
    """N prompts of random ids, the same for one seed in every driver: from ``pool`` (``[lo, hi)``: one token pool of
    a make-tiny ``--mtp-acceptance`` checkpoint, whose requests then follow that pool's cycle at its rate), else from
    1000 up to the vocabulary's end."""
    import random

    rng = random.Random(seed)
    # ids 1000.. avoid the special and added tokens at the start of Qwen-family vocabularies
    lo, hi = pool if pool is not None else (1000, vocab)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def level_seed(concurrency: int, repeat: int = 0) -> int:
    """The prompts' seed of one measured level: its own for every (concurrency, repeat), the same for every engine.

    A prompt sent twice is answered from cache in part: aphrodite 0.23.0+ cache prefixes of hybrid models by
    default (in whole attention blocks, so a bfloat16 state's 400-token block hits on a 512-token prompt where a
    float32 state's 784-token block does not), and exllamav3's dynamic generator can reuse the cached pages of a
    prompt it has seen. Fresh prompts per level keep the cache out of every measured level; the warm-up seeds
    (:func:`warmup_seed`, 98 and 99) are apart.
    """
    return 1_000_000 + 1_000 * repeat + concurrency


def warmup_seed(concurrency: int) -> int:
    """The prompts' seed of a level's unmeasured warm-up (bench/same_run.py runs every measured shape once first):
    apart from every :func:`level_seed`, so that no measured level finds its prompts cached."""
    return 2_000_000 + concurrency


def max_active(spans: list[tuple[float, float]]) -> int:
    """The most (first, last) spans that contain one instant (a span's ends included)."""
    events = sorted([(first, 0) for first, _ in spans] + [(last, 1) for _, last in spans])
    active = best = 0
    for _, kind in events:  # at equal times a start (0) sorts before an end (1): touching spans overlap
        active += 1 if kind == 0 else -1
        best = max(best, active)
    return best


def figures(n: int, output: int, ttft: list[float], spans: list[tuple[float, float]], wall: float) -> dict:
    """One level's figures from its completed requests: ``ttft`` their times to first token, ``spans`` their
    (first token, last token) times, ``wall`` the level's duration; ``n`` requests were sent."""
    decode = [(output - 1) / (last - first) for first, last in spans if last > first]
    span = max(last for _, last in spans) - min(first for first, _ in spans) if spans else 0
    done = len(spans)
    return {
        "concurrency": n,
        "completed": done,
        "failed": n - done,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(done * output / wall, 1) if wall else None,
        "decode_tok_s": round(done * (output - 1) / span, 1) if span else None,
        "per_request_tok_s": round(statistics.mean(decode), 1) if decode else None,
        "ttft_mean_s": round(statistics.mean(ttft), 3) if ttft else None,
        "ttft_max_s": round(max(ttft), 3) if ttft else None,
        "active": max_active(spans),
    }
