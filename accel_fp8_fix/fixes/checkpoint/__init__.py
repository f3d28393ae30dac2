"""Fixes of save and load: FP8 state through checkpoints (TE's pickle without the unsafe opt-in, expert parallelism),
TP-packed parameters and pure TP through DCP, and the full state dict loaded into the shards at prepare."""
