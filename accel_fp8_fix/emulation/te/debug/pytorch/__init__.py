"""Emulated ``transformer_engine.debug.pytorch`` (only ``debug_state``)."""

__emulated__ = True
