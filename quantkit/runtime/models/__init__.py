"""Model definitions on the runtime's layers."""
