"""transformers tensor-parallel internals: the style a TP-sharded module was given.

transformers 5.x installs an *instance* ``forward`` (``tp_forward``) that closes over the style object
(``style.install_forward(module, mesh)``); the style's ``input_layouts`` / ``output_layouts`` /
``use_local_output`` say what that module's TP contract is. Styles whose contract this package knows are
listed in ``KNOWN_STYLES``; any other style fails closed (the module keeps transformers' TP, in high
precision, and the conversion report names it).
"""

from __future__ import annotations

KNOWN_STYLES = ("ColwiseParallel", "RowwiseParallel")
EXPERTS_STYLE = "MoeExpertsParallel"  # ``moe_tp_experts``: each rank runs its shard of every expert, outputs summed
_STYLE_ATTRS = ("input_layouts", "output_layouts", "use_local_output")


def _version(versions=None) -> str:
    """``transformers <version>``: from ``versions`` (the check), else from the imported transformers (a TP
    model exists, so transformers is imported)."""
    if versions is None:
        import transformers

        return f"transformers {transformers.__version__}"
    return f"transformers {versions.get('transformers')}"


def check(versions) -> list[str]:
    """Checked when the patch set is applied if transformers' TP module is already imported (importing
    transformers just to check it would double the cost of ``import accelerate``); otherwise the accessors
    below fail closed at first use: an unrecognised style keeps its module in high precision, named."""
    import sys

    tp = sys.modules.get("transformers.distributed.tensor_parallel")
    if tp is None:
        return []
    problems = []
    for name in KNOWN_STYLES:
        cls = getattr(tp, name, None)
        if cls is None:
            problems.append(f"{_version(versions)}: transformers.distributed.tensor_parallel.{name} is gone")
        elif not hasattr(cls, "install_forward"):
            problems.append(f"{_version(versions)}: {name}.install_forward is gone (TP forward is installed differently)")
    return problems


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


def grad_allreduce_original_forward(module):
    """The module's own forward if transformers gave it the ``replicated_with_grad_allreduce`` style, else None.

    That style (``ReplicatedWithGradAllReduce``: Qwen3 / Gemma3 ``q_norm`` / ``k_norm``, which see only this
    rank's heads) keeps the parameter plain and, at each forward, registers a post-accumulate-grad hook on it
    that all-reduces its gradient over the TP group — which needs the parameter to be a leaf. Raises (naming
    the transformers version) when the style is recognised but its forward is no longer built as expected.
    """
    forward = module.__dict__.get("forward")
    if forward is None or "ReplicatedWithGradAllReduce" not in getattr(forward, "__qualname__", ""):
        return None
    cells = dict(zip(getattr(forward, "__code__").co_freevars, forward.__closure__ or ()))
    if "original_forward" not in cells:
        raise RuntimeError(
            f"accel_fp8_fix: {_version()}: ReplicatedWithGradAllReduce's tp_forward no longer closes over "
            "`original_forward`; this package cannot take over its gradient all-reduce"
        )
    return cells["original_forward"].cell_contents


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
