"""Context parallelism's shape rules, named when the CP context is entered (A23 in docs/failures.md).

accelerate's ``maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)`` opens torch's
``context_parallel`` on the ``cp`` mesh dim: every buffer's sequence dim is cut into ``cp`` shards in place — with
torch's head-tail load balancer (causal attention's work evened out) into ``2·cp`` chunks, two per rank, but only
when the first buffer's length divides by ``2·cp``; otherwise torch turns the balancer off without a word
(``_create_default_load_balancer``). Each rank's Transformer Engine GEMMs then see ``batch × S / cp`` tokens: the
FP8 token rule (``fp8_shapes.py``) applies to the CP shard, not to the batch the data pipeline padded.

What goes wrong without a check: a length not divisible by ``cp`` fails deep inside torch's ring (uneven chunks:
a shape mismatch in ``torch.cat`` / the merge, naming no buffer); buffers of different lengths are split by the
first one's balancer; a shard that breaks the FP8 rule fails at TE's assertion. Checked here, before torch shards
anything (every rank runs the same check on the same shapes: no rank raises alone):

- each buffer's length on its sequence dim divisible by ``cp_size``, and all the same length;
- with FP8 on (this package's prepare converted the model): the CP shard's tokens (the first buffer's
  ``numel / cp``) a multiple of the training token multiple — the recipe's (``fp8_shapes.recipe_multiples``) and
  16, cuBLASLt's FP8 leading-dimension rule for the weight-gradient GEMM, whose inner dim is the tokens on
  Hopper's TN-only FP8 GEMMs (the rehearsal refuses it as TE does: "Leading dimension requirement on A for FP8
  GEMM. Caller must pad.");
- refused: ``ValueError`` naming the buffer (its index, shape and sequence dim), ``cp_size`` and the pad multiple
  that satisfies all of it for any batch (``cp × lcm(2, token multiple)``);
- divisible by ``cp`` but not ``2·cp``: a warning, once per process and length (torch's balancer is off) — refused
  on torch < 2.13, whose ``context_parallel`` builds no balancer for such a length but leaves
  ``_cp_options.enable_load_balance`` on, so the ring cuts the shards as if balanced and fails (a bare
  ``AssertionError``; 2.13 sets the option from the balancer it built).

And on torch < 2.13, an exception inside the context (an OOM a script retries, a refusal it catches) leaves torch's CP
dispatch on — ``F.scaled_dot_product_attention`` still the ring's wrapper for every later call, CP or not — as
2.11 / 2.12's ``context_parallel`` turns it off after its ``yield`` with no ``finally``; 2.13 has the ``finally``.
The context returned here turns it off then (``internals.torch_context_parallel``), the exception unchanged.
"""

from __future__ import annotations

import contextlib
import math

from ..._log import warn_user

from ..convert.fp8_shapes import WGRAD_TOKENS_MULTIPLE


def pad_multiple(cp_size: int, token_multiple: int) -> int:
    """The sequence multiple that keeps CP shards even, torch's load balancer on and every CP shard's tokens a
    multiple of ``token_multiple`` whatever the batch: ``cp × lcm(2, token_multiple)``."""
    return cp_size * math.lcm(2, token_multiple)


def training_token_multiple(recipe_tokens: int) -> int:
    """What a training step's tokens per rank must be a multiple of: the recipe's and the weight-gradient GEMM's."""
    return math.lcm(recipe_tokens, WGRAD_TOKENS_MULTIPLE)


def token_multiple_of(recipe_class: str) -> int:
    """The training token multiple for the TE recipe class named ``recipe_class``."""
    from ..convert import fp8_shapes

    recipe_tokens = {"MXFP8BlockScaling": fp8_shapes.MXFP8_MULTIPLE, "NVFP4BlockScaling": fp8_shapes.NVFP4_MULTIPLE,
                     "Float8BlockScaling": fp8_shapes.BLOCK_TOKENS_MULTIPLE}.get(recipe_class,
                                                                                 fp8_shapes.FP8_LEADING_MULTIPLE)
    return training_token_multiple(recipe_tokens)


def _token_multiple(accelerator) -> int | None:
    """The training token multiple of this accelerator's recipe, or None when this package did not turn FP8 on."""
    from ..convert.fp8_shapes import recipe_multiples

    setup = getattr(accelerator, "accel_fp8_fix", None)
    if setup is None or not getattr(setup, "fp8_enabled", False):
        return None
    return training_token_multiple(recipe_multiples(setup.recipe)[0])


def check_buffers(buffers, seq_dims, cp_size: int, token_multiple: int | None) -> list[str]:
    """What is wrong with ``buffers`` (tensors) sharded on ``seq_dims`` over ``cp_size`` ranks, each problem naming
    the buffer and the fix; empty when they fit. ``token_multiple``: the FP8 recipe's, None when FP8 is off."""
    multiple = pad_multiple(cp_size, token_multiple or 1)
    fix = (f"pad every sequence to a multiple of {multiple} (cp_size {cp_size}"
           + (f" x the FP8 token multiple {token_multiple}" if token_multiple else " x 2") + ", e.g. the collator's "
           f"pad_to_multiple_of={multiple}), and pass no attention mask under CP")
    problems = []
    if len(buffers) != len(seq_dims):
        return [f"{len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims: give one sequence dim per buffer"]
    lengths = []
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        shape = list(getattr(buffer, "shape", ()))
        if not -len(shape) <= dim < len(shape):
            problems.append(f"buffer {i} (shape {shape}) has no sequence dim {dim}")
            continue
        length = shape[dim]
        lengths.append(length)
        if length % cp_size:
            problems.append(f"buffer {i} (shape {shape}) has sequence length {length} on dim {dim}, not divisible by "
                            f"cp_size {cp_size} (torch's CP cuts it into {cp_size} equal shards): {fix}")
    if len(set(lengths)) > 1:
        problems.append(f"the buffers' sequence lengths differ ({lengths}): torch's CP shards all of them by the "
                        f"first one's layout; give every buffer the same sequence length")
    if not problems and token_multiple and buffers:
        first = buffers[0]
        tokens = first.numel() // cp_size
        if tokens % token_multiple:
            problems.append(
                f"buffer 0 (shape {list(first.shape)}) leaves each CP rank {tokens} tokens (batch x sequence / cp_size "
                f"{cp_size}), not a multiple of {token_multiple}: Transformer Engine's FP8 GEMMs need it per rank (the "
                f"recipe's rule and cuBLASLt's FP8 leading dimension in the weight-gradient GEMM): {fix}")
    return problems


def maybe_context_parallel(wrapped, instance, args, kwargs):
    """``Accelerator.maybe_context_parallel``: the shape rules first, when CP is on (else stock, untouched)."""
    pc = getattr(instance, "parallelism_config", None)
    if pc is None or not getattr(pc, "cp_enabled", False) or getattr(pc, "cp_backend", "torch") != "torch":
        return wrapped(*args, **kwargs)
    buffers, seq_dims = _buffers(*args, **kwargs)
    cp_size = int(pc.cp_size)
    problems = check_buffers(buffers, seq_dims, cp_size, _token_multiple(instance))
    if problems:
        raise ValueError("accel_fp8_fix: maybe_context_parallel: " + "; ".join(problems))
    if buffers:
        length = buffers[0].shape[seq_dims[0]]
        if length % (2 * cp_size) and not balancer_follows_length():
            raise ValueError(
                f"accel_fp8_fix: maybe_context_parallel: sequence length {length} is not a multiple of 2 x cp_size = "
                f"{2 * cp_size}: torch {_torch_version()}'s context parallelism then runs its causal load balancer's "
                f"chunking without a balancer and fails (fixed in torch 2.13); pad to a multiple of {2 * cp_size}")
        if length % (2 * cp_size):  # warn_user says it once per process
            warn_user(f"accel_fp8_fix: maybe_context_parallel: sequence length {length} is not a multiple of "
                      f"2 x cp_size = {2 * cp_size}: torch turns its causal load balancer off (rank {cp_size - 1} "
                      f"gets most of the attention work); pad to a multiple of {2 * cp_size}")
    if context_exits_on_error():
        return wrapped(*args, **kwargs)
    return _dispatch_off_on_error(wrapped(*args, **kwargs))


@contextlib.contextmanager
def _dispatch_off_on_error(context):
    """``context`` (accelerate's CP context); when an exception leaves it, CP's dispatch turned off if torch left it
    on — the ``finally`` torch < 2.13's ``context_parallel`` lacks."""
    from ...internals import torch_context_parallel

    try:
        with context:
            yield
    except BaseException:
        if torch_context_parallel.dispatch_left_on():
            torch_context_parallel.turn_dispatch_off()
        raise


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def balancer_follows_length() -> bool:
    """torch >= 2.13: ``context_parallel`` turns the load balancer off for a length it cannot balance."""
    from packaging.version import Version

    return Version(_torch_version()) >= Version("2.13")


def context_exits_on_error() -> bool:
    """torch >= 2.13: ``context_parallel`` turns CP's dispatch off in a ``finally``, an exception's exit included."""
    from packaging.version import Version

    return Version(_torch_version()) >= Version("2.13")


def _buffers(buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
    return list(buffers or []), list(buffer_seq_dims or [])
