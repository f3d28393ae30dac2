"""Every setting this package reads, with one parser: environment variables and the accelerate config's
``fp8_config`` keys (which ``accelerate launch`` exports to every worker as ``ACCELERATE_FP8_<KEY>``).

Kinds and accepted spellings (leading / trailing blanks ignored; an empty value is the same as unset):

* ``bool``: ``1 true yes on`` / ``0 false no off``, case-insensitive;
* ``enum``: one of the listed names, case-insensitive;
* ``path``: a folder; ``0 false no off`` also mean unset (as the start-up gate of ``accel_fp8_fix.pth`` reads it);
* ``seconds``: a number >= 0.

Anything else raises ``ValueError`` naming the setting, the value and the accepted values. ``doctor --launch``
and the run read every setting through :func:`parse` (the doctor turns ``fp8_config`` into the variables
accelerate exports, :func:`exported_fp8_env`, then reads those), so they cannot disagree.

``owner``: who reads it — ``package`` (this package: every read goes through :func:`get`), ``rehearsal`` (the
CPU rehearsal, ``accel_fp8_fix.rehearsal``, with its own reader that accepts exactly what is listed here),
``diagnostics`` (``accel_fp8_fix.diagnostics``: the collective-order audit a launch's start-up hook installs) or
``testing`` (``accel_fp8_fix.testing``). Stdlib only, and nothing from the package but ``caches`` (the layer every
other one reads: tests/unit/test_layout.py): imported by ``import accel_fp8_fix``. Choices another layer owns are handed in
(:func:`provide_choices`: the patch sets' names).
"""

from __future__ import annotations

import os

from . import caches

ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("0", "false", "no", "off")
FP8_CONFIG_PREFIX = "ACCELERATE_FP8_"

__all__ = ["Setting", "REGISTRY", "ON_VALUES", "OFF_VALUES", "REHEARSAL", "DEPRECATED", "RECIPE_CLASSES",
           "RECIPE_ALIASES", "parse", "get", "check", "exported_fp8_env", "setting_for_config_key", "provide_choices"]


class Setting:
    """One setting: ``name`` (the environment variable), ``kind``, ``meaning``, ``choices`` (enum: value ->
    meaning, or a function returning that mapping), ``config_key`` (its ``fp8_config`` key, if any), ``owner``,
    ``default`` (what unset means, in words)."""

    __slots__ = ("name", "kind", "meaning", "choices", "config_key", "owner", "default", "case_sensitive")

    def __init__(self, name, kind, meaning, choices=None, config_key=None, owner="package", default="",
                 case_sensitive=False):
        self.name, self.kind, self.meaning, self.choices = name, kind, meaning, choices
        self.config_key, self.owner, self.default, self.case_sensitive = config_key, owner, default, case_sensitive

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.kind!r})"

    @property
    def label(self) -> str:
        """How errors name it: the config key too when it has one."""
        return f"fp8_config.{self.config_key} ({self.name})" if self.config_key else self.name

    def choice_map(self) -> dict:
        choices = self.choices() if callable(self.choices) else self.choices
        return dict(choices or {})

    def accepted(self) -> str:
        if self.kind == "bool":
            return f"{' / '.join(ON_VALUES)} or {' / '.join(OFF_VALUES)} (case-insensitive; empty = unset)"
        if self.kind == "enum":
            case = "" if self.case_sensitive else "case-insensitive; "
            return f"one of {', '.join(self.choice_map())} ({case}empty = unset)"
        if self.kind == "path":
            return f"a folder ({' / '.join(OFF_VALUES)} or empty = unset)"
        if self.kind == "seconds":
            return "a number of seconds >= 0 (empty = unset)"
        if self.kind == "count":
            return "a whole number >= 1 (empty = unset)"
        raise AssertionError(self.kind)  # pragma: no cover

    def example(self) -> str:
        """A value to put in a suggested fix."""
        if self.kind == "bool":
            return "1"
        if self.kind == "enum":
            return next(iter(self.choice_map()), "")
        return {"path": "/path/to/folder", "count": "200"}.get(self.kind, "60")

    def parse(self, raw):
        """The value ``raw`` (a string, or None for unset) means: None when unset, else bool / str / float / int."""
        if raw is None:
            return None
        text = str(raw).strip()
        if not text:
            return None
        key = text if self.case_sensitive else text.lower()
        if self.kind == "bool":
            if key in ON_VALUES:
                return True
            if key in OFF_VALUES:
                return False
        elif self.kind == "enum":
            choices = self.choice_map()
            if self.name == RECIPE:  # recipe names also have TE's class names as aliases (RECIPE_ALIASES)
                key = RECIPE_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
            if key in choices:
                return key
        elif self.kind == "path":
            return None if key in OFF_VALUES else text
        elif self.kind == "seconds":
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if value >= 0:
                return value
        elif self.kind == "count":
            if text.isdigit() and int(text) >= 1:
                return int(text)
        raise ValueError(f"accel_fp8_fix: {self.label}={text!r} is not a valid value: accepted {self.accepted()}. "
                         f"It sets: {self.meaning}")


# The Transformer Engine recipes by name, with their TE class (fixes/start/recipes.py builds and checks them), and the
# other spellings ACCELERATE_FP8_RECIPE / te_recipe_kwargs(recipe=) accept (TE's class names, snake-cased).
RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "block": "Float8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
RECIPE_ALIASES = {
    "delayed_scaling": "delayed", "delayedscaling": "delayed",
    "current_scaling": "current", "float8_current_scaling": "current", "float8currentscaling": "current",
    "mxfp8_block_scaling": "mxfp8", "mxfp8blockscaling": "mxfp8",
    "float8_block_scaling": "block", "fp8_block_scaling": "block", "float8blockscaling": "block",
    "nvfp4_block_scaling": "nvfp4", "nvfp4blockscaling": "nvfp4",
}


def provide_choices(name: str, choices) -> None:
    """Hand setting ``name`` its choices (value -> meaning, or a function returning that mapping) where another
    layer owns them: the patch sets' names are the engine's (``_api`` hands them in when it is imported, which
    ``import accel_fp8_fix`` does before anything can read a setting). Settings import nothing from the package."""
    REGISTRY[name].choices = choices


def _recipes() -> dict:
    return {name: f"TE {cls}" for name, cls in RECIPE_CLASSES.items()}


def _all_gather_choices() -> dict:
    return {"high_precision": "FSDP2 gathers weights in its policy's param_dtype (stock)",
            "fp8": "FSDP2 gathers converted TE Linear weights as FP8 + scales (FSDP2 only; delayed, current and "
                   "block recipes)"}


RECIPE = "ACCELERATE_FP8_RECIPE"
REHEARSAL = "ACCEL_FP8_FIX_REHEARSAL"
# The one install instruction for the CPU rehearsal (README, docs/rehearsal.md and the start-up message say it):
# its own distribution, built from a checkout of this repository; it brings Transformer Engine's pure-Python wheel.
REHEARSAL_INSTALL = "pip install ./packaging/rehearsal"
DEPRECATED = {"ACCEL_FP8_FIX_EMULATE_TE": REHEARSAL}  # old name -> new name: read when the new one is unset
# torch's own variable: how many collectives c10d's flight recorder keeps (read once, when the first process group
# is made). The collective-order audit reads its records there (accel_fp8_fix.diagnostics.collective_order), so
# the ranks the test bed starts and the start-up hook under ACCEL_FP8_FIX_COLLECTIVE_AUDIT set it before torch does.
FLIGHT_RECORDER = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 16384
_warned: set = set()
caches.register("settings: deprecated names warned about", _warned.clear)

REGISTRY: dict = {s.name: s for s in (
    Setting("ACCEL_FP8_FIX", "bool", "on: every Python process of the environment activates the fixes at start-up "
            "(the .pth trampoline); off: every activation is turned off, even an explicit import", default="import "
            "activates; nothing at start-up"),
    Setting("ACCELERATE_FP8_ACCEL_FP8_FIX", "bool", "the accelerate config flag: on activates the fixes in every "
            "worker `accelerate launch` starts", config_key="accel_fp8_fix", default="off"),
    Setting("ACCEL_FP8_FIX_STRICT", "bool", "on: installed versions outside every supported window raise "
            "UnsupportedVersionError instead of a warning", default="off"),
    Setting("ACCEL_FP8_FIX_PATCH_SET", "enum", "use this patch set (by name) whatever the installed versions",
            case_sensitive=True, default="chosen from the installed versions"),  # choices: provide_choices (_api)
    Setting("ACCEL_FP8_FIX_ALLOW_UNTESTED", "bool", "on: a torch / accelerate / Transformer Engine release newer "
            "than every window (never an older one) gets the newest set whose only misfits are such releases, "
            "applied only if every apply-time check passes, and said once; a transformers internal whose source "
            "matches no tested release is used anyway where a model needs it (said once) instead of refused at "
            "prepare", default="off"),
    Setting(REHEARSAL, "bool", "on: the CPU rehearsal (Transformer Engine's Python over a CPU kernel shim, "
            "accelerate's CPU gates opened); install: " + REHEARSAL_INSTALL + " (from a checkout)", default="off"),
    Setting("ACCEL_FP8_FIX_EMULATE_TE", "bool", f"deprecated name of {REHEARSAL} (read when that is unset, with a "
            "one-time FutureWarning)", default="off"),
    Setting("ACCEL_FP8_FIX_AUDIT", "bool", "on: print audit(model) after prepare (the mesh's first rank)",
            default="off"),
    Setting("ACCEL_FP8_FIX_COVERAGE_WARNING", "bool", "off: no RuntimeWarning after prepare when GEMMs besides the "
            "output layer stay in high precision (the figure stays in audit(model) and the log)", default="on"),
    Setting("ACCEL_FP8_FIX_LOG_RANKS", "enum", "which ranks emit the package's log messages",
            choices={"first": "rank 0 only", "all": "every rank"}, default="first"),
    Setting(RECIPE, "enum", "the Transformer Engine recipe (docs: README 'FP8 recipes'); TE class names are "
            "accepted too (e.g. Float8CurrentScaling, delayed_scaling)", choices=_recipes, config_key="recipe",
            default="delayed (or mxfp8 with use_mxfp8_block_scaling)"),
    Setting("ACCELERATE_FP8_ALL_GATHER", "enum", "how FSDP2 all-gathers the weights of the Linears converted to "
            "TE: fp8 = quantized on the shard, gathered as FP8 + one scale, masters and checkpoints unchanged "
            "(docs/fixes.md, 'FP8 all-gather')", choices=lambda: dict(_all_gather_choices()), config_key="all_gather",
            default="high_precision"),
    Setting("ACCEL_FP8_FIX_EXIT_TIMEOUT", "seconds", "the bound on the exit handler: draining gloo's groups, "
            "destroying them, waiting for their worker threads to park (fixes/start/clean_exit.py)", default="60"),
    Setting("ACCEL_FP8_FIX_EXIT_GRACE", "seconds", "without /proc (not Linux): how long the exit handler holds the "
            "interpreter for gloo's worker threads; with /proc it waits until they are parked (fixes/start/clean_exit.py)",
            default="0.2"),
    Setting("ACCEL_FP8_FIX_TEST_PROFILE", "path", "append one JSON line per multi-process launch (its ranks' start-up, "
            "scenario and exit times) to this file: scripts/suite_profile.py reads them (docs/testing.md)",
            owner="testing"),
    Setting("ACCEL_FP8_FIX_TEST_POOL_MAX_THREADS", "count", "a pooled rank holding more OS threads than this after "
            "a run closes its pool (accel_fp8_fix.testing.pool, docs/testing.md)", owner="testing", default="200"),
    Setting("ACCEL_FP8_FIX_TEST_POOL_FORK", "bool", "on: a rank pool's start-up interpreter imports once and forks "
            "the ranks; off: every rank is started anew (accel_fp8_fix.testing.pool, docs/testing.md)", owner="testing",
            default="on"),
    Setting("ACCEL_FP8_FIX_COLLECTIVE_AUDIT", "path", "record this process's collectives into this folder for the "
            "cross-rank order check (accel_fp8_fix.diagnostics.collective_order, docs/testing.md)", owner="diagnostics",
            default="off"),
    Setting("ACCEL_FP8_FIX_REHEARSAL_TARGET", "enum", "the GPU and CUDA stack the CPU rehearsal answers as",
            choices={"h200-cu130": "H200, CUDA 13.0 (sm90)", "h100-cu128": "H100, CUDA 12.8 (sm90)",
                     "b200-cu130": "B200, CUDA 13.0 (sm100)", "l40s-cu128": "L40S, CUDA 12.8 (sm89)"},
            owner="rehearsal", default="h200-cu130"),
    Setting("ACCEL_FP8_FIX_CPU_TE_ARCH", "enum", "the compute capability the CPU rehearsal reports (over the target's)",
            choices={"sm89": "8.9 (Ada)", "sm90": "9.0 (Hopper)", "sm100": "10.0 (Blackwell)"}, owner="rehearsal",
            default="the target's"),
    Setting("ACCEL_FP8_FIX_REHEARSAL_FAST_ACCUM", "enum", "1: the CPU rehearsal models Hopper's FP8 fast "
            "accumulation (docs/rehearsal.md)", choices={"0": "off", "1": "on"}, owner="rehearsal", default="0"),
    Setting("ACCEL_FP8_FIX_REHEARSAL_TF32", "enum", "how the CPU rehearsal rounds the operands of TE's all-fp32 "
            "GEMMs, which TE runs in TF32 on the device (docs/rehearsal.md)",
            choices={"auto": "to nearest (ties away) where the target's capability is >= 8.0, else off",
                     "rna": "to nearest, ties away from zero (cvt.rna.tf32.f32)", "truncate": "toward zero",
                     "off": "exact fp32 (a wiring check's bit-for-bit comparison)"},
            owner="rehearsal", default="auto"),
)}


def setting_for_config_key(key: str) -> Setting | None:
    for setting in REGISTRY.values():
        if setting.config_key == key:
            return setting
    return None


def parse(name: str, raw):
    """What the string ``raw`` means for setting ``name`` (None: unset); ValueError when it is not accepted."""
    return REGISTRY[name].parse(raw)


def get(name: str, environ=None):
    """The value of setting ``name`` in ``environ`` (default ``os.environ``): None when unset. A deprecated old
    name of the setting is read when the new one is unset, with a FutureWarning once per process (rank 0)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or not str(raw).strip():
        for old, new in DEPRECATED.items():
            if new == name and str(environ.get(old) or "").strip():
                _warn_deprecated(old, new)
                return parse(old, environ[old])
    return parse(name, raw)


def _warn_deprecated(old: str, new: str) -> None:
    if old in _warned or os.environ.get("RANK", "0") != "0":
        return
    _warned.add(old)
    import warnings

    warnings.warn(f"accel_fp8_fix: {old} is deprecated; set {new} instead (same values)", FutureWarning,
                  stacklevel=3)


def check(environ=None, owners=("package", "rehearsal", "diagnostics", "testing")) -> list:
    """(setting, ValueError) for every registered variable set to a value it does not accept."""
    environ = os.environ if environ is None else environ
    problems = []
    for setting in REGISTRY.values():
        if setting.owner not in owners:
            continue
        try:
            setting.parse(environ.get(setting.name))
        except ValueError as exc:
            problems.append((setting, exc))
    return problems


def exported_fp8_env(fp8_config: dict) -> dict:
    """The ``ACCELERATE_FP8_*`` variables ``accelerate launch`` exports for this ``fp8_config`` mapping
    (accelerate's ``setup_fp8_env``: a key not starting with ``fp8`` gets ``fp8_`` in front, the value is
    ``str(value)``; ``override_linear_precision`` becomes three variables)."""
    env = {}
    for key, value in (fp8_config or {}).items():
        if value is None:
            continue
        arg = str(key) if str(key).startswith("fp8") else f"fp8_{key}"
        if arg == "fp8_override_linear_precision":
            for part, item in zip(("FPROP", "DGRAD", "WGRAD"), value):
                env[f"{FP8_CONFIG_PREFIX}OVERRIDE_{part}"] = str(item)
        else:
            env[f"ACCELERATE_{arg.upper()}"] = str(value)
    return env
