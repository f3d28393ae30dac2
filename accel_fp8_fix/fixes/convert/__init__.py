"""Fixes of what ``prepare`` does to the sharded model: the FP8 plan, the transformers check, TP, the conversion to
TE on the shards (Linear, LayerNorm, packed MoE experts), the FP8 state and the forward under TE autocast."""
