"""Weight quantization algorithms: pure functions over tensors (never imports runtime or kernels)."""
