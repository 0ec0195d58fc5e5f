"""Attention and fused kernels. `kernels.reference` holds PyTorch versions of every kernel with
the signatures the Triton ones (CUDA) and the native CPU attention (`kernels.cpu`) share; the
engine picks one module by device. A module offers
`plan_attention(cu_seqlens_q, seq_lens, block_tables, block_size)` (made once per step, on the CPU,
passed to every layer's call; it may return None), `unified_attention(..., scale, plan)` and
`store_kv(key, value, k_cache, v_cache, slot_mapping)`."""
