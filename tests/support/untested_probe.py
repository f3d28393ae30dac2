"""Run by tests/unit/test_untested_releases.py in a fresh interpreter whose ``sys.path`` starts with a folder
holding a ``torch-<version>.dist-info`` (so importlib.metadata reports that torch): ``changed`` first replaces a
function the patch set mirrors (``[[watch]]``), as a new release that rewrote it would. Prints the report."""

import json
import sys
import warnings

caught = []
warnings.showwarning = lambda message, *args, **kwargs: caught.append(str(message))
warnings.simplefilter("always")
if sys.argv[1] == "changed":
    import accelerate.utils.transformer_engine as mirrored

    def apply_fp8_autowrap(*args, **kwargs):  # the new release's rewrite
        return None

    mirrored.apply_fp8_autowrap = apply_fp8_autowrap
import accelerate  # noqa: E402,F401

import accel_fp8_fix  # noqa: E402

report = accel_fp8_fix.report()
print(json.dumps({"patch_set": report.patch_set, "reason": report.reason, "error": report.error,
                  "applied": sum(1 for p in report.patches if p["status"] == "applied"), "warnings": caught}))
