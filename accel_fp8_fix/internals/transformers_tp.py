"""transformers tensor-parallel internals: the style a TP-sharded module was given.

transformers 5.x installs an *instance* ``forward`` (``tp_forward``) that closes over the style object
(``style.install_forward(module, mesh)``); the style's ``input_layouts`` / ``output_layouts`` /
``use_local_output`` say what that module's TP contract is. Styles whose contract this package knows are
listed in ``KNOWN_STYLES``; any other style fails closed (the module keeps transformers' TP, in high
precision, and the conversion report names it). ``replicated_with_grad_allreduce`` is installed as an instance
``forward`` up to 5.24 and as a forward pre-hook from 5.25: both are recognised. Whether these internals are
unchanged is checked per feature, by source hash (internals/transformers_features.py).
"""

from __future__ import annotations

KNOWN_STYLES = ("ColwiseParallel", "RowwiseParallel")
EXPERTS_STYLE = "MoeExpertsParallel"  # ``moe_tp_experts``: each rank runs its shard of every expert, outputs summed
_STYLE_ATTRS = ("input_layouts", "output_layouts", "use_local_output")


def tp_style(module):
    """The transformers TP style object captured by the instance ``forward`` it installed, or None."""
    forward = module.__dict__.get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "install_forward") and (hasattr(value, "transform_inputs_pre_forward")
                                                  or any(hasattr(value, a) for a in _STYLE_ATTRS)):
            return value
    return None


def style_layouts(style):
    """(input layouts, output layouts, local output) of a known style, or None for one this package does
    not know (fail closed)."""
    if type(style).__name__ not in KNOWN_STYLES or not all(hasattr(style, a) for a in _STYLE_ATTRS):
        return None
    return style.input_layouts, style.output_layouts, style.use_local_output


GRAD_ALLREDUCE_STYLE = "ReplicatedWithGradAllReduce"


def has_grad_allreduce(module) -> bool:
    """Whether transformers gave ``module`` the ``replicated_with_grad_allreduce`` style, in either form it installs
    it: an instance ``forward`` (``tp_forward``, 5.16-5.24) or a forward pre-hook (``tp_forward_pre_hook``, 5.25)."""
    return _grad_allreduce_forward(module) is not None or bool(_grad_allreduce_pre_hooks(module))


def _grad_allreduce_forward(module):
    forward = module.__dict__.get("forward")
    return forward if GRAD_ALLREDUCE_STYLE in getattr(forward, "__qualname__", "") else None


def _grad_allreduce_pre_hooks(module) -> list:
    return [key for key, hook in module._forward_pre_hooks.items()
            if GRAD_ALLREDUCE_STYLE in getattr(hook, "__qualname__", "")]


def remove_grad_allreduce(module) -> bool:
    """Take ``replicated_with_grad_allreduce`` off ``module`` (either form; True when it had it): the style registers a
    post-accumulate-grad hook on each parameter at forward, which needs a leaf parameter and a plain gradient — the
    caller sums the gradient over the TP group instead (fixes/convert/tp.py). The instance ``forward`` goes back to the
    module's own (the one the style closed over); the pre-hook is removed."""
    forward = _grad_allreduce_forward(module)
    if forward is not None:
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
        if "original_forward" not in cells:
            raise RuntimeError(f"accel_fp8_fix: {GRAD_ALLREDUCE_STYLE}'s tp_forward no longer closes over "
                               "`original_forward`; this package cannot take over its gradient all-reduce")
        original = cells["original_forward"].cell_contents
        if getattr(original, "__func__", None) is type(module).forward:
            del module.forward
        else:
            module.forward = original
    hooks = _grad_allreduce_pre_hooks(module)
    for key in hooks:
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
        getattr(module, "_forward_pre_hooks_always_called", {}).pop(key, None)
    return forward is not None or bool(hooks)


def plan_styles(model) -> dict:
    """{module pattern: style name} of the TP plan transformers applied to ``model`` ({} when none)."""
    return dict(getattr(model, "_tp_plan", None) or {})


def replace_original_forward(module, forward) -> bool:
    """Make ``forward`` what the TP forward transformers installed on ``module`` calls inside its input / output
    transforms (its closure's ``original_forward``); True when done, False when ``module`` has no TP forward."""
    installed = module.__dict__.get("forward")
    code = getattr(installed, "__code__", None)
    if code is None or "original_forward" not in code.co_freevars or tp_style(module) is None:
        return False
    cells = dict(zip(code.co_freevars, installed.__closure__ or ()))
    cells["original_forward"].cell_contents = forward
    return True
