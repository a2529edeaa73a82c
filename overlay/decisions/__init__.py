"""The patches' torch-free decisions, each module named after its patch (its runtime half is the module of that
name under hybrid_exl3_fixes.aphrodite): which cache key a layer owns and what the runtime probe says (P3), which
GEMM launch a layer takes (P8), which path a 16 - 256-row call takes and how much memory kept weights may use
(P12). ``exl3_kernels`` holds what they read of the installed EXL3 kernel libraries. No torch, no aphrodite: doctor
and the CPU tests use them on any machine."""
