"""CUDA-as-CPU answers Transformer Engine and nobody else (accel_fp8_fix.rehearsal.te_on_cpu.cuda_as_cpu).

Under the rehearsal, TE's Python (and the kernel shim) sees a GPU that is the CPU: ``device="cuda"`` lands on
the CPU, ``.cuda()`` is a move to the CPU, ``is_cuda`` is True for CPU tensors (False for meta, so TE's own
"TransformerEngine needs CUDA" guard still fires), ``torch.cuda.Stream`` / ``Event`` / ``default_generators``
are stand-ins and the "CUDA" RNG is the CPU generator. A user script, accelerate or this package see an honest
CPU-only torch: a planted ``.cuda()`` / ``device="cuda"`` fails exactly as it does on a CPU machine.

The classifier runs here in-process (no install); everything that needs the rehearsal installed runs in one
fresh rank (``run_distributed``), which first records the stock answers, then installs the rehearsal and asks
again.
"""

from __future__ import annotations

import functools

import pytest
import torch

from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu
from accel_fp8_fix.testing import run_distributed

# Lines a user's training script might carry (``te`` is transformer_engine.pytorch under the rehearsal).
# On a CPU machine each fails; under the rehearsal each must fail the same way.
USER_PLANTS = {
    "factory": 'torch.zeros(3, device="cuda")',
    "factory_index": 'torch.randn(2, 2, device="cuda:0")',
    "factory_int": "torch.empty(2, device=0)",
    "like": 'torch.empty_like(torch.ones(2), device="cuda")',
    "tensor_cuda": "torch.ones(2).cuda()",
    "tensor_to": 'torch.ones(2).to("cuda")',
    "tensor_to_kw": 'torch.ones(2).to(device=torch.device("cuda"))',
    "module_cuda": "torch.nn.Linear(4, 4).cuda()",
    "module_to": 'torch.nn.Linear(4, 4).to("cuda")',
    "stream": "torch.cuda.Stream()",
    "event": "torch.cuda.Event()",
    "generator": "torch.cuda.default_generators[0]",
    "rng_state": "torch.cuda.get_rng_state()",
}
# The same request made of a TE module: TE's own ``_apply`` sits between ``model.cuda()`` and the tensors; the
# user asked, so it fails as the plain module does on a CPU machine (TE itself cannot load there).
TE_PLANTS = {"te_module_cuda": ("te.Linear(32, 32).cuda()", "module_cuda"),
             "te_module_to": ('te.Linear(32, 32).to("cuda")', "module_to"),
             "te_model_cuda": ("torch.nn.Sequential(te.Linear(32, 32), torch.nn.Linear(32, 4)).cuda()", "module_cuda")}

TRAIN_SCRIPT = '''\
import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

torch.manual_seed(0)
model = torch.nn.Sequential(te.Linear(32, 32), torch.nn.GELU(), te.Linear(32, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(16, 32)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
{plant}
'''


def _outcome(fn):
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return [type(exc).__name__, str(exc)]
    return ["ok", repr(value) if not isinstance(value, torch.Tensor) else f"tensor on {value.device}"]


def _run_plants(plants, namespace):
    return {name: _outcome(lambda code=code: eval(code, dict(namespace))) for name, code in plants.items()}


def _scoped_world(rank, world_size, script_dir):
    import os
    import runpy
    import sys
    import types

    import torch.distributed as dist

    from accel_fp8_fix.distributed.collectives import broadcast_variable
    from accel_fp8_fix.rehearsal import te_on_cpu

    assert not te_on_cpu.is_installed()
    out = {}
    user = {"__name__": "__main__", "torch": torch}
    world = dist.group.WORLD

    def package_plant():  # a package code path that allocates with a planted device
        return broadcast_variable(torch.arange(4.0), group=world, device="cuda")

    # stock: a CPU-only torch, nothing installed
    out["stock"] = _run_plants(USER_PLANTS, user)
    out["stock_package"] = _outcome(package_plant)
    out["stock_is_cuda"] = torch.zeros(1).is_cuda

    te_on_cpu.install()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch import distributed as te_distributed

    # (a) the user's lines, under the rehearsal, with TE loaded
    out["rehearsal"] = _run_plants(USER_PLANTS, user)
    out["rehearsal_te"] = _run_plants({name: code for name, (code, _) in TE_PLANTS.items()}, dict(user, te=te))
    out["rehearsal_is_cuda"] = torch.zeros(1).is_cuda
    out["rehearsal_available"] = torch.cuda.is_available()
    # a whole training script: trains in FP8 (TE's frames), then its planted line fails as on a CPU machine
    scripts = {}
    for name in ("tensor_cuda", "factory", "module_cuda"):
        path = os.path.join(script_dir, f"train_{name}.py")
        with open(path, "w") as f:
            f.write(TRAIN_SCRIPT.format(plant=USER_PLANTS[name]))
        te_on_cpu.reset_stats()
        outcome = _outcome(lambda path=path: runpy.run_path(path, run_name="__main__"))
        stats = te_on_cpu.stats()
        scripts[name] = {"outcome": outcome, "fp8_gemms": stats["fp8_gemms"], "non_fp8_gemms": stats["non_fp8_gemms"]}
    out["scripts"] = scripts

    # (b) this package's code path with a planted device
    out["rehearsal_package"] = _outcome(package_plant)

    # (c) TE's frames (and torch's Python called by them) still get the GPU answers
    te_on_cpu.reset_stats()
    linear = te.Linear(32, 32)  # device="cuda" by default: TE's own factory calls
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = linear(x)
    y.sum().backward()
    stats = te_on_cpu.stats()
    out["te_linear"] = {"device": str(linear.weight.device), "fp8_gemms": stats["fp8_gemms"],
                        "fwd": stats["fp8_gemms_fwd"], "bwd": stats["fp8_gemms_bwd"],
                        "x_grad": x.grad is not None and bool(torch.isfinite(x.grad).all())}
    # a helper in torch's own Python between TE and the factory call: the walk looks past it
    torch_helper = {"__name__": "torch._cuda_scope_probe", "torch": torch}
    exec("def make():\n    return torch.zeros(2, device='cuda')\n", torch_helper)
    te_probe = {"__name__": "transformer_engine.pytorch._cuda_scope_probe", "torch": torch,
                "make": torch_helper["make"], "meta": torch.empty(2, device="meta"), "cpu": torch.zeros(2)}
    exec(
        "def answers():\n"
        "    return {'is_available': torch.cuda.is_available(), 'capability': torch.cuda.get_device_capability(),\n"
        "            'factory': str(torch.zeros(2, device='cuda').device), 'via_torch': str(make().device),\n"
        "            'dot_cuda': str(cpu.cuda().device), 'to_cuda': str(cpu.to('cuda:0').device),\n"
        "            'is_cuda_cpu': cpu.is_cuda, 'is_cuda_meta': meta.is_cuda,\n"
        "            'stream': torch.cuda.Stream.__module__ + '.' + torch.cuda.Stream.__name__,\n"
        "            'event_query': torch.cuda.Event().query(),\n"
        "            'generator_is_cpu': torch.cuda.default_generators[0] is torch.default_generator}\n"
        "def seeded(seed):\n"
        "    torch.cuda.manual_seed(seed)\n"
        "    return torch.rand(3)\n"
        "def restored():\n"
        "    state = torch.cuda.get_rng_state()\n"
        "    first = torch.rand(3)\n"
        "    torch.cuda.set_rng_state(state)\n"
        "    return torch.equal(first, torch.rand(3))\n",
        te_probe,
    )
    out["te_answers"] = te_probe["answers"]()
    torch.manual_seed(123)
    reference = torch.rand(3)
    torch.manual_seed(0)
    out["te_manual_seed_seeds_cpu"] = torch.equal(te_probe["seeded"](123), reference)
    out["te_set_rng_state_restores_cpu"] = te_probe["restored"]()
    # TE's own CUDA-RNG helpers (activation checkpointing uses them) act on the CPU generator
    state = te_distributed._get_cuda_rng_state(graph_safe=False)
    first = torch.rand(3)
    te_distributed._set_cuda_rng_state(state, graph_safe=False)
    out["te_rng_roundtrip"] = torch.equal(first, torch.rand(3))
    out["user_via_torch"] = _outcome(torch_helper["make"])  # the same torch helper, called by non-TE code

    # (d) TE's "needs CUDA" guard fires for an input that is not on the rehearsal's device
    out["te_guard_meta"] = _outcome(lambda: linear(torch.empty(16, 32, device="meta")))
    out["te_guard_cpu"] = _outcome(lambda: linear(torch.randn(16, 32)))

    from accel_fp8_fix.rehearsal.te_on_cpu import cuda_as_cpu

    # (e) the kernel shim's kernels run with the mode off: their torch calls are the CPU arithmetic of TE's
    # kernels (most of a step's torch calls), not passed through Python; a CUDA request inside one fails
    from torch.overrides import _get_current_function_mode_stack

    from accel_fp8_fix.rehearsal.te_on_cpu import kernels

    tex = sys.modules["transformer_engine_torch"]
    seen = []
    kind_of = kernels._quantizer_kind

    def recording_kind_of(quantizer):  # called by the shim's quantize / GEMM during a real FP8 step
        seen.append(sorted({type(m).__name__ for m in _get_current_function_mode_stack()}))
        return kind_of(quantizer)

    kernels._quantizer_kind = recording_kind_of  # the kernels' own helper (tex.py assembles them)
    try:
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            linear(torch.randn(16, 32)).sum().backward()
    finally:
        kernels._quantizer_kind = kind_of
    shim_probe = {"__name__": cuda_as_cpu._SHIM, "torch": torch}
    exec("def alloc():\n    return torch.zeros(2, device='cuda')\n", shim_probe)
    out["shim"] = {"modes_in_kernels": sorted(set(map(tuple, seen))), "kernel_calls": len(seen),
                   "mode_outside": sorted({type(m).__name__ for m in _get_current_function_mode_stack()}),
                   "alloc_with_mode": _outcome(shim_probe["alloc"]),
                   "alloc_mode_off": _outcome(cuda_as_cpu.mode_off(shim_probe["alloc"])),
                   "unwrapped": sorted(n for n in tex.REAL_EXTENSION_NAMES if isinstance(vars(tex).get(n), types.FunctionType)
                                       and not hasattr(vars(tex)[n], "__wrapped__"))}

    # uninstall restores torch.cuda's class and attributes
    cuda_as_cpu.uninstall()
    out["uninstalled"] = {"class_is_module": type(torch.cuda) is types.ModuleType,
                          "stream": torch.cuda.Stream.__module__, "generators": len(torch.cuda.default_generators)}
    return out


@pytest.fixture(scope="module")
def scoped(tmp_path_factory):
    script_dir = str(tmp_path_factory.mktemp("cuda_scope"))
    (result,) = run_distributed(_scoped_world, 1, args=(script_dir,), timeout=240)
    return result


# -- the classifier, in-process (nothing installed) ------------------------------------------------------------
def _frame_of(module_name, body="import sys\ndef here(inner=None):\n    return inner() if inner else sys._getframe(0)\n"):
    namespace = {"__name__": module_name}
    exec(body, namespace)
    return namespace["here"]


@pytest.mark.parametrize(
    "chain, expected",
    [
        (["transformer_engine.pytorch.module.linear"], True),
        (["accel_fp8_fix.rehearsal.te_on_cpu.tex"], True),  # the kernel shim (sys.modules["transformer_engine_torch"])
        (["transformer_engine.pytorch.module.base", "torch.nn.functional"], True),  # TE -> torch's Python -> call
        (["transformer_engine.pytorch.ops", "torch.distributed.distributed_c10d", "contextlib", "torch"], True),
        (["__main__"], False),
        (["accelerate.accelerator", "torch.nn.modules.module"], False),
        (["accel_fp8_fix.fixes.convert.te_convert"], False),
        (["transformer_engine.pytorch.module.base", "accel_fp8_fix.fixes.convert.fp8_shapes", "torch.nn.functional"], False),
        (["transformer_engine_torch"], False),  # the real extension's name never runs Python frames here
        (["torchvision.ops"], False),  # "torch" is torch and torch.*, not every name that starts with it
    ],
)
def test_the_first_frame_outside_torch_decides(chain, expected):
    """``chain`` lists the callers outermost first; the innermost one makes the torch call."""
    call = None
    for name in reversed(chain):  # partial: no frame of this test module between the callers
        call = functools.partial(_frame_of(name), call)
    assert cuda_as_cpu._caller_is_te(call()) is expected


def test_the_walk_is_cached_per_module_name():
    assert cuda_as_cpu._caller_kind("torch.nn.functional") is None
    assert cuda_as_cpu._caller_kind("transformer_engine.pytorch.utils") is True
    assert cuda_as_cpu._caller_kind("accelerate.utils") is False
    assert {"torch.nn.functional", "transformer_engine.pytorch.utils", "accelerate.utils"} <= set(
        cuda_as_cpu._CALLER_KIND)


# -- with the rehearsal installed (one fresh rank) -------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(USER_PLANTS))
def test_a_users_cuda_request_fails_as_on_a_cpu_machine(scoped, name):
    stock = scoped["stock"][name]
    assert stock[0] != "ok"  # the premise: a CPU-only torch refuses it
    assert scoped["rehearsal"][name] == stock


@pytest.mark.parametrize("name", sorted(TE_PLANTS))
def test_moving_a_te_model_to_cuda_fails_as_a_plain_model_does(scoped, name):
    assert scoped["rehearsal_te"][name] == scoped["stock"][TE_PLANTS[name][1]]


def test_users_see_no_cuda(scoped):
    assert scoped["rehearsal_is_cuda"] is False and scoped["stock_is_cuda"] is False
    assert scoped["rehearsal_available"] is False


@pytest.mark.parametrize("name", ["tensor_cuda", "factory", "module_cuda"])
def test_a_training_script_trains_in_fp8_then_its_planted_line_fails(scoped, name):
    script = scoped["scripts"][name]
    # two steps x (first Linear: fwd + wgrad, its input needs no grad; second: fwd + dgrad + wgrad), all FP8
    assert (script["fp8_gemms"], script["non_fp8_gemms"]) == (2 * (2 + 3), 0)
    assert script["outcome"] == scoped["stock"][name]


def test_a_package_code_path_with_a_planted_cuda_device_fails_as_on_a_cpu_machine(scoped):
    assert scoped["stock_package"][0] != "ok"
    assert scoped["rehearsal_package"] == scoped["stock_package"]


def test_te_still_gets_gpu_answers_and_runs_fp8(scoped):
    assert scoped["te_linear"] == {"device": "cpu", "fp8_gemms": 3, "fwd": 1, "bwd": 2, "x_grad": True}
    answers = scoped["te_answers"]
    assert answers["is_available"] is True and tuple(answers["capability"]) >= (8, 9)
    assert answers["factory"] == answers["via_torch"] == answers["dot_cuda"] == answers["to_cuda"] == "cpu"
    assert answers["is_cuda_cpu"] is True and answers["is_cuda_meta"] is False
    assert answers["stream"].endswith("cuda_as_cpu._Stream") and answers["event_query"] is True
    assert answers["generator_is_cpu"] is True
    assert scoped["user_via_torch"] == scoped["stock"]["factory"]  # the same torch helper, for non-TE code


def test_tes_cuda_rng_is_the_cpu_generator(scoped):
    assert scoped["te_manual_seed_seeds_cpu"] is True
    assert scoped["te_set_rng_state_restores_cpu"] is True
    assert scoped["te_rng_roundtrip"] is True


def test_tes_needs_cuda_guard_fires_for_a_meta_input(scoped):
    assert scoped["te_guard_meta"] == ["RuntimeError", "TransformerEngine needs CUDA. Got input on device: meta"]
    assert scoped["te_guard_cpu"][0] == "ok"


def test_the_kernel_shims_kernels_run_with_the_mode_off_and_still_refuse_cuda(scoped):
    shim = scoped["shim"]
    assert shim["mode_outside"] == ["CudaAsCpuMode"] and shim["kernel_calls"] > 0
    assert shim["modes_in_kernels"] == [()]  # every kernel call of a real FP8 step ran with no mode
    assert shim["unwrapped"] == []
    assert shim["alloc_with_mode"] == ["ok", "tensor on cpu"]  # the shim's frames are TE's for the mode ...
    # ... and a kernel asking for CUDA fails: torch's CUDA initialisation is TE's stand-in (it asks from a TE
    # frame), so the dispatcher refuses the CUDA backend instead of "Torch not compiled with CUDA enabled"
    error, message = shim["alloc_mode_off"]
    assert error == "NotImplementedError" and "'CUDA' backend" in message, shim["alloc_mode_off"]


def test_uninstall_restores_torch_cuda(scoped):
    assert scoped["uninstalled"] == {"class_is_module": True, "stream": "torch.cuda.streams", "generators": 0}
