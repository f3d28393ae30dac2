"""``accelerate.utils.transformer_engine.convert_model`` on the non-sharded paths (one GPU, DDP) (A4).

Stock returns at the first Linear TE cannot take, leaving every later sibling unconverted; here that
Linear is skipped with the reason, its siblings are converted, and the Parameter objects are taken over
instead of copied (the same conversion as after sharding).
"""

from __future__ import annotations

from torch import nn

from .te_convert import convert_after_sharding


def convert_model(wrapped, instance, args, kwargs):
    """``accelerate.utils.transformer_engine.convert_model`` (non-sharded paths: one GPU, DDP): skip a
    Linear TE cannot take instead of returning and leaving every later sibling unconverted (A4), and take
    over the Parameter objects instead of copying them. Reverse conversion and HPU stay stock."""
    import inspect

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    opts = bound.arguments
    from accelerate.utils import is_hpu_available

    if not opts["to_transformer_engine"] or is_hpu_available():
        return wrapped(*args, **kwargs)
    import transformer_engine.pytorch as te

    model = opts["model"]
    exclude = () if opts["_convert_linear"] else tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    convert_after_sharding(model, te, convert_layernorm=opts["_convert_ln"], exclude=exclude)
