"""Triton kernels, one file per kernel family. Each file opens with what it computes and
its roofline (bytes moved, FLOPs); each launcher checks shapes and picks block sizes.

Import the kernel files only where Triton is installed (``common.py``, the helpers they
share, imports no Triton); the ops decide when the kernels are used (the dispatch rule in
``minivllm.ops``) and fall back to the torch reference otherwise. Kernels import nothing
of the package above them. Tests run the same kernels on the CPU under ``TRITON_INTERPRET=1``.
"""
