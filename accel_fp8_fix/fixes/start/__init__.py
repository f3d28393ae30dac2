"""Fixes settled before any model: at ``Accelerator()`` (settings, layout, the TE recipe and its ``TERecipeKwargs``,
when the FP8 all-gather may run) and at process start and exit."""
