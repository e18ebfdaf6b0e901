"""Triton implementations: fused RMSNorm, fused SwiGLU, and a grouped-GEMM SwiGLU MoE MLP.

Each is a `torch.library` custom op (titanite::*) with a fake (meta) implementation and an
autograd registration whose backward is another Triton custom op, so torch.compile and FSDP
treat them as single opaque ops. The kernel modules import `triton` lazily, on first call.

Where they run: any device Triton has a backend for (CUDA, ROCm, XPU) and, for tests, the CPU
under `TRITON_INTERPRET=1`. The interpreter runs no autotuning (fixed small tiles instead) and
computes `tl.dot` on bfloat16 inputs wrongly, so kernels that use `tl.dot` do not offer
bfloat16 there.

`availability.py` says where they run; `ops.py` registers the ops (imported by `titanite.kernels`).
"""
