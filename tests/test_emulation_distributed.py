"""Emulated TE under torch.distributed (gloo, CPU): amax reduction and TE-native TP."""

import warnings

import pytest
import torch

from accel_fp8_fix.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _amax_worker(rank, world_size):
    return {"world": _amax_case(rank, False), "pairs": _amax_case(rank, True)}


def _amax_case(rank, use_pairs):
    import torch.distributed as dist

    import accel_fp8_fix.emulation as emu
    from accel_fp8_fix.emulation.te import pytorch as te
    from accel_fp8_fix.emulation.te.common.recipe import DelayedScaling

    from accel_fp8_fix.emulation.te.pytorch.quantization import FP8GlobalStateManager

    # TE's global amax buffers outlive modules: modules of an earlier case would be reduced again.
    FP8GlobalStateManager.reset()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2] if use_pairs else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.Linear(32, 64), te.Linear(64, 16))
    x = torch.randn(8, 32) * (rank + 1)  # different activations per rank
    emu.reset_stats()
    with te.autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group):
        y = model(x)
    after_fwd = emu.stats()
    y.pow(2).sum().backward()
    s = emu.stats()
    scales = [torch.cat([m.fp8_meta["scaling_fwd"].scale, m.fp8_meta["scaling_bwd"].scale]) for m in model]
    return {"stats": s, "after_fwd": after_fwd, "scales": torch.stack([t for t in scales]).tolist(),
            "fp8_group_is_given": all(m.fp8_meta["fp8_group"] is group for m in model)}


@pytest.fixture(scope="module")
def amax_results():
    return run_distributed(_amax_worker, 4, timeout=120)


def test_amax_reduction_world_one_allreduce_per_exit_and_backward(amax_results):
    res = [r["world"] for r in amax_results]
    assert all(r["scales"] == res[0]["scales"] for r in res)
    assert res[0]["scales"] != [[1.0] * 5] * 2
    for r in res:
        assert r["after_fwd"]["amax_reductions"] == 1 and r["after_fwd"]["amax_elements_reduced"] == 6
        s = r["stats"]
        assert (s["amax_reductions_fwd"], s["amax_reductions_bwd"]) == (1, 1)
        assert s["amax_reduction_groups"] == ["WORLD", "WORLD"]
        assert s["amax_elements_reduced"] == 2 * 3 + 2 * 2
        assert s["fp8_gemms"] == 2 + 2 * 2 - 1  # first layer's input needs no grad: no dgrad GEMM
        assert r["fp8_group_is_given"]


def test_amax_reduction_honours_the_given_subgroup(amax_results):
    res = [r["pairs"] for r in amax_results]
    assert res[0]["scales"] == res[1]["scales"] and res[2]["scales"] == res[3]["scales"]
    assert res[0]["scales"] != res[2]["scales"]
    for rank, r in enumerate(res):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert r["stats"]["amax_reduction_groups"] == [pair, pair]
        assert r["stats"]["amax_reductions"] == 2


def _tp_worker(rank, world_size):
    return {mode: _tp_case(rank, world_size, mode) for mode in ("fp32", "sp", "fp8")}


def _tp_case(rank, world_size, mode):
    import torch.distributed as dist

    from accel_fp8_fix.emulation.te import pytorch as te
    from accel_fp8_fix.emulation.te.common.recipe import DelayedScaling

    warnings.simplefilter("ignore")
    group = dist.new_group(list(range(world_size)))
    torch.manual_seed(0)
    D, H, T = 32, 64, 8
    w1, b1, w2, b2 = torch.randn(H, D) * 0.1, torch.randn(H) * 0.1, torch.randn(D, H) * 0.1, torch.randn(D) * 0.1
    x_full = torch.randn(T, D)
    sp = mode == "sp"
    col = te.Linear(D, H, tp_group=group, parallel_mode="column", sequence_parallel=sp)
    row = te.Linear(H, D, tp_group=group, parallel_mode="row", sequence_parallel=sp)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(world_size, 0)[rank]); col.bias.copy_(b1.chunk(world_size, 0)[rank])
        row.weight.copy_(w2.chunk(world_size, 1)[rank]); row.bias.copy_(b2)
    x = (x_full.chunk(world_size, 0)[rank] if sp else x_full).clone().requires_grad_(True)
    fp8 = mode == "fp8"
    recipe = DelayedScaling(amax_history_len=2)
    for _ in range(2 if fp8 else 1):
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        x.grad = None
        with te.autocast(enabled=fp8, recipe=recipe, amax_reduction_group=group):
            y = row(col(x))
        y.pow(2).sum().backward()
    return {"y": y.detach(), "gw1": col.weight.grad, "gw2": row.weight.grad, "gb2": row.bias.grad,
            "gx": x.grad, "fp8_gemms": col.fp8_gemm_count + row.fp8_gemm_count}


def _reference(world_size):
    torch.manual_seed(0)
    D, H, T = 32, 64, 8
    w1, b1, w2, b2 = torch.randn(H, D) * 0.1, torch.randn(H) * 0.1, torch.randn(D, H) * 0.1, torch.randn(D) * 0.1
    x = torch.randn(T, D).requires_grad_(True)
    w1.requires_grad_(True); w2.requires_grad_(True); b2.requires_grad_(True)
    y = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
    y.pow(2).sum().backward()
    return y.detach(), w1.grad, w2.grad, b2.grad, x.grad


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, timeout=120)


@pytest.mark.parametrize("mode", ["fp32", "sp", "fp8"])
def test_te_native_tp_column_then_row_matches_unsharded(mode, tp_results):
    ws = 2
    res = [r[mode] for r in tp_results]
    y, gw1, gw2, gb2, gx = _reference(ws)
    if mode == "fp8":
        for rank, r in enumerate(res):
            assert not torch.equal(r["y"], y)
            assert (r["y"] - y).norm() / y.norm() < 0.06
            assert (r["gw1"] - gw1.chunk(ws, 0)[rank]).norm() / gw1.norm() < 0.1
            assert r["fp8_gemms"] == 2 * (2 + 4)  # 2 steps x (2 fwd + dgrad/wgrad of both layers)
        assert torch.equal(res[0]["y"], res[1]["y"])
        return
    for rank, r in enumerate(res):
        exp_y = y.chunk(ws, 0)[rank] if mode == "sp" else y
        exp_gx = gx.chunk(ws, 0)[rank] if mode == "sp" else gx
        torch.testing.assert_close(r["y"], exp_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["gw1"], gw1.chunk(ws, 0)[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["gw2"], gw2.chunk(ws, 1)[rank], rtol=1e-5, atol=1e-5)
        if mode != "sp":
            torch.testing.assert_close(r["gb2"], gb2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["gx"], exp_gx, rtol=1e-5, atol=1e-5)
        assert r["fp8_gemms"] == 0
    if mode == "sp":  # TE marks the row bias `sequence_parallel`: its grad is partial per rank (as in TE)
        torch.testing.assert_close(res[0]["gb2"] + res[1]["gb2"], gb2, rtol=1e-5, atol=1e-5)


def _dtensor_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from accel_fp8_fix.emulation.te import pytorch as te

    mesh = init_device_mesh("cpu", (world_size,))
    m = te.Linear(64, 128)
    msgs = []
    x = torch.randn(4, 64)
    try:
        m(distribute_tensor(x, mesh, [Replicate()]))
    except TypeError as e:
        msgs.append(str(e))
    m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Replicate()]))
    try:
        m(x)
    except TypeError as e:
        msgs.append(str(e))
    return msgs


def test_dtensor_rejected_with_a_clear_message():
    (msgs,) = run_distributed(_dtensor_worker, 1, timeout=60)
    assert len(msgs) == 2
    assert "emulated transformer_engine Linear(in=64,out=128)" in msgs[0] and "input is a DTensor" in msgs[0]
    assert "weight is a DTensor" in msgs[1] and "local tensors" in msgs[1]
