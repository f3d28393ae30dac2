"""Emulated ``transformer_engine.debug.pytorch.debug_state`` (checked against TE 2.20.2
debug/pytorch/debug_state.py). Same class attributes and class methods; ``_reset`` has no stats
buffers to clear (the debug features are not emulated), and the emulated modules never run debug
paths even when ``debug_enabled`` becomes True."""

import sys

__emulated__ = True


class TEDebugState:
    """
    A class to manage the state of debug layers.
    """

    layer_count = 1
    layers_initialized = {}
    weight_tensor_tp_group_reduce = True
    debug_enabled = None

    @classmethod
    def initialize(cls):
        """
        If debug_api module is initialized, then sets cls.debug_enabled to True.
        """

        if "nvdlfw_inspect" in sys.modules:
            import nvdlfw_inspect.api as debug_api

            if cls.debug_enabled is False and debug_api.DEBUG_MANAGER is not None:
                raise RuntimeError(
                    "[nv_dlfw_inspect] nv_dlfw_inspect module should be initialized before"
                    " initialization of the first TE module"
                )
            cls.debug_enabled = debug_api.DEBUG_MANAGER is not None

    @classmethod
    def _reset(cls):
        """Resets layer count and stats buffers (TE also resets its STATS_BUFFERS; none here)."""
        cls.debug_enabled = None
        cls.layers_initialized.clear()

    @classmethod
    def get_layer_count(cls):
        """
        Layer counter is used when layer names are not provided to modules by the user.
        """
        lc = cls.layer_count
        cls.layer_count += 1
        return lc

    @classmethod
    def set_weight_tensor_tp_group_reduce(cls, enabled):
        """Sets weight tensor reduction mode."""
        cls.weight_tensor_tp_group_reduce = enabled

    @classmethod
    def get_iteration(cls):
        """Returns the current iteration."""
        import nvdlfw_inspect.api as debug_api

        return debug_api.DEBUG_MANAGER._trainer_iteration_count


def set_weight_tensor_tp_group_reduce(enabled):
    """Sets weight tensor reduction mode."""
    TEDebugState.set_weight_tensor_tp_group_reduce(enabled)
