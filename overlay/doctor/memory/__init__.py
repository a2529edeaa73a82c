"""doctor's memory plan and its terms: ``plan`` assembles the plan for a model folder (doctor's findings and the
plan's JSON); ``arithmetic`` restates the engine's own memory arithmetic term by term (pool, blocks, concurrency,
CUDA graphs); ``profile`` the per-release figures of the profiling run (weights in the model dtype, the peak, the
model runner's buffers); ``vision`` the vision encoder's share of the profiling run; ``bounds`` each term's bound and
the plan's range. Torch-free."""
