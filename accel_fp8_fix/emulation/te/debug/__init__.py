"""Emulated ``transformer_engine.debug`` (CPU emulation by accel_fp8_fix; not real Transformer Engine).

Only the piece the modules need: :class:`~.pytorch.debug_state.TEDebugState`, whose layer counter
gives TE modules built without ``name=`` their default name ``Layer_<n>`` (TE 2.20.2
``TransformerEngineBaseModule._validate_name``). The numerical-debugging features (nvdlfw_inspect,
DebugQuantizer, tensor stats) are not emulated.
"""

from . import pytorch  # noqa: F401
from .pytorch.debug_state import set_weight_tensor_tp_group_reduce  # noqa: F401

__emulated__ = True
