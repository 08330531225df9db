"""Model backends: one module per family, imported on demand."""
