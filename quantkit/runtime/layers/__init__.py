"""The runtime's building blocks; the only code that calls `quantkit.kernels`."""
