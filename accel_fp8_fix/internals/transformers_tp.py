"""transformers tensor-parallel internals: the style a TP-sharded module was given.

transformers 5.x installs an *instance* ``forward`` (``tp_forward``) that closes over the style object
(``style.install_forward(module, mesh)``); the style's ``input_layouts`` / ``output_layouts`` /
``use_local_output`` say what that module's TP contract is. Styles whose contract this package knows are
listed in ``KNOWN_STYLES``; any other style fails closed (the module keeps transformers' TP, in high
precision, and the conversion report names it).
"""

from __future__ import annotations

KNOWN_STYLES = ("ColwiseParallel", "RowwiseParallel")
_STYLE_ATTRS = ("input_layouts", "output_layouts", "use_local_output")


def _version() -> str:
    from ..engine.versions import installed_version

    return f"transformers {installed_version('transformers')}"


def check() -> list[str]:
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
            problems.append(f"{_version()}: transformers.distributed.tensor_parallel.{name} is gone")
        elif not hasattr(cls, "install_forward"):
            problems.append(f"{_version()}: {name}.install_forward is gone (TP forward is installed differently)")
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
