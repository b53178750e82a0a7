"""Hybrid models (Qwen3-Next, Qwen3.5) through supplementary tensors.

The cache-only hidden-state layer of ``extract_hidden_states`` gets a tensor of its own,
addressed by the full-attention group's block table, instead of a KV cache group of its
own.

- ``shapes``: pure arithmetic and config.json reading.
- ``spec``: CacheOnlySpec, the split, the KV cache configs.
- ``versions``: what differs between vLLM 0.32 and 0.33.
- ``runtime``: worker-side allocation, V1 and V2 drafters.
- ``plugin``: installation into vLLM.
- ``accounting`` and ``report``: the figures (``python -m hybrid.report``).

See docs/design.md, "Hybrid models through supplementary tensors".
"""
