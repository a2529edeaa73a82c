"""The patches, one module per patched aphrodite file, at that file's own path in aphrodite's tree
(``_custom_ops.py`` patches ``aphrodite/_custom_ops.py``); a file several patches touch is a package of one module
per patch (``model_executor/layers/quantization/exl3/``). Each module's docstring: Why / How / Probe / Upstream /
Retire when."""
