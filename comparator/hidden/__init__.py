"""Hidden-state comparison: alignment, the row kernels, streamed metrics, the verdict and its onset."""
