"""Fixes of the FP8 all-gather under FSDP2 (opt-in): weights quantized on their shards and gathered as FP8, packed
MoE experts with per-expert scales, the record of the shards and the one weight-amax all-reduce per step."""
