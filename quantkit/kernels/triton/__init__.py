"""Triton kernels for the GPU: W4A16/W8A16 GEMM with in-kernel dequantisation, paged decode attention
reading FP8 (or float) KV blocks with their scales, and the KV store that quantises on write.

Tested on CPU under `TRITON_INTERPRET=1` against `kernels.reference`, and on a GPU by
`scripts/gpu_check.py` when one is lent. Import only where triton is installed (`pip install quantkit[gpu]`).
"""
