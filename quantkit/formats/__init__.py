"""The checkpoint on disk: compressed-tensors packing, saving, loading and inspection."""
