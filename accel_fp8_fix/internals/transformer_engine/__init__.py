"""Transformer Engine internals and version forks: every TE name this package reaches that TE does not export
(private modules, module-level functions, module globals it swaps), every fork between TE releases, decided once
per installed TE (as Megatron-core's ``fp8_utils.py`` keeps its TE version decisions in one place), and what the
package knows of TE's formats and formulas — one module per job:

- modules.py: a module's FP8 state (``fp8_meta``, recipe state, quantizers), ``num_gemms``, ``GroupedLinear`` on
  weights it does not own;
- recipes.py: the autocast API, ``FP8GlobalStateManager`` and ``check_*_support``, compute capability and GEMM
  layouts, TE's FP8-aware activation checkpoint;
- checkpoint.py: the ``_extra_state`` payload (its keys, TE's recipe module, the TE 1.x ``io.BytesIO`` format,
  stateless payloads) decoded without running code, and the extra-state pickle guard (TE 2.18+);
- scaling.py: FP8 types' largest values and TE's ``compute_scale_from_amax`` with each recipe's settings;
- float8_tensors.py: TE's quantized tensors built from FSDP2-gathered bytes (the opt-in FP8 all-gather);
- installed.py: the installed TE's version, its empty meta package, and :func:`check`, which gathers every job
  module's declared sources.

Nothing here imports TE at import time. :func:`check` reads TE's source (importing TE loads its CUDA libraries) when
the patch set is applied: a name that is gone refuses the set, naming it and the installed TE version. TE not
installed: nothing to check (TE is optional). The rest of the package imports the names below from here.
"""

from __future__ import annotations

from . import checkpoint, float8_tensors, installed, modules, recipes, scaling  # noqa: F401
from .checkpoint import (  # noqa: F401
    NonConformingExtraState, carries_no_state, decode_extra_state, has_pickle_guard, ignores_extra_state,
    loading_decoded, pickle_advisory,
)
from .float8_tensors import (  # noqa: F401
    FP8_ALL_GATHER_BLOCK_SOURCES, FP8_ALL_GATHER_SOURCES, block_rowwise, block_scale_shape,
    float8_block_weight_quantizer, float8_quantizer, float8_rowwise, fp8_all_gather_missing, make_float8,
    make_float8_blockwise, quantized_bits, refill_float8, refill_float8_blockwise,
)
from .installed import check, meta_package_only, te_version  # noqa: F401
from .modules import (  # noqa: F401
    FP8_STATE_ATTRS, GEMMS_PER_MODULE, GROUPED_WEIGHT_SOURCES, delayed_scaling_tensors, gemms_per_forward,
    grouped_linear_on_views, grouped_linear_without_weights, grouped_views_missing, has_fp8_state,
    init_fp8_metadata, keep_fp8_checkpoint, rebuild_quantizers,
)
from .recipes import (  # noqa: F401
    align_size_for_quantization, autocast_factory, device_compute_capability, extension_is_cpu_rehearsal,
    fp8_checkpoint, fp8_gemms_tn_only, fp8_global_state, support_check,
)
from .scaling import FLT_MAX, ScaleParams, fp8_max, fp8_weight_dtype, scale_params, scales_from_amaxes  # noqa: F401
