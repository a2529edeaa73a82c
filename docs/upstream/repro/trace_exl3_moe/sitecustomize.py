"""Diagnostic: logs the first eager and captured calls of aphrodite._custom_ops.exl3_moe (rows, num_active, whether
the stream captures) and the first eager caller's stack; put this folder on a server's PYTHONPATH
(docs/upstream/exl3-moe-context-in-capture.md)."""

import importlib.abc
import importlib.util
import sys
import traceback

_seen = {"eager": 0, "capture": 0}


def _wrap(mod):
    original = mod.exl3_moe

    def exl3_moe(*args, **kwargs):
        import torch

        capturing = torch.cuda.is_current_stream_capturing()
        key = "capture" if capturing else "eager"
        _seen[key] += 1
        if _seen[key] <= 3 or (key == "capture" and _seen["capture"] == 1):
            na = kwargs.get("num_active", args[-1] if args else None)
            x = args[0] if args else None
            print(
                f"TRACE exl3_moe {key} #{_seen[key]} num_active={na} rows={getattr(x, 'shape', None)}"
                f" eager_before={_seen['eager']}",
                file=sys.stderr,
                flush=True,
            )
            if key == "eager" and _seen[key] == 1:
                traceback.print_stack(limit=14, file=sys.stderr)
        return original(*args, **kwargs)

    mod.exl3_moe = exl3_moe


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "aphrodite._custom_ops":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = run
        return spec


sys.meta_path.insert(0, _Finder())
