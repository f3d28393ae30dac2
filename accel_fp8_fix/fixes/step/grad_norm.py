"""The grad norm ``Accelerator.clip_grad_norm_`` returns is the whole mesh's norm on every torch (A17).

On torch 2.7 and 2.9 (measured; any torch whose DTensor ``linalg_vector_norm`` strategy is ``reduction_linear``)
``torch.nn.utils.clip_grad_norm_`` over DTensor gradients returns the total norm as a *Partial* DTensor
(``_NormPartial``: each rank holds the norm of its own shards). The clipping itself is right (DTensor
arithmetic reduces the Partial before dividing), but ``float(norm)`` / ``norm.item()`` read the rank-local
value without reducing it: under FSDP2 x TP (dp_shard 2 x tp 2) the logged norm is about half the true
one, and any logic on it (skip a step on a large norm, loss-spike detection) acts on a wrong value. Newer
torch redistributes the Partial input of the norm and returns a ``Replicate`` DTensor.

The wrapper of ``Accelerator.clip_grad_norm_`` gives every torch the newer behaviour: a Partial total norm is redistributed to
``Replicate`` on its own mesh (one all-reduce per Partial mesh dimension, on the mesh's own groups). A
norm that is already ``Replicate`` (or a plain tensor) is returned untouched, so the wrapper is a no-op on
torch versions without the problem; no version number is consulted.
"""

from __future__ import annotations

from ...distributed.dtensor import is_dtensor


def replicated_norm(norm):
    """``norm`` with every ``Partial`` placement reduced (``Replicate``); anything else unchanged."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import Partial

    if not is_dtensor(norm) or not any(isinstance(p, Partial) for p in norm.placements):
        return norm
    placements = [Replicate() if isinstance(p, Partial) else p for p in norm.placements]
    return norm.redistribute(norm.device_mesh, placements)


def clip_grad_norm_(wrapped, instance, args, kwargs):
    """``Accelerator.clip_grad_norm_``: the returned total norm is reduced over the mesh (A17). Wrapping the
    public method covers accelerate 1.13 / 1.14 (torch's ``clip_grad_norm_`` called inline) and 1.15
    (``_clip_grad_norm_dtensor_aware``) alike. Error notes come from the ``notes`` hook its declaration names."""
    return replicated_norm(wrapped(*args, **kwargs))
