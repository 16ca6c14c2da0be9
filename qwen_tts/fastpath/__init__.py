"""The CUDA fast path: kernels grouped by op, which the engine hands to the model for its decode steps."""
