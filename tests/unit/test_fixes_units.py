"""Single-process checks of the fix building blocks: the FP8-state "unifier", its buffer <-> fp8_meta link,
and the autocast forward wrapper (train / eval, accelerate's wrapper replaced, idempotent)."""

from types import SimpleNamespace

import torch
from torch import nn

from accel_fp8_fix.fixes.convert.fp8_state import find_unregistered_tensors, fp8_state_tensors, register_tensor_state
from support import launcher


class FakeTE(nn.Module):
    """Holds FP8 state the way TE does: tensors inside a plain dict attribute and plain objects."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.register_buffer("seen", torch.zeros(1))
        state = SimpleNamespace(scale=torch.ones(3), amax_history=torch.zeros(16, 3))
        self.fp8_meta = {"recipe": "delayed", "scaling_fwd": state, "fp8_group": None}
        self.workspace = torch.zeros(8)  # not FP8 state: outside the attrs asked for

    def forward(self, x):
        return x @ self.weight


def test_unifier_finds_registers_and_reports_unregistered_tensor_state():
    model = nn.Sequential(FakeTE(), nn.ReLU(), FakeTE())
    assert {p for p, _ in find_unregistered_tensors(model[0])} == {
        ("fp8_meta", "scaling_fwd", "scale"), ("fp8_meta", "scaling_fwd", "amax_history"), ("workspace",)}
    found = register_tensor_state(model, attrs=("fp8_meta",))
    assert [(r.module, r.path[-1], r.shape) for r in found] == [
        ("0", "scale", (3,)), ("0", "amax_history", (16, 3)), ("2", "scale", (3,)), ("2", "amax_history", (16, 3))]
    buffers = dict(model.named_buffers())
    assert buffers["0._fp8_fp8_meta__scaling_fwd__scale"] is model[0].fp8_meta["scaling_fwd"].scale
    assert "0._fp8_fp8_meta__scaling_fwd__scale" not in model.state_dict()  # non-persistent: _extra_state persists it
    assert register_tensor_state(model, attrs=("fp8_meta",)) == []  # idempotent
    assert set(fp8_state_tensors(model)) == {f"{i}._fp8_fp8_meta__scaling_fwd__{k}" for i in (0, 2)
                                             for k in ("scale", "amax_history")}


class _Uncopyable:
    """Stands for a process group: ``copy.deepcopy`` of one raises, as of torch's ProcessGroup."""

    def __reduce_ex__(self, protocol):
        raise TypeError("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")


def test_what_the_stages_learn_about_a_module_is_the_packages_and_a_copy_carries_none_of_it():
    """Issue 46 item 2: the TP layout, the output-layer mark, the amax group and the experts mark are the package's
    records, not attributes of the module: nothing named ``_accel_fp8_fix_*`` is set on it, and a copy of the
    module (deep, as of a module outside FSDP2: FSDP2 refuses deepcopy) carries no record and no group; the FP8
    state link is a forward pre-hook of the module, so the copy's follows its own buffers. A record goes with its
    module; the one public reset empties them all."""
    import copy
    import gc

    from accel_fp8_fix import caches
    from accel_fp8_fix.fixes.convert import run_state
    from accel_fp8_fix.fixes.convert.fp8_state import amax_group_of, share_state_over, state_link_of
    from accel_fp8_fix.fixes.convert.tp_layout import is_output_layer, tp_layout_of

    module = FakeTE()
    register_tensor_state(module, attrs=("fp8_meta",))
    group = _Uncopyable()
    share_state_over(module, group)
    run_state.module_record(module).tp_mode = "column"
    run_state.module_record(module).output_layer = True
    assert not any(name.startswith("_accel_fp8_fix") for name in vars(module))
    assert amax_group_of(module, "model's") is group and tp_layout_of(module) == ("column", None)
    copied = copy.deepcopy(module)
    assert amax_group_of(copied, "model's") == "model's" and tp_layout_of(copied) == (None, None)
    assert is_output_layer(module) and not is_output_layer(copied)
    link = state_link_of(copied)
    assert link is not None and link is not state_link_of(module)
    assert set(fp8_state_tensors(copied)) == set(fp8_state_tensors(module))
    assert fp8_state_tensors(copied)["_fp8_fp8_meta__scaling_fwd__scale"] is copied.fp8_meta["scaling_fwd"].scale
    del module
    gc.collect()
    assert len(run_state._MODULE_RECORDS) == 0  # went with its module
    other = nn.Linear(2, 2)
    share_state_over(other, group)
    assert "fixes.convert.run_state: accelerator and module records" in caches.reset()
    assert amax_group_of(other, None) is None


def test_fsdp_state_cached_on_a_module_is_not_its_state():
    # TE caches the enclosing FSDP2 unit's state on a module (_te_cached_parent_fsdp_state); the tensors in it
    # (every parameter of the unit) belong to FSDP, not to the module: neither stray nor FP8 state.
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    module = FakeTE()
    fsdp_state = FSDPState()
    fsdp_state.held = SimpleNamespace(sharded=torch.zeros(5))
    module._te_cached_parent_fsdp_state = fsdp_state
    module.other = SimpleNamespace(held=SimpleNamespace(sharded=torch.zeros(5)))  # a plain object: still looked in
    assert {p for p, _ in find_unregistered_tensors(module)} == {
        ("fp8_meta", "scaling_fwd", "scale"), ("fp8_meta", "scaling_fwd", "amax_history"), ("workspace",),
        ("other", "held", "sharded")}


def test_buffers_and_fp8_meta_stay_one_tensor_after_casts_and_replacement():
    module = FakeTE()
    register_tensor_state(module, attrs=("fp8_meta",))
    module.fp8_meta["scaling_fwd"].scale.fill_(2.0)
    module.double()  # _apply swaps buffers for float64 copies
    module(torch.ones(1, 4, dtype=torch.float64))  # the forward pre-hook re-links
    scale = module.fp8_meta["scaling_fwd"].scale
    assert scale is module._buffers["_fp8_fp8_meta__scaling_fwd__scale"]
    assert scale.dtype == torch.float32 and torch.equal(scale, torch.full((3,), 2.0))  # FP8 state stays fp32
    fresh = torch.full((3,), 5.0)
    module.fp8_meta["scaling_fwd"].scale = fresh  # TE replaced its tensor: the buffer follows
    module(torch.ones(1, 4, dtype=torch.float64))
    assert module._buffers["_fp8_fp8_meta__scaling_fwd__scale"] is fresh


def _autocast_wrapper(rank, world_size):
    """One rank, TE's real Python on CPU: train vs eval, use_autocast_during_eval, accelerate's wrapper replaced."""
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te
    from accelerate.utils.transformer_engine import contextual_fp8_autocast

    from accel_fp8_fix.fixes.convert.fp8_autocast import wrap_forward

    def run(model, train):
        model.train(train)
        te_on_cpu.reset_stats()
        with torch.no_grad():
            model(torch.randn(8, 16))
        return te_on_cpu.stats()["fp8_gemms"]

    recipe = te_recipe.DelayedScaling()
    out = {}
    for during_eval in (False, True):
        model = te.Linear(16, 16, device="cpu")
        wrap_forward(model, te, recipe, None, during_eval)
        wrap_forward(model, te, recipe, None, during_eval)  # idempotent: one autocast layer
        out[during_eval] = (run(model, True), run(model, False))
    # accelerate's own TE wrapper (no amax group) is replaced, not nested
    model = te.Linear(16, 16, device="cpu")
    model.forward = contextual_fp8_autocast(model.forward, recipe, False).__get__(model)
    wrap_forward(model, te, recipe, None, False)
    out["unwrapped_to"] = type(model.forward.__func__.__wrapped__).__name__
    # eval mode (what from_pretrained returns) with gradients on: no FP8, and the user is told once
    import warnings

    model = te.Linear(16, 16, device="cpu")
    wrap_forward(model, te, recipe, None, False)
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randn(8, 16))  # inference: silent
        te_on_cpu.reset_stats()
        model(torch.randn(8, 16)).sum().backward()
        model(torch.randn(8, 16))
    out["eval_grad_fp8_gemms"] = te_on_cpu.stats()["fp8_gemms"]
    out["eval_warnings"] = [str(w.message) for w in caught if "eval mode" in str(w.message)]
    return out


def test_autocast_wrapper_honours_train_eval_and_replaces_accelerates_wrapper():
    (result,) = launcher.run(_autocast_wrapper, 1, timeout=120)
    assert result[False] == (1, 0)  # FP8 in training, high precision in eval (accelerate's default)
    assert result[True] == (1, 1)  # use_autocast_during_eval=True: FP8 in eval too
    assert result["unwrapped_to"] == "method"  # the bound original forward, not accelerate's wrapper
    assert result["eval_grad_fp8_gemms"] == 0 and len(result["eval_warnings"]) == 1  # once, not per forward
    assert "Linear is in eval mode" in result["eval_warnings"][0] and "model.train()" in result["eval_warnings"][0]


def _extra_state_after_eval(rank, world_size):
    """One rank, TE's real Python on CPU: the size of a TE Linear's saved _extra_state after FP8 training then
    an eval pass (no FP8), without and with keep_fp8_state_in_checkpoints."""
    from accel_fp8_fix.rehearsal import te_on_cpu

    te_on_cpu.install()
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    from accel_fp8_fix.fixes.checkpoint.checkpoint import keep_fp8_state_in_checkpoints

    out = {}
    for keep in (False, True):
        module = te.Linear(16, 16, device="cpu")
        if keep:
            keep_fp8_state_in_checkpoints(module)
            keep_fp8_state_in_checkpoints(module)  # idempotent: one hook
        with te.autocast(enabled=True, recipe=te_recipe.DelayedScaling()):
            module(torch.randn(16, 16)).sum().backward()
        trained = module.state_dict()["_extra_state"].numel()
        with torch.no_grad():
            module(torch.randn(16, 16))  # eval pass: TE autocast off
        out[keep] = (trained, module.state_dict()["_extra_state"].numel(), len(module._state_dict_pre_hooks))
    return out


def test_fp8_state_stays_in_checkpoints_after_an_eval_pass():
    """A19: TE saves its FP8 state only if its last forward ran in FP8; an evaluation pass before save_state
    would write an empty _extra_state (scales and amax histories lost; a sharded load then fails)."""
    (result,) = launcher.run(_extra_state_after_eval, 1, timeout=120)
    trained, after_eval, _ = result[False]
    assert trained > 0 and after_eval == 0  # TE's own behaviour: the state is dropped
    trained, after_eval, hooks = result[True]
    assert after_eval == trained > 0 and hooks == 1


def test_fp8_shape_rule_is_checked_on_the_tp_local_shard():
    """A11: TE's FP8 GEMMs see the TP-local weight. A 64 x 48 Linear fits unsharded, but its column-parallel
    shard on 2 ranks is 24 wide: kept (the global check used before would have converted it)."""
    from accel_fp8_fix.fixes.convert.fp8_shapes import local_dims, local_dims_fit

    assert local_dims(64, 48, None, 1) == (64, 48) and local_dims_fit(64, 48)
    assert local_dims(64, 48, "column", 2) == (64, 24) and not local_dims_fit(64, 24)
    assert local_dims(96, 64, "row", 2) == (48, 64) and local_dims_fit(48, 64)
    assert local_dims(64, 64, "row", 8) == (8, 64) and not local_dims_fit(8, 64)


# -- A23: context parallelism's shape rules (fixes/step/context_parallel.py) ----------------------------------------
def test_cp_pad_multiple_keeps_shards_even_the_balancer_on_and_the_fp8_rule_for_any_batch():
    from accel_fp8_fix.fixes.step.context_parallel import check_buffers, pad_multiple

    from accel_fp8_fix.fixes.step.context_parallel import token_multiple_of

    assert [token_multiple_of(c) for c in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                           "NVFP4BlockScaling", "MXFP8BlockScaling")] == [16, 16, 16, 16, 32]
    assert pad_multiple(2, 16) == 32 and pad_multiple(4, 32) == 128 and pad_multiple(2, 1) == 4
    for cp, m in ((2, 16), (4, 16), (2, 32), (4, 32)):
        length = pad_multiple(cp, m)
        assert length % (2 * cp) == 0
        for batch in (1, 2, 3):
            assert check_buffers([torch.zeros(batch, length)], [1], cp, m) == []


def test_cp_shape_rules_name_the_buffer_its_shape_cp_size_and_the_pad_multiple():
    from accel_fp8_fix.fixes.step.context_parallel import check_buffers

    ids, labels = torch.zeros(2, 30, dtype=torch.long), torch.zeros(2, 30, dtype=torch.long)
    (uneven,) = check_buffers([ids, labels[:, :28]], [1, 1], 4, None)[:1]
    assert uneven.startswith("buffer 0 (shape [2, 30]) has sequence length 30 on dim 1, not divisible by cp_size 4")
    assert "pad every sequence to a multiple of 8 (cp_size 4 x 2" in uneven
    assert any("sequence lengths differ ([30, 28])" in p for p in check_buffers([ids, labels[:, :28]], [1, 1], 2, None))
    fp8 = check_buffers([torch.zeros(1, 36)], [1], 2, 16)  # 18 tokens per CP rank
    assert fp8 == ["buffer 0 (shape [1, 36]) leaves each CP rank 18 tokens (batch x sequence / cp_size 2), not a "
                   "multiple of 16: Transformer Engine's FP8 GEMMs need it per rank (the recipe's rule and cuBLASLt's "
                   "FP8 leading dimension in the weight-gradient GEMM): pad every sequence to a multiple of 32 "
                   "(cp_size 2 x the FP8 token multiple 16, e.g. the collator's pad_to_multiple_of=32), and pass no "
                   "attention mask under CP"]
    assert check_buffers([torch.zeros(8, 34)], [1], 2, 16)[0].startswith("buffer 0 (shape [8, 34]) leaves each CP "
                                                                         "rank 136 tokens")  # 8 x 17: % 8, not % 16
    assert check_buffers([torch.zeros(1, 36)], [1], 2, None) == []  # FP8 off: only CP's own rule
    assert check_buffers([ids], [2], 2, None) == ["buffer 0 (shape [2, 30]) has no sequence dim 2"]
    assert check_buffers([ids, labels], [1], 2, None)[0].startswith("2 buffers but 1 buffer_seq_dims")


def test_cp_wrapper_checks_only_with_cp_on_and_warns_when_the_balancer_would_be_off(monkeypatch):
    from accel_fp8_fix.fixes.step import context_parallel

    calls, warned = [], []
    monkeypatch.setattr(context_parallel, "warn_user", warned.append)

    def stock(*args, **kwargs):
        calls.append((args, kwargs))
        return "context"

    cp_on = SimpleNamespace(parallelism_config=SimpleNamespace(cp_enabled=True, cp_backend="torch", cp_size=2),
                            accel_fp8_fix=SimpleNamespace(fp8_enabled=True, recipe=None))
    off = SimpleNamespace(parallelism_config=SimpleNamespace(cp_enabled=False, cp_size=1))
    bad = [torch.zeros(2, 31)]
    assert context_parallel.maybe_context_parallel(stock, off, (), {"buffers": bad, "buffer_seq_dims": [1]}) == "context"
    try:
        context_parallel.maybe_context_parallel(stock, cp_on, (bad, [1]), {})
    except ValueError as exc:
        assert str(exc).startswith("accel_fp8_fix: maybe_context_parallel: buffer 0 (shape [2, 31])"), exc
    else:
        raise AssertionError("an uneven CP length was not refused")
    assert len(calls) == 1  # refused before torch shards anything
    balanced_off = [torch.zeros(16, 34)]  # 34 % 2 == 0, 34 % 4 != 0; 16 x 17 tokens per rank: FP8-fit
    assert context_parallel.maybe_context_parallel(stock, cp_on, (balanced_off, [1]), {}) == "context"
    assert len(warned) == 1 and "sequence length 34 is not a multiple of 2 x cp_size = 4" in warned[0]
    assert context_parallel.maybe_context_parallel(stock, cp_on, ([torch.zeros(2, 32)], [1]), {}) == "context"
    assert len(warned) == 1 and len(calls) == 3
    monkeypatch.setattr(context_parallel, "balancer_follows_length", lambda: False)  # torch 2.11 / 2.12
    try:
        context_parallel.maybe_context_parallel(stock, cp_on, (balanced_off, [1]), {})
    except ValueError as exc:
        assert "sequence length 34 is not a multiple of 2 x cp_size = 4" in str(exc) and "fixed in torch 2.13" in str(exc)
    else:
        raise AssertionError("the balancer-off length was not refused where torch's ring fails on it")
    assert len(calls) == 3


def test_a_presharded_model_without_a_mixed_precision_policy_is_named(monkeypatch):
    """accelerate's bf16 / FP8 mixed precision reaches an FSDP2 model only through fully_shard's policy: a model
    transformers sharded at load without ``fsdp_mixed_precision`` trains in fp32, said once by name."""
    import warnings

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from accel_fp8_fix import _log
    from accel_fp8_fix.fixes.convert import presharded

    class Plugin:
        mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)

    model = torch.nn.Linear(2, 2)
    found = {None}
    monkeypatch.setattr(presharded.torch_fsdp2, "param_dtypes", lambda m: found)
    monkeypatch.setattr(_log, "speaks", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        presharded.warn_if_mixed_precision_is_lost(Plugin(), model)
        found = {torch.bfloat16}  # sharded with a policy: silent
        presharded.warn_if_mixed_precision_is_lost(Plugin(), model)
        Plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.float32)  # fp32 asked: silent
        found = {None}
        presharded.warn_if_mixed_precision_is_lost(Plugin(), model)
    said = [str(w.message) for w in caught if "mixed-precision policy" in str(w.message)]
    assert len(said) == 1 and "Linear was sharded before prepare" in said[0]
    assert "(torch.bfloat16)" in said[0] and "DistributedConfig(..., fsdp_mixed_precision=True)" in said[0]
