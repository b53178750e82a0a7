"""Stand-in for ``vllm/vllm_flash_attn/__init__.py`` of vLLM 0.33 on a GPU host its flash
attention kernels (``_vllm_fa2_C``, ``_vllm_fa3_C``, 165 MB compressed) cannot reach.

vLLM's original raises ImportError when neither kernel loads, and Llama's module imports
it unguarded on CUDA (through ``layers/attention/mm_encoder_attention.py`` and
``v1/attention/backends/fa_utils.py``), so no model would load. This one exports the same
names from vLLM's own ``flash_attn_interface`` without raising: it reports no flash
attention version as supported, vLLM picks none, and the engine tier runs Triton
attention, which never calls these functions.
"""

from vllm.vllm_flash_attn.flash_attn_interface import (  # noqa: F401
    FA2_AVAILABLE,
    FA3_AVAILABLE,
    compile_flash_attn_varlen_func_from_specs,
    fa_version_unsupported_reason,
    flash_attn_varlen_func,
    get_scheduler_metadata,
    is_fa_version_supported,
)

__all__ = [
    "compile_flash_attn_varlen_func_from_specs",
    "fa_version_unsupported_reason",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "is_fa_version_supported",
]
