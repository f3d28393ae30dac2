"""A checkpoint torn by a killed ``save_state`` is never loaded (A25 in docs/failures.md).

``save_state`` writes the models and optimizers (DCP folders under FSDP2 and TP), then every process its own
``random_states_<rank>.pkl``, then the schedulers, samplers and custom objects. A process killed part-way leaves a
folder that stock ``load_state`` takes as it is: accelerate 1.13-1.16 skips a missing RNG file with an INFO line
(``checkpointing.py``: "Could not load random states"), so the resumed run silently differs from the one it
continues; a DCP folder without its ``.metadata`` fails inside DCP after the models before it were loaded; and with
automatic checkpoint naming ``load_state()`` picks the newest folder, torn or not.

Here, for a model this package prepared for FP8: ``save_state`` ends with every process past the save, then the main
process writes ``MARKER`` (every file's size) into the folder; ``load_state`` checks the folder before it reads
anything. A folder with the marker must match it; one without (stock accelerate's) must have what every complete save
has: each DCP folder's ``.metadata`` and every process's RNG file. What fails is refused by name, nothing loaded, with
the newest complete checkpoint beside it (``newest_complete_checkpoint``, public). Torch-free.
"""

from __future__ import annotations

import json
import os
import re

MARKER = "accel_fp8_fix_checkpoint.json"
RNG_FILE = "random_states_{}.pkl"  # accelerate's RNG_STATE_NAME, one per process


class IncompleteCheckpointError(RuntimeError):
    """``load_state`` of a checkpoint a ``save_state`` did not finish writing."""


def _files(folder: str) -> dict:
    """{relative path: size} of every file under ``folder`` but the marker."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MARKER:
                found[rel] = os.path.getsize(path)
    return found


def write_marker(folder: str, num_processes: int) -> None:
    """The main process, once every process has finished its part of the save: the marker, written atomically."""
    record = {"num_processes": num_processes, "files": _files(folder)}
    partial = os.path.join(folder, MARKER + ".partial")
    with open(partial, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(partial, os.path.join(folder, MARKER))


def missing_parts(folder: str, num_processes: int | None = None) -> list[str]:
    """What ``folder`` lacks of a complete ``save_state`` (empty: complete). With the marker: every file it lists, at
    its size. Without: every DCP folder's ``.metadata`` and the RNG file of each of ``num_processes`` processes
    (default: ``WORLD_SIZE``)."""
    marker = os.path.join(folder, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            record = json.load(f)
        found = _files(folder)
        return [f"{rel} ({'missing' if rel not in found else f'{found[rel]} bytes, written as {size}'})"
                for rel, size in sorted(record["files"].items()) if found.get(rel) != size]
    missing = []
    for root, _, names in sorted(os.walk(folder)):
        if any(n.endswith(".distcp") for n in names) and ".metadata" not in names:
            missing.append(f"{os.path.relpath(os.path.join(root, '.metadata'), folder)} (DCP's index, written last)")
    processes = num_processes if num_processes is not None else int(os.environ.get("WORLD_SIZE", "1"))
    missing += [f"{RNG_FILE.format(i)} (process {i}'s RNG states)" for i in range(processes)
                if not os.path.exists(os.path.join(folder, RNG_FILE.format(i)))]
    return missing


def _iteration(folder: str) -> int:
    """accelerate's key for automatic checkpoint names (``Accelerator.save_state``'s ``_inner``)."""
    numbers = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)
    return int(numbers[0]) if numbers else -1


def newest_complete_checkpoint(checkpoints: str, num_processes: int | None = None) -> str | None:
    """The newest folder under ``checkpoints`` (accelerate's ``<project_dir>/checkpoints`` of automatic checkpoint
    naming: ``checkpoint_<n>``) that a ``save_state`` finished writing; ``None`` when there is none."""
    if not os.path.isdir(checkpoints):
        return None
    folders = sorted((os.path.join(checkpoints, f) for f in os.listdir(checkpoints)
                      if os.path.isdir(os.path.join(checkpoints, f))), key=_iteration)
    return next((f for f in reversed(folders) if not missing_parts(f, num_processes)), None)


def refuse(input_dir: str, missing: list[str], num_processes: int) -> None:
    """Refuse ``input_dir`` by name when a ``save_state`` did not finish it (``missing``: ``missing_parts``)."""
    if not missing:
        return
    parent = os.path.dirname(os.path.normpath(input_dir))
    newest = newest_complete_checkpoint(parent, num_processes)
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    instead = (f"The newest complete checkpoint beside it is {newest}: load that one "
               f"(accelerator.load_state({newest!r})), and move {input_dir} out of {parent} so that automatic "
               "checkpoint naming neither loads nor saves over it."
               if newest else f"No complete checkpoint is beside it in {parent}.")
    raise IncompleteCheckpointError(
        f"accel_fp8_fix: load_state refuses {input_dir} before reading anything: the checkpoint is incomplete - "
        f"{shown} - a save_state that did not finish (a process was killed or failed while writing it); stock "
        f"accelerate would load what is there and skip a missing RNG file silently, so the resumed run would differ. "
        + instead)


def load_dir(accelerator, input_dir) -> str | None:
    """The folder ``load_state(input_dir)`` reads: ``input_dir``, or with automatic checkpoint naming the newest
    folder of ``<project_dir>/checkpoints`` (accelerate's choice)."""
    if input_dir is not None:
        return os.path.expanduser(str(input_dir))
    config = accelerator.project_configuration
    checkpoints = os.path.join(accelerator.project_dir or "", "checkpoints")
    if not config.automatic_checkpoint_naming or not os.path.isdir(checkpoints):
        return None
    folders = sorted((os.path.join(checkpoints, f) for f in os.listdir(checkpoints)), key=_iteration)
    return folders[-1] if folders else None
