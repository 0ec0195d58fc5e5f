"""Attention and fused kernels. `kernels.reference` holds PyTorch versions of every kernel with
the signatures the Triton ones will share; the engine picks one module by device."""
