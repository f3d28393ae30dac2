"""What the suite's scenarios and the benchmarks share: toy models, their batches, and one training comparison.

    from accel_fp8_fix.testing.training import block_stack, dense_batch, train_and_compare, train_reference

* Models: :class:`Block` / :class:`BlockStack` (plain torch: pre-norm MLP blocks and a head; ``Block`` is the FSDP2
  wrap unit found by class name), :func:`block_stack`, :func:`tiny_llama` (a ``transformers`` Llama from a config,
  no download); batches: :func:`dense_batch`, :func:`token_batch` — each seeded, so every rank builds the same one.
* :func:`train` — the one training loop: ``steps`` SGD steps, the loss from ``loss_of(model)``, the gradient norm
  clipped to ``max_norm``; in one process (``loss.backward()``, torch's ``clip_grad_norm_``) or through an
  ``Accelerator`` (``accelerator.backward``, ``accelerator.clip_grad_norm_``), optionally under Transformer Engine's
  autocast (``recipe``). Returns (losses, clipped grad norms) per step.
* :func:`train_reference` — the one-process reference a multi-rank run is compared with: the model built, converted
  to TE (``convert``) and trained by :func:`train`, TE's global FP8 state reset at the end.
* :func:`train_and_compare` — a run through :func:`train` next to a reference: the losses and norms of both and the
  steps where they differ beyond ``rtol`` / ``atol`` (``mismatches``, each naming its step); ``check=True`` raises.

Import cost: torch only. transformers, Transformer Engine and accelerate are imported inside the functions that need
them, so ``import accel_fp8_fix.testing.training`` stays as cheap as torch.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

__all__ = ["DIM", "Block", "BlockStack", "block_stack", "tiny_llama", "dense_batch", "token_batch", "train",
           "train_reference", "train_and_compare", "compare", "reset_te_global_state"]

DIM = 64  # every Linear dim is a multiple of 16 (TE's FP8 GEMM requirement) unless a scenario says otherwise


# -- models ---------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``; ``norm=False``: no LayerNorm; ``bias=False``: bias-free Linears."""

    def __init__(self, dim: int, hidden: int, norm: bool = True, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else None
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x if self.norm is None else self.norm(x))))


class BlockStack(nn.Module):
    """``depth`` Blocks and a Linear head to ``out``; ``buffer=True`` scales the input by a persistent plain buffer
    ``scale`` (it is in ``state_dict()``)."""

    def __init__(self, dim: int, hidden: int, depth: int, out: int, buffer: bool = False, norm: bool = True,
                 bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden, norm=norm, bias=bias) for _ in range(depth))
        self.head = nn.Linear(dim, out, bias=bias)
        if buffer:
            self.register_buffer("scale", torch.full((dim,), 0.5))
        else:
            self.scale = None

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_stack(dim: int = DIM, hidden: int = 2 * DIM, depth: int = 2, out: int = 16, buffer: bool = False,
                seed: int = 0):
    """A :class:`BlockStack` (pre-norm MLP blocks and a head) initialised from ``torch.manual_seed(seed)``.

    ``buffer=True`` adds a persistent plain buffer ``scale`` (it is in ``state_dict()``; A5).
    """
    torch.manual_seed(seed)
    return BlockStack(dim, hidden, depth, out, buffer)


def tiny_llama(hidden: int = DIM, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 2 * DIM,
               vocab: int = 256, seed: int = 0, **config_kwargs):
    """A small ``transformers`` ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download), fp32, eval-free."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **config_kwargs,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_batch(vocab: int = 256, batch: int = 2, seq: int = 16, seed: int = 1):
    """``{"input_ids", "labels"}``: ``batch`` x ``seq`` random tokens (labels the same ids) from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def dense_batch(dim: int = DIM, batch: int = 8, seed: int = 1):  # 8 tokens: TE FP8 GEMMs need multiples of 8
    """``(x, y)``: ``batch`` x ``dim`` inputs and ``batch`` x 16 targets from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, 16, generator=g)


# -- training -------------------------------------------------------------------------------------------------------
def reset_te_global_state():
    """TE's global amax buffers outlive a model: a reference trained in a rank leaves none behind."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.9
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reset()


def _value(tensor) -> float:
    """A loss or norm as a float: the whole mesh's value of a DTensor."""
    tensor = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    return float(tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)


def _logged_norm(norm) -> float:
    """``accelerator.clip_grad_norm_``'s norm as a training script logs it. With the fixes on, float() of it must
    already be the whole mesh's (A17); stock accelerate (rehearsal-only runs) on torch 2.9 returns a Partial DTensor
    whose float() is one rank's share, so there the norm is gathered first."""
    from .._api import active_patch_set

    if active_patch_set() is None and hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def train(model, loss_of, *, steps: int, max_norm: float, optimizer=None, lr: float | None = None,
          momentum: float | None = None, accelerator=None, recipe=None, fp8: bool = True, criterion=None,
          around_backward=None, after_first_backward=None) -> tuple[list, list]:
    """(losses, clipped grad norms) of ``steps`` SGD steps of ``model`` on ``loss_of(model)``.

    ``optimizer``: the one to step (an accelerator's prepared one); without it ``SGD(lr[, momentum])`` is made here.
    ``accelerator``: backward and clipping through it, the loss and norm as the whole mesh's values; without it
    ``loss.backward()`` and torch's ``clip_grad_norm_`` in this process. ``recipe``: the forward under TE's autocast
    (FP8 on unless ``fp8=False``); ``criterion``: applied to ``loss_of``'s output after the autocast exits (the
    forward alone under it). ``around_backward(model)``: called before each forward, what it returns is called after
    that step's backward (e.g. weights swapped for leaves and back). ``after_first_backward(model)``: once, with step
    0's gradients in place, before clipping."""
    if optimizer is None:
        kwargs = {} if momentum is None else {"momentum": momentum}
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, **kwargs)
    if recipe is not None:
        import transformer_engine.pytorch as te

        from ..fixes.convert.fp8_autocast import te_autocast

        autocast = te_autocast(te)
    losses, norms = [], []
    for step in range(steps):
        after = around_backward(model) if around_backward is not None else None
        with autocast(fp8, recipe, None) if recipe is not None else contextlib.nullcontext():
            loss = loss_of(model)
        if criterion is not None:
            loss = criterion(loss)
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        if after is not None:
            after()
        if step == 0 and after_first_backward is not None:
            after_first_backward(model)
        if accelerator is not None:
            norms.append(_logged_norm(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_value(loss) if accelerator is not None else float(loss))
    return losses, norms


def train_reference(build, loss_of, *, steps: int, lr: float, max_norm: float, recipe=None, fp8: bool = True,
                    convert: dict | None = None, fsdp2_weight_path: bool = False, **train_kwargs) -> tuple[list, list]:
    """The one-process reference: (losses, clipped grad norms) of ``build()`` trained by :func:`train` in this
    process on the whole batch — what a multi-rank run of the same model, data and optimizer is compared with.

    ``convert``: the model's Linears (and MoE experts) converted to TE first, these the keyword arguments of
    ``fixes.convert.te_convert.convert_after_sharding`` (``{}``: every Linear); ``fsdp2_weight_path``: every
    converted module takes TE's FSDP2 weight path (``_is_fsdp2``: the FP8 weight re-quantized in backward, as on the
    FSDP2 ranks — the comparison exact rather than FP8-resolution). ``recipe``: a TE recipe (without an amax group:
    one process sees every sample's amax); with it TE's global FP8 state is reset at the end. The rest goes to
    :func:`train` (``momentum``, ``criterion``, ``around_backward``, ``after_first_backward``)."""
    model = build()
    if convert is not None:
        import transformer_engine.pytorch as te

        from ..fixes.convert.te_convert import convert_after_sharding

        convert_after_sharding(model, te, **convert)
    if fsdp2_weight_path:
        from ..internals.transformer_engine.modules import take_fsdp2_weight_path

        take_fsdp2_weight_path(model)
    result = train(model, loss_of, steps=steps, lr=lr, max_norm=max_norm, recipe=recipe, fp8=fp8, **train_kwargs)
    if recipe is not None:
        reset_te_global_state()
    return result


def compare(losses, norms, reference_losses, reference_norms, *, rtol: float = 0.0, atol: float = 0.0) -> list[str]:
    """The steps where a run's losses or clipped grad norms differ from the reference's beyond ``atol + rtol *
    |reference|`` (a step count that differs too), each as ``"step N: loss 1.25 vs reference 1.5"``."""
    out = []
    if (len(losses), len(norms)) != (len(reference_losses), len(reference_norms)):
        out.append(f"steps: {len(losses)} losses, {len(norms)} norms vs reference {len(reference_losses)}, "
                   f"{len(reference_norms)}")
    for what, got, want in (("loss", losses, reference_losses), ("grad norm", norms, reference_norms)):
        for step, (a, b) in enumerate(zip(got, want)):
            if not (math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or a == b):
                out.append(f"step {step}: {what} {a!r} vs reference {b!r}")
    return sorted(out, key=lambda line: (not line.startswith("step "), line))


def train_and_compare(model, loss_of, reference, *, steps: int, max_norm: float, rtol: float = 0.0,
                      atol: float = 0.0, check: bool = False, **train_kwargs) -> dict:
    """``model`` trained by :func:`train` (``accelerator=``, ``optimizer=`` / ``lr=``, ``recipe=`` ... as the
    scenario trains it) next to a one-process ``reference``: its (losses, norms), or a callable computing them after
    the run (e.g. ``lambda: train_reference(...)``; None: no reference). Returns ``{"losses", "grad_norms",
    "reference_losses", "reference_grad_norms", "mismatches"}`` — ``mismatches`` from :func:`compare` at ``rtol`` /
    ``atol`` (bit for bit by default); ``check=True`` raises AssertionError with them instead of returning any."""
    losses, norms = train(model, loss_of, steps=steps, max_norm=max_norm, **train_kwargs)
    if callable(reference):
        reference = reference()
    reference_losses, reference_norms = reference if reference is not None else (None, None)
    mismatches = ([] if reference is None else
                  compare(losses, norms, reference_losses, reference_norms, rtol=rtol, atol=atol))
    if check and mismatches:
        raise AssertionError("the run differs from its one-process reference:\n  " + "\n  ".join(mismatches))
    return {"losses": losses, "grad_norms": norms, "reference_losses": reference_losses,
            "reference_grad_norms": reference_norms, "mismatches": mismatches}
