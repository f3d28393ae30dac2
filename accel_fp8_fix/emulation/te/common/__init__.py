"""Emulated ``transformer_engine.common`` (CPU emulation; no shared objects, no torch)."""

__emulated__ = True
