"""Attention and fused kernels. `kernels.reference` holds PyTorch versions of every kernel with
the signatures the Triton ones (CUDA) and the native CPU attention (`kernels.cpu`) share; the
engine picks one module by device. A module offers
`plan_attention(cu_seqlens_q, seq_lens, block_tables, block_size, num_heads, num_kv_heads)` (made
once per step, on the CPU, for a layer's head counts, passed to every layer's call),
`unified_attention(..., scale, plan)` and `store_kv(key, value, k_cache, v_cache, slot_mapping)`."""
