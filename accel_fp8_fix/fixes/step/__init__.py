"""Fixes of what runs during a training step: the grad norm clip_grad_norm_ returns, activation checkpointing's
recompute under FP8, context parallelism's shape rules."""
