"""Run by `accelerate launch` / torchrun in activation tests: the script never imports accel_fp8_fix.

It records, in each worker, whether accelerate's `Accelerator.prepare` is our wrapper *before* touching
the package, then reads the package's report.
"""

import json
import os
import sys

import accelerate.accelerator

prepare_type = type(accelerate.accelerator.Accelerator.__dict__["prepare"]).__name__
imported_by_startup = "accel_fp8_fix" in sys.modules

import accel_fp8_fix  # noqa: E402  (to read the report; activation happened at start-up, or happens now)

out = {
    "rank": int(os.environ.get("RANK", "0")),
    "prepare_type": prepare_type,
    "imported_by_startup": imported_by_startup,
    "mode": accel_fp8_fix.report().mode,
    "patch_set": accel_fp8_fix.report().patch_set,
    "flag_env": os.environ.get("ACCELERATE_FP8_ACCEL_FP8_FIX"),
    "prepare_type_after_import": type(accelerate.accelerator.Accelerator.__dict__["prepare"]).__name__,
    "te_kernels": getattr(sys.modules.get("transformer_engine_torch"), "__name__", None),
}
with open(os.path.join(sys.argv[1], f"rank{out['rank']}.json"), "w") as fh:
    json.dump(out, fh)
