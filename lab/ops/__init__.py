"""What the models compute with: the flat batch layout (``batch``: ``AttnMeta``, ``PackedBatch``), attention
dispatch (``attention``: Triton on CUDA, torch or prefill-lab's C kernel elsewhere), the GEMM fast paths
(``gemm``: BLAS or oneDNN, packed or widened weights, fused epilogues), the CPU fast-path probes (``probes``) and
one engine's choices among them (``plan.CpuPlan``). Imports nothing of ``lab`` but ``lab.kernels``."""
