"""python -m gpu_kit {build,plan,receive,probe,install,run,fixtures,derive-probe} — see gpu_kit/__init__.py and
docs/gpu.md."""

import sys


def main(argv: list[str]) -> int:
    verbs = {
        "build": ("gpu_kit.build", "build the kit here (network): pinned wheels, TE's torch extension, parts"),
        "plan": ("gpu_kit.plan", "print the device commands and what each carries"),
        "receive": ("gpu_kit.gpu_run", "GPU machine: check one carried part"),
        "probe": ("gpu_kit.gpu_run", "GPU machine: versions, and which backend runs two ranks on one GPU"),
        "install": ("gpu_kit.gpu_run", "reassemble, verify, install, import (GPU machine, or the CPU dry run)"),
        "run": ("gpu_kit.gpu_run", "GPU machine: install, then every check, results under --out"),
        "fixtures": ("gpu_kit.kernel_fixtures", "record TE's kernels on fixed inputs (GPU), or replay a file here"),
        "derive-probe": ("gpu_kit.derive_probe", "the collectives each rank job issues, from its audit on CPU"),
    }
    if not argv or argv[0] not in verbs:
        print(__doc__)
        for verb, (_, what) in verbs.items():
            print(f"  {verb:8} {what}")
        return 2
    import importlib

    from gpu_kit.kit import KitError

    module = importlib.import_module(verbs[argv[0]][0])
    try:
        return module.main(argv) if module.__name__ == "gpu_kit.gpu_run" else module.main(argv[1:])
    except KitError as exc:
        print(f"gpu_kit: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
