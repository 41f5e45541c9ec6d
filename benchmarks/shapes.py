"""The KV block shapes benchmarks measure on, named once (bf16, 16-token blocks).

A benchmark that needs another dtype or block size derives it with dataclasses.replace. Holds
shapes only: no measuring, no tensors.
"""

from __future__ import annotations

from tierkv.layout import KVLayout

# Llama-3.1-8B: 32 layers, 8 KV heads, d=128: 2 MiB a block (the model of bench_rounds and most GPU figures)
LLAMA_3_1_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
# Qwen3-0.6B: 28 layers, 8 KV heads, d=128: 1.75 MiB a block (bench_throughput's and the fleet's model)
QWEN3_0_6B = KVLayout(num_layers=28, num_kv_heads=8, head_dim=128)
# SmolLM2-135M, the bundled model: 30 layers, 3 KV heads, d=64: 360 KiB a block
SMOLLM2_135M = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)
