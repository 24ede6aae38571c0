"""Triton kernels, one file per kernel family. Each file opens with what it computes and
its roofline (bytes moved, FLOPs); each launcher checks shapes and picks block sizes.

Import this package only where Triton is installed; ``minivllm.ops.dispatch`` decides when
the kernels are used (tensors on a CUDA device) and falls back to the torch reference
otherwise. Tests run the same kernels on the CPU under ``TRITON_INTERPRET=1``.
"""
