"""The record of the converted weights whose FP8 copy is made from their FSDP2 shards, and the per-tensor weight
scales computed from it ONCE PER STEP, outside FSDP2's all-gather extension hooks (fixes/all_gather/fp8_all_gather.py).

FSDP2 calls ``fsdp_pre_all_gather`` on its all-gather copy-in stream, during an unshard, and gathers on its own
communicator: a collective issued there runs on the wrong stream and interleaves with FSDP2's (NCCL: a hang or a
race gloo cannot show). So the hooks only read what was decided before: :class:`WeightRecord` keeps, per converted
weight, its ``FSDPParam`` and the *stamp* its shard had when the FP8 decisions were last made — (the shard object,
the DTensor parameter's version counter, the shard's version counter). Every way a shard changes moves the stamp:

* an optimizer step (in-place on the DTensor parameter: its version counter), a user's in-place edit between steps
  (``with torch.no_grad(): p.mul_(...)``), ``load_state`` / DCP loads and ``load_state_dict`` (in-place copies into
  the local shard: its version counter), FSDP2 replacing the shard (``reset_sharded_param`` at its lazy init or
  after ``model.to()``: another shard object).
* Not seen: writes that bypass autograd's version counters (``p.data.copy_(...)``, ``p.detach().copy_(...)`` of
  another alias, raw storage writes). After those, call :meth:`WeightRecord.invalidate` (``accelerator.accel_fp8_fix.
  all_gather.weights_changed()``): the next forward recomputes.

:meth:`WeightScales.refresh` runs in a forward pre-hook of the prepared (root) model, placed before FSDP2's own (so
before its root unshard and, on a GPU, before its all-gather streams wait on the default stream): when any stamp
moved, ONE packed MAX all-reduce of every per-tensor weight's shard amax on the mesh's amax group, through the
package's collectives, and the scales written in place into buffers allocated once; gradient accumulation, the
backward re-gathers and recomputes reuse them. The hooks check their own weight's stamp (no collective): a gather
whose shard changed since the refresh — a forward that did not go through the prepared model after a change —
raises :class:`~accel_fp8_fix.fixes.start.fp8_all_gather_policy.Fp8AllGatherError` naming the weight, never a stale or
rank-local scale. The record is not specific to per-tensor scaling: every weight gathered in FP8 is in it (kind
``per_tensor``, ``per_expert`` or ``block``), for whatever else needs "which converted weights changed this step".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...distributed import collectives
from ...internals import torch_fsdp2, torch_internals
from ...internals import transformer_engine as te_internals
from ..start.fp8_all_gather_policy import Fp8AllGatherError

AMAX_NAME = "FP8 all-gather: packed weight amaxes"
# TE's scale formula and each recipe's settings of it: internals/transformer_engine/scaling.py


@dataclass
class RecordedWeight:
    name: str  # qualified name of the parameter, e.g. "model.layers.0.self_attn.q_proj.weight"
    fsdp_param: object
    kind: str  # "per_tensor", "per_expert" (packed experts: a scale per expert) or "block"
    stamp: tuple | None = None  # the shard's stamp when the FP8 decisions were last made (None: never / invalidated)


def shard_stamp(fsdp_param) -> tuple:
    """(the local shard object, the DTensor parameter's version, the shard's version): moves with every change."""
    shard = torch_fsdp2.sharded_local_tensor(fsdp_param)
    return id(shard), torch_fsdp2.version_of(torch_fsdp2.sharded_param(fsdp_param)), torch_fsdp2.version_of(shard)


class WeightRecord:
    """Every converted weight gathered in FP8, with its FSDP2 parameter and its shard's stamp."""

    def __init__(self):
        self.weights: list[RecordedWeight] = []

    def add(self, name: str, fsdp_param, kind: str) -> int:
        self.weights.append(RecordedWeight(name, fsdp_param, kind))
        return len(self.weights) - 1

    def of_kind(self, kind: str) -> list[int]:
        return [i for i, w in enumerate(self.weights) if w.kind == kind]

    def changed(self, indices) -> bool:
        """Whether any of these weights' shards changed since :meth:`mark_current`."""
        return any(self.weights[i].stamp != shard_stamp(self.weights[i].fsdp_param) for i in indices)

    def mark_current(self, indices) -> None:
        for i in indices:
            self.weights[i].stamp = shard_stamp(self.weights[i].fsdp_param)

    def check_current(self, i: int) -> None:
        """Raise, naming the weight, when its shard changed since the FP8 decisions were made (inside FSDP2's
        hook: nothing may be recomputed there)."""
        weight = self.weights[i]
        if weight.stamp != shard_stamp(weight.fsdp_param):
            raise Fp8AllGatherError(
                f"accel_fp8_fix: FP8 all-gather of {weight.name}: its shard changed since the weight scales were "
                "computed (they are computed once per step, in a forward pre-hook of the prepared model). Run the "
                "forward through the model accelerator.prepare returned (not a submodule, not FSDPModule.unshard() "
                "alone) after changing weights; after a write that bypasses version counters (p.data.copy_) call "
                "accelerator.accel_fp8_fix.all_gather.weights_changed() first")

    def invalidate(self) -> None:
        for weight in self.weights:
            weight.stamp = None

    def first_row(self, i: int) -> int:
        """The row of the whole (global) parameter where this rank's shard starts: FSDP2's dim-0 chunk, inside the
        rows other mesh dims give this rank (expert parallelism's ``ep``)."""
        return torch_internals.global_row_offset(torch_fsdp2.sharded_param(self.weights[i].fsdp_param))

    def first_unsharded_row(self, i: int) -> int:
        """The global row where the tensor FSDP2 gathers for this rank starts (its shard's start less FSDP2's own
        chunks before it)."""
        fsdp_param = self.weights[i].fsdp_param
        return self.first_row(i) - torch_fsdp2.shard_rank(fsdp_param) * torch_fsdp2.padded_shard_size(fsdp_param)[0]

    def shards(self, indices) -> list:
        return [torch_fsdp2.sharded_local_tensor(self.weights[i].fsdp_param) for i in indices]


class WeightScales:
    """The per-tensor scales of every whole ``per_tensor`` weight of ``record`` — one scale per weight, or one per
    expert of a packed-experts weight ``[E, out, in]`` (FSDP2 shards dim 0: each shard holds whole experts) — from
    ONE packed amax all-reduce per change (:meth:`refresh`), kept in buffers allocated once: the quantizers and the
    all-gather metadata read views of them, so no hook allocates a scale or issues a collective."""

    def __init__(self, record: WeightRecord, group, params):
        self.record, self.group, self.params = record, group, params
        self.indices: list[int] = []  # this object's weights, in record order
        self.slots: list[tuple[int, int]] = []  # per weight: (first slot, slots): 1, or E for experts
        self.scale = self.scale_inv = None  # fp32 [slots in all], allocated at the first refresh
        self.weight_quantizers: list = []  # per slot: TE's Float8Quantizer on a view of ``scale``
        self.scale_inv_views: list = []  # per weight: the metadata each gather passes (a view of ``scale_inv``)
        self.reductions = 0  # packed amax all-reduces so far

    def add(self, record_index: int, experts: int = 0) -> int:
        """Add a weight (``experts``: its count of per-expert scales; 0: one scale); its index here."""
        first = sum(n for _, n in self.slots)
        self.indices.append(record_index)
        self.slots.append((first, experts or 1))
        self.scale = None
        return len(self.indices) - 1

    def quantizers_of(self, j: int) -> list:
        first, count = self.slots[j]
        return self.weight_quantizers[first:first + count]

    def _allocate(self, device) -> None:
        """Normal tensors even when the first forward runs under ``torch.inference_mode()`` (an evaluation before
        training): an inference tensor could not be written in place by a later training step's refresh."""
        n = sum(count for _, count in self.slots)
        with torch.inference_mode(False):
            self.scale = torch.ones(n, dtype=torch.float32, device=device)
            self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
            self.weight_quantizers = [te_internals.float8_quantizer(self.scale[k:k + 1], self.params.fp8_dtype)
                                      for k in range(n)]
            self.scale_inv_views = [self.scale_inv[first:first + count] for first, count in self.slots]

    def _local_amaxes(self, j: int, shard, device) -> torch.Tensor:
        """This rank's amax of weight ``j``: of the whole shard, or per expert (0 for experts other ranks hold)."""
        first, count = self.slots[j]
        if self.record.weights[self.indices[j]].kind != "per_expert":
            return shard.detach().abs().amax().float().reshape(1) if shard.numel() else torch.zeros(1, device=device)
        amax = torch.zeros(count, dtype=torch.float32, device=device)
        if shard.numel():
            start = self.record.first_row(self.indices[j])
            amax[start:start + shard.shape[0]] = shard.detach().abs().amax(dim=tuple(range(1, shard.dim()))).float()
        return amax

    def refresh(self) -> bool:
        """When any weight's shard changed: one packed MAX all-reduce of the shards' amaxes on the amax group, the
        scales written in place (TE's ``compute_scale_from_amax``). True when it reduced."""
        if not self.indices or (self.scale is not None and not self.record.changed(self.indices)):
            return False
        shards = self.record.shards(self.indices)
        device = shards[0].device
        if self.scale is None or self.scale.device != device:
            self._allocate(device)
        with torch.no_grad():
            amax = torch.cat([self._local_amaxes(j, t, device) for j, t in enumerate(shards)])
            if self.group is not None:
                collectives.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.group, name=AMAX_NAME)
            scale = te_internals.scales_from_amaxes(amax, self.params)
            self.scale.copy_(scale)
            self.scale_inv.copy_(torch.reciprocal(scale))
        self.record.mark_current(self.indices)
        self.reductions += 1
        return True
