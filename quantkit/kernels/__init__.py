"""Kernels: a pure-torch reference for every op (the test oracle) and PyTorch's packed CPU matmuls.

Only `runtime/layers` calls into this package; the choice of kernel is made once per engine.
"""
