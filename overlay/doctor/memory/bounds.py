"""How far each term of doctor's memory plan (arithmetic.plan) may be from what the engine will find, and the range of
KV pool and concurrency that leaves.

Every term gets ``low`` (it may be this many bytes smaller) and ``high`` (this many larger) with ``why``: the
calibration rows it rests on (bench/results/memory_plan.md: 0.21.0 on an H200, 0.24.1 on an H100), or the source it is
read from. Terms restated from aphrodite's code (requested memory, weights, LoRA buffers) carry none. The pool's range
is the plan's pool less the sum of the ``high`` bounds to plus the sum of the ``low`` ones; tokens and concurrency
follow through the KV layout. A pinned pool (``--kv-cache-memory-bytes``) has no such range: the engine skips profiling.

TP > 1 adds NCCL's lazily allocated connection buffers (arithmetic.plan's ``nccl_buffers``): the engine's profiling run
makes the first all-reduces, NCCL connects then (``NCCL_RUNTIME_CONNECT`` defaults to 1, NCCL 2.30.7
``src/init.cc``) and allocates one buffer per protocol and connection, LL 512 KiB, LL128 4,915,200 B and SIMPLE 4
MiB (``DEFAULT_LL_BUFFSIZE``, ``DEFAULT_LL128_BUFFSIZE``, ``DEFAULT_BUFFSIZE``), in GPU memory for the P2P and
NVLink transports and in host memory for SHM (PCIe GPUs without peer access). A ring channel has a send and a
receive connection; NCCL picks the channel count from the topology, at most MAXCHANNELS = 64
(``src/include/device.h``): doctor cannot see the topology, so the term is 0 with a bound of 16 channels, a figure
chosen here and not read from NCCL (``NCCL_MAX_NCHANNELS`` caps the count). The custom all-reduce and NCCL's
communicator are allocated before the engine's start-up snapshot (``gpu_worker.py`` ``init_device``, 0.20.0-0.24.1):
they do not shrink the pool, they lower the free memory that ``--gpu-memory-utilization`` must fit in.
"""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20

NCCL_BUFFERS_PER_CONNECTION = 512 * 1024 + 4_915_200 + 4 * MIB  # LL + LL128 + SIMPLE: 9.19 MiB
NCCL_CONNECTIONS_PER_CHANNEL = 2  # a ring channel: send and receive
NCCL_CHANNELS_BOUND = 16


def nccl_bound() -> int:
    return NCCL_CHANNELS_BOUND * NCCL_CONNECTIONS_PER_CHANNEL * NCCL_BUFFERS_PER_CONNECTION


def bound(name: str, value: int, big_gpu: bool) -> dict:
    """``low``, ``high`` and ``why`` of one term of ``value`` bytes; ``big_gpu``: the plan's GPU is of the H200 rows'
    size class (arithmetic.BIG_GPU_GIB or more), below which non-torch memory was never measured."""

    def b(low: int, high: int, why: str) -> dict:
        return {"low": int(low), "high": int(high), "why": why}

    if name == "load_overhead":
        return b(64 * MIB, 64 * MIB, "the calibration rows' largest miss of weights + load overhead, 0.04 GiB")
    if name == "exl3_moe_scratch":  # arithmetic.exl3_moe_scratch: C = SMs // 12 planned at an H200's 11
        return b(
            value * (2 if big_gpu else 10) // 11,
            value // 11,
            "C = SMs // 12, planned 11 (H200, H100): 9 on an A100, 10 on an RTX 4090, 6 on an RTX 3090, 12 on a B200",
        )
    if name == "activation_peak":
        return b(
            max(value // 10, 0.1 * GIB),
            max(value // 4, 0.15 * GIB),
            "-10 % / +25 %, at least -0.1 / +0.15 GiB: within 0.6 % on the 9B (0.21.0), within 8 % on 0.24.1's 9B "
            "rows, 0.11 GiB above the plan on 0.24.1's 4-layer MoE; on the held-out 27B rows the pool missed 0.65 "
            "GiB beyond the CUDA-graph term (22 % of this one)",
        )
    if name == "non_torch":
        if big_gpu:
            return b(
                0.08 * GIB,
                0.09 * GIB,
                "0.25-0.28 GiB on 0.21.0's H200 rows; 0.19-0.36 GiB on 0.24.1's H100 rows (total consumed less the "
                "weights and the runner's buffers), TP 1",
            )
        return b(value // 2, value, "not measured on a GPU under 70 GiB: half to twice the H200's 0.27 GiB")
    if name == "cudagraphs":
        return b(value * 0.21, value * 0.74, "logged / planned 0.79-1.73 on the calibration rows")
    if name == "vision_encoder":  # vision.py
        return b(
            value // 2,
            value // 2,
            "the encoder's peak counted from its live tensors: +/- half (0.24.1's 9B with the published tower: the "
            "vision rows' pools within 1.2 % of the plan, their torch peak 0.07 GiB under the text-only row's)",
        )
    if name == "nccl_buffers":
        return b(
            0,
            nccl_bound(),
            f"{NCCL_CHANNELS_BOUND} channels x {NCCL_CONNECTIONS_PER_CHANNEL} connections x 9.19 MiB (LL + LL128 + "
            "SIMPLE buffers) in GPU memory over P2P/NVLink; 0 over SHM",
        )
    if name == "exl3_kept_weights":
        return b(value, 0, "P12 keeps a layer only where the kept weight was measured faster: down to none of it")
    return b(0, 0, "restated from aphrodite's code")


def pool_range(terms: dict, available: int, layout: dict, max_model_len: int, big_gpu: bool, capacity) -> dict:
    """The bounds of every term, their sums, and the pool, tokens and concurrency at both ends.
    ``capacity`` is arithmetic.kv_capacity."""
    bounds = {name: bound(name, t["bytes"], big_gpu) for name, t in terms.items() if name != "requested"}
    low = sum(x["low"] for x in bounds.values())  # the terms may be this much smaller: the pool larger
    high = sum(x["high"] for x in bounds.values())
    ends = [max(0, available - high), max(0, available + low)]
    caps = [capacity(layout, pool, max_model_len) for pool in ends]
    return {
        "terms": bounds,
        "pool_minus_bytes": high,
        "pool_plus_bytes": low,
        "pool_bytes": ends,
        "pool_gib": [round(x / GIB, 3) for x in ends],
        "kv_cache_tokens": [c["kv_cache_tokens"] for c in caps],
        "max_concurrency": [c["max_concurrency"] for c in caps],
    }
