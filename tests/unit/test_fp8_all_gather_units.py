"""FP8 all-gather (fixes/all_gather/fp8_all_gather.py): the weight scales bit for bit against the CPU kernel shim's
``compute_scale_from_amax``, the shard alias that pickles as a plain tensor, the setting, and the refusals
``te_recipe_kwargs`` and ``doctor --launch`` give (the distributed behaviour: tests/distributed/test_fp8_all_gather.py).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from accel_fp8_fix import settings
from accel_fp8_fix.fixes.all_gather import fp8_all_gather as fp8_all_gather_fix
from accel_fp8_fix.fixes.start import fp8_all_gather_policy as policy
from accel_fp8_fix.internals.transformer_engine import scaling as te_scaling
from accel_fp8_fix.rehearsal.te_on_cpu import tex

ROOT = Path(__file__).resolve().parents[2]
AMAXES = [0.0, 1e-30, 1e-12, 3.0e-5, 0.1, 0.5, 1.0, 2.0, 3.14159, 448.0, 1000.0, 6.5e4, 1e38, math.inf, math.nan]


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("pow2,epsilon", [(False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-3)])
def test_scales_are_the_kernels_compute_scale_from_amax_bit_for_bit(fp8_max, pow2, epsilon):
    params = te_scaling.ScaleParams(fp8_dtype=None, fp8_max=fp8_max, force_pow_2=pow2, epsilon=epsilon)
    mine = te_scaling.scales_from_amaxes(torch.tensor(AMAXES, dtype=torch.float32), params)
    shim = torch.tensor([tex.scale_from_amax(a, fp8_max, pow2, epsilon) for a in AMAXES], dtype=torch.float32)
    assert torch.equal(mine.view(torch.int32), shim.view(torch.int32)), (mine, shim)


# TE's compute_scale_from_amax (transformer_engine/common/recipe/recipe_common.cuh; the same function in v2.18 and
# main at d0067d0, 2.20.0.dev0), worked through by hand for these inputs — not through the rehearsal's copy:
#   amax < epsilon -> amax = epsilon;  inf / 0 / NaN amax -> 1;  scale = __fdiv_rn(max_fp8, amax) (fp32, round to
#   nearest);  an infinite scale -> value_for_inf (FLT_MAX for fp32 input);  force_pow_2: bits & 0xFF800000.
# (amax, max_fp8, force_pow_2, epsilon) -> the scale's fp32 bits
TE_SCALES = [
    ((3.0, 448.0, False, 0.0), 0x43155555),  # 448 / 3 = 149.333... rounded to nearest in fp32
    ((3.0, 448.0, True, 0.0), 0x43000000),  # mantissa cleared: 128
    ((0.1, 448.0, False, 0.0), 0x458C0000),  # 448 / 0.1f = 4479.99993..., rounds to 4480
    ((1e-3, 448.0, False, 0.0), 0x48DABFFF),  # 447999.97
    ((1e-3, 448.0, False, 0.01), 0x472F0000),  # amax floored to epsilon: 448 / 0.01f = 44800
    ((0.0, 448.0, False, 0.0), 0x3F800000),  # zero amax: 1
    ((0.0, 448.0, False, 1e-3), 0x48DABFFF),  # zero amax floored to epsilon first: 448 / 1e-3f, not 1
    ((math.inf, 448.0, False, 0.0), 0x3F800000),  # infinite amax: 1
    ((math.nan, 448.0, False, 1e-3), 0x3F800000),  # NaN is not < epsilon, then 1
    ((1.401298464324817e-45, 448.0, False, 0.0), 0x7F7FFFFF),  # 448 / the smallest subnormal overflows: FLT_MAX
    ((1.401298464324817e-45, 448.0, True, 0.0), 0x7F000000),  # FLT_MAX's mantissa cleared: 2**127
    ((1e38, 448.0, False, 0.0), 0x04BE8EE2),  # a tiny normal scale
    ((3.14159, 57344.0, False, 0.0), 0x468E9A5B),  # E5M2's max
]


@pytest.mark.parametrize("inputs,bits", TE_SCALES, ids=[f"{a}-{m}-{p}-{e}" for (a, m, p, e), _ in TE_SCALES])
def test_scales_are_tes_compute_scale_from_amax_as_its_source_reads(inputs, bits):
    amax, fp8_max, pow2, epsilon = inputs
    params = te_scaling.ScaleParams(fp8_dtype=None, fp8_max=fp8_max, force_pow_2=pow2, epsilon=epsilon)
    scale = te_scaling.scales_from_amaxes(torch.tensor([amax], dtype=torch.float32), params)
    assert int(scale.view(torch.int32).item()) & 0xFFFFFFFF == bits, (float(scale), hex(bits))


def test_delayed_margin_divides_by_a_power_of_two_exactly():
    base = te_scaling.ScaleParams(fp8_dtype=None, fp8_max=448.0)
    margin = te_scaling.ScaleParams(fp8_dtype=None, fp8_max=448.0, margin=2)
    amax = torch.tensor([0.3, 7.0, 0.0], dtype=torch.float32)
    a, b = te_scaling.scales_from_amaxes(amax, base), te_scaling.scales_from_amaxes(amax, margin)
    assert torch.equal(b[:2], a[:2] / 4) and b[2] == 1.0  # amax 0: scale 1, as the kernel


def test_the_shard_alias_is_plain_for_ops_and_pickles_as_a_plain_tensor():
    base = torch.randn(6, 4)
    shard = base.as_subclass(fp8_all_gather_fix.Fp8AllGatherShard)
    assert type(shard * 2) is torch.Tensor and type(shard.detach()) is torch.Tensor
    assert type(torch.zeros_like(shard)) is torch.Tensor  # optimizer state
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(shard, a)
    torch.save(base, b)
    assert a.getvalue() == b.getvalue()
    loaded = torch.load(io.BytesIO(a.getvalue()), weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, base)
    shard.add_(1)  # the same storage and version counter as the parameter's local tensor
    assert torch.equal(base, shard.as_subclass(torch.Tensor)) and base._version == shard._version == 1
    assert hasattr(shard, "fsdp_pre_all_gather") and hasattr(shard, "fsdp_post_all_gather")
    assert not hasattr(base, "fsdp_pre_all_gather")


def test_the_setting_is_registered_with_its_config_key():
    setting = settings.REGISTRY["ACCELERATE_FP8_ALL_GATHER"]
    assert setting.kind == "enum" and setting.config_key == "all_gather" and setting.default == "high_precision"
    assert settings.setting_for_config_key("all_gather") is setting
    assert settings.exported_fp8_env({"all_gather": "fp8"}) == {"ACCELERATE_FP8_ALL_GATHER": "fp8"}
    assert setting.parse("FP8") == "fp8" and setting.parse(" high_precision ") == "high_precision"
    with pytest.raises(ValueError, match="ACCELERATE_FP8_ALL_GATHER"):
        setting.parse("bf16")


@pytest.mark.parametrize("name", ["MXFP8BlockScaling", "NVFP4BlockScaling"])
def test_recipes_it_cannot_serve_are_refused_by_name(name):
    assert name in policy.refusal(name, is_fsdp2=True)
    for served in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        assert policy.refusal(served, is_fsdp2=True) is None
    assert "FSDP2" in policy.refusal("DelayedScaling", is_fsdp2=False)
    assert "CPU offload" in policy.refusal("DelayedScaling", is_fsdp2=True, cpu_offload=True)


def test_block_scaling_is_served_with_128x128_weight_tiles_only():
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()  # TE's real Python (its recipe classes) over the CPU kernel shim
    from transformer_engine.common.recipe import Float8BlockScaling

    assert policy.block_recipe_refusal(Float8BlockScaling()) is None
    why = policy.block_recipe_refusal(Float8BlockScaling(w_block_scaling_dim=1))
    assert "Float8BlockScaling" in why and "w_block_scaling_dim=1" in why


def test_te_recipe_kwargs_refuses_an_unserved_recipe_and_records_the_switch():
    from accel_fp8_fix.fixes.start.recipe_kwargs import te_recipe_kwargs
    from accel_fp8_fix.fixes.start.handler_choices import all_gather_choice

    with pytest.raises(policy.Fp8AllGatherError, match="MXFP8BlockScaling"):
        te_recipe_kwargs(recipe="mxfp8", all_gather="fp8")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_ALL_GATHER"):
        te_recipe_kwargs(all_gather="yes")
    handler = te_recipe_kwargs(recipe="current", all_gather="fp8")
    assert all_gather_choice(handler) == "fp8" and policy.requested(handler) == (True, "te_recipe_kwargs(all_gather)")
    assert all_gather_choice(te_recipe_kwargs()) is None


def test_the_installed_te_has_what_the_fp8_all_gather_needs():
    from accel_fp8_fix.engine.versions import installed_version
    from accel_fp8_fix.internals.transformer_engine import fp8_all_gather_missing

    versions = {"transformer-engine": installed_version("transformer-engine")}
    assert fp8_all_gather_missing(versions) == [] and fp8_all_gather_missing(versions, "Float8BlockScaling") == []


def test_a_te_without_the_block_pieces_refuses_only_block_scaling(monkeypatch):
    from accel_fp8_fix.internals import transformer_engine as te_internals

    monkeypatch.setattr(te_internals.float8_tensors, "FP8_ALL_GATHER_BLOCK_SOURCES",
                        te_internals.FP8_ALL_GATHER_BLOCK_SOURCES + (("pytorch/tensor/float8_blockwise_tensor.py", "no such text"),))
    versions = {"transformer-engine": "2.20.2", "torch": "2.13.0"}
    why = policy.refusal("Float8BlockScaling", is_fsdp2=True, versions=versions)
    assert "Transformer Engine lacks" in why and "no such text" in why
    assert policy.refusal("Float8CurrentScaling", is_fsdp2=True, versions=versions) is None


def _config(tmp_path, fp8=None, **changes):
    import yaml

    cfg = yaml.safe_load((ROOT / "examples/fsdp2_tp_fp8.yaml").read_text())
    if (fp8 or {}).get("recipe") not in (None, "delayed"):
        for key in ("amax_history_len", "amax_compute_algo", "interval"):  # DelayedScaling's own settings
            cfg["fp8_config"].pop(key, None)
    cfg["fp8_config"].update(fp8 or {})
    cfg.update(changes)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_doctor_launch_checks_the_switch(tmp_path):
    from accel_fp8_fix.diagnostics.launch_check import check_launch_config

    env = {"ACCEL_FP8_FIX_REHEARSAL": "1"}
    ok = check_launch_config(_config(tmp_path, {"all_gather": "fp8"}), environ=env)
    assert ok.ok and "FP8 all-gather" not in ok.failed, str(ok)
    mxfp8 = check_launch_config(_config(tmp_path, {"all_gather": "fp8", "recipe": "mxfp8"}), environ=env)
    assert "FP8 all-gather" in mxfp8.failed and "MXFP8BlockScaling" in str(mxfp8)
    offload = check_launch_config(_config(tmp_path, {"all_gather": "fp8"}, fsdp_config={
        "fsdp_version": 2, "fsdp_offload_params": True}), environ=env)
    assert "FP8 all-gather" in offload.failed and "CPU offload" in str(offload)
    no_fsdp = check_launch_config(_config(tmp_path, {"all_gather": "fp8"}, distributed_type="MULTI_GPU"), environ=env)
    assert "FP8 all-gather" in no_fsdp.failed and "FSDP2" in str(no_fsdp)
    bad = check_launch_config(_config(tmp_path, {"all_gather": "banana"}), environ=env)
    assert "FP8 all-gather" in bad.failed


def _fake_fsdp_param(rows, cols, world, shard=None, param=None, rank=0):
    from types import SimpleNamespace

    padded = -(-rows // world)
    return SimpleNamespace(mesh_info=SimpleNamespace(shard_mesh_size=world, shard_mesh_rank=rank),
                           padded_sharded_param_size=torch.Size([padded, cols]),
                           sharded_param=param if param is not None else torch.empty(rows, cols),
                           _sharded_local_tensor=shard if shard is not None else torch.empty(padded, cols))


@pytest.mark.parametrize("rows,world,why", [
    (512, 2, None), (256, 1, None), (200, 1, None),  # whole tiles per shard; one shard rank: any rows
    (384, 2, "not a multiple of 128"),  # 192-row shards: tiles would cross shard boundaries
    (4080, 32, "uneven"),  # 128-row shards, the last 112: FSDP2 wants every all-gather input padded-size
])
def test_block_scaling_needs_whole_tiles_in_whole_shards(rows, world, why):
    got = fp8_all_gather_fix._block_misaligned("w", _fake_fsdp_param(rows, 256, world))
    assert (got is None) if why is None else (why in got and got.startswith(f"w: {rows} rows sharded over {world}"))


def test_the_record_sees_every_way_a_shard_changes_and_the_hook_refuses_a_stale_one():
    from accel_fp8_fix.fixes.all_gather.fp8_weight_record import WeightRecord

    param, shard = torch.zeros(4, 2), torch.zeros(4, 2)
    fake = _fake_fsdp_param(4, 2, 1, shard=shard, param=param)
    record = WeightRecord()
    i = record.add("blocks.0.fc1.weight", fake, "per_tensor")
    assert record.changed([i])  # never computed
    with pytest.raises(policy.Fp8AllGatherError, match="blocks.0.fc1.weight: its shard changed"):
        record.check_current(i)
    record.mark_current([i])
    record.check_current(i)
    for change in (lambda: param.add_(1),  # an optimizer step / a user's in-place edit (the DTensor parameter)
                   lambda: shard.copy_(torch.ones(4, 2)),  # a load into the local shard
                   lambda: setattr(fake, "_sharded_local_tensor", torch.zeros(4, 2)),  # FSDP2 replaced the shard
                   record.invalidate):  # weights_changed(): what no version counter sees
        change()
        assert record.changed([i])
        with pytest.raises(policy.Fp8AllGatherError, match="weights_changed()"):
            record.check_current(i)
        record.mark_current([i])
    param.data.add_(1)  # bypasses the version counters: not seen (docs/fixes.md)
    assert not record.changed([i])


def test_the_scales_are_one_packed_reduction_into_buffers_allocated_once():
    from accel_fp8_fix.fixes.all_gather.fp8_weight_record import WeightRecord, WeightScales
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    from transformer_engine.common.recipe import Float8CurrentScaling

    shards = [torch.randn(8, 16) * s for s in (1.0, 30.0, 1e-3)]
    record = WeightRecord()
    scales = WeightScales(record, None, te_scaling.scale_params(Float8CurrentScaling()))
    for n, t in enumerate(shards):
        scales.add(record.add(f"w{n}", _fake_fsdp_param(8, 16, 1, shard=t, param=t), "per_tensor"))
    with torch.inference_mode():  # a first forward in an evaluation: the buffers are still normal tensors
        assert scales.refresh()
    assert not scales.scale.is_inference() and not scales.refresh()  # unchanged: no reduction
    want = te_scaling.scales_from_amaxes(torch.stack([t.abs().amax() for t in shards]), scales.params)
    assert torch.equal(scales.scale, want) and torch.equal(scales.scale_inv, torch.reciprocal(want))
    buffers = (scales.scale.data_ptr(), scales.scale_inv.data_ptr())
    views = [v.data_ptr() for v in scales.scale_inv_views]
    shards[1].mul_(2)
    assert scales.refresh() and scales.reductions == 2
    assert float(scales.scale[1]) == float(want[1]) / 2 and (scales.scale.data_ptr(), scales.scale_inv.data_ptr()) == buffers
    assert [v.data_ptr() for v in scales.scale_inv_views] == views  # what each gather passes: the same storage
    assert all(q.scale.data_ptr() == scales.scale[j:j + 1].data_ptr() for j, q in enumerate(scales.weight_quantizers))


def test_fsdp2_is_told_to_keep_the_all_gather_outputs():
    """torch 2.15 asks the extension whether to free the all-gather outputs right after fsdp_post_all_gather: the
    FP8 tensor built there is a view of them."""
    shard = torch.zeros(2, 2).as_subclass(fp8_all_gather_fix.Fp8AllGatherShard)
    assert shard.fsdp_should_release_all_gather_outputs_after_post_all_gather() is False


def test_packed_experts_get_a_scale_per_expert_in_the_same_packed_reduction(monkeypatch):
    """A packed-experts weight [E, out, in] takes E slots of the packed amax vector: this rank's shard (whole
    experts, FSDP2's dim-0 chunk at ``shard rank x padded rows``) fills its experts' slots, the others stay 0 for
    the MAX all-reduce to fill from the ranks that hold them."""
    from accel_fp8_fix.fixes.all_gather.fp8_weight_record import WeightRecord, WeightScales
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    from transformer_engine.common.recipe import Float8CurrentScaling

    linear = torch.randn(8, 16)
    experts = torch.randn(6, 4, 8) * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape(6, 1, 1)
    shard = experts[2:4]  # rank 1 of 3: experts 2 and 3
    from accel_fp8_fix.internals import torch_internals

    # where the shard starts in the global tensor: the DTensor's offset (here the second of three FSDP2 chunks)
    monkeypatch.setattr(torch_internals, "global_row_offset", lambda t: 2 if t is shard else 0)
    record = WeightRecord()
    scales = WeightScales(record, None, te_scaling.scale_params(Float8CurrentScaling()))
    scales.add(record.add("w", _fake_fsdp_param(8, 16, 1, shard=linear, param=linear), "per_tensor"))
    j = scales.add(record.add("experts.gate_up_proj", _fake_fsdp_param(6, 4, 3, shard=shard, param=shard, rank=1),
                              "per_expert"), experts=6)
    assert scales.slots == [(0, 1), (1, 6)]
    assert scales.refresh()
    amax = torch.zeros(7)
    amax[0] = linear.abs().amax()
    amax[3:5] = shard.abs().amax(dim=(1, 2))
    want = te_scaling.scales_from_amaxes(amax, scales.params)  # experts 0, 1, 4, 5: amax 0 -> scale 1
    assert torch.equal(scales.scale, want)
    assert len(scales.quantizers_of(j)) == 6 and scales.scale_inv_views[j].shape == (6,)
    assert all(q.scale.data_ptr() == scales.scale[1 + e:2 + e].data_ptr() for e, q in enumerate(scales.quantizers_of(j)))


def _fp8_experts(transposed=False):
    from accel_fp8_fix.fixes.all_gather.fp8_experts_gather import Fp8Experts
    from accel_fp8_fix.internals import transformer_engine as te_internals
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    from transformer_engine.common.recipe import Float8CurrentScaling

    params = te_scaling.scale_params(Float8CurrentScaling())
    master = torch.randn(3, 32, 16) * torch.tensor([1.0, 10.0, 0.01]).reshape(3, 1, 1)
    scales = te_scaling.scales_from_amaxes(master.abs().amax(dim=(1, 2)), params)
    quantizers = [te_internals.float8_quantizer(scales[e:e + 1].clone(), params.fp8_dtype) for e in range(3)]
    data = torch.stack([te_internals.quantized_bits(q(master[e])) for e, q in enumerate(quantizers)])
    return master, Fp8Experts(data, torch.reciprocal(scales), quantizers, torch.float32), quantizers


def test_the_gathered_experts_weight_keeps_fsdp2s_handling_and_dequantizes_per_expert_otherwise():
    master, experts, quantizers = _fp8_experts()
    param = torch.nn.Parameter(torch.as_strided(experts, experts.shape, experts._data.stride(), 0))  # FSDP2's steps
    assert type(param).__name__ == "Fp8Experts" and param.requires_grad and param._data is experts._data
    want = torch.stack([quantizers[e](master[e]).dequantize() for e in range(3)])  # TE's, expert by expert
    assert torch.equal(param.dequantize(), want)
    assert torch.equal(param * 1, want)  # any other op: the dequantized weight, a plain tensor
    assert type(param.sum(0)) is torch.Tensor
    with pytest.raises(RuntimeError, match="read-only FSDP2 unsharded view"):
        with torch.no_grad():
            param.mul_(2)


@pytest.mark.parametrize("transposed", [False, True])
def test_each_expert_reaches_te_as_a_float8_tensor_and_gradients_stack_back(transposed):
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    master, experts, quantizers = _fp8_experts()
    experts.requires_grad_(True)
    weights = experts.expert_weights(transposed)
    assert all(isinstance(w, Float8Tensor) for w in weights) and all(w.is_contiguous() for w in weights)
    for e, w in enumerate(weights):
        want = quantizers[e](master[e]).dequantize()
        assert torch.equal(w.dequantize(), want.t() if transposed else want)
    grads = [torch.full(w.shape, float(e + 1)) for e, w in enumerate(weights)]
    torch.autograd.backward([w.dequantize() for w in weights[:2]], grads[:2])  # expert 2 unused: a zero gradient
    want = torch.stack([g.t() if transposed else g for g in grads[:2]] + [torch.zeros(master.shape[1:])])
    assert experts.grad.shape == master.shape and torch.equal(experts.grad, want)


def test_experts_stay_in_the_policy_dtype_where_not_served_named():
    from types import SimpleNamespace

    from accel_fp8_fix.fixes.all_gather.fp8_experts_gather import why_kept

    ep = SimpleNamespace(_is_expert_parallel=True)
    assert "under expert parallelism or TP" in why_kept(ep, None, "block")  # per-tensor recipes serve them

    def experts(n, transposed=False):
        return SimpleNamespace(gate_up_proj=torch.zeros(n, 32, 16), down_proj=torch.zeros(n, 16, 16),
                               is_transposed=transposed, has_bias=False)

    def fsdp(n, world):
        return SimpleNamespace(**vars(_fake_fsdp_param(n, 32, world, param=torch.zeros(n, 32, 16))),
                               offload_to_cpu=False, post_forward_mesh_info=None,
                               fsdp_placement=SimpleNamespace(dim=0), _unsharded_param=None)

    assert why_kept(experts(4), fsdp(4, 2), "block") is None and why_kept(experts(6), fsdp(6, 4), "per_tensor") is None
    assert why_kept(SimpleNamespace(**vars(experts(4)), _is_expert_parallel=True), fsdp(4, 2), "per_tensor") is None
    assert "6 experts over 4 shard ranks (uneven)" in why_kept(experts(6), fsdp(6, 4), "block")
    assert "GPT-OSS's layout" in why_kept(experts(4, transposed=True), fsdp(4, 2), "block")
