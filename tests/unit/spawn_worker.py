"""The body of a process started with the spawn method (kept free of test imports)."""

import pickle


def run(pickled_method: bytes, queue) -> None:
    # As an engine worker: the quant method arrives pickled before plugins run.
    method = pickle.loads(pickled_method)
    from aphrodite.plugins import load_general_plugins

    load_general_plugins()
    layer = type("L", (), {"prefix": "model.layers.0.linear_attn.in_proj_qkv"})()
    queue.put(repr(method._shard_ids_for_layer(layer, [256, 256, 512])))
