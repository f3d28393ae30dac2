"""A25: which checkpoint folders a ``save_state`` finished, on folders laid out as accelerate writes them
(fixes/checkpoint/checkpoint_complete.py; the kills themselves: tests/distributed/test_fault_resume.py)."""

from __future__ import annotations

import types

import pytest

from accel_fp8_fix.fixes.checkpoint import checkpoint_complete as cc


def _checkpoint(folder, processes=2, metadata=True, marked=True):
    """A folder as ``save_state`` leaves it under FSDP2: DCP folders, one RNG file per process, the scheduler."""
    for dcp in ("pytorch_model_fsdp_0", "optimizer_0"):
        (folder / dcp).mkdir(parents=True)
        for rank in range(processes):
            (folder / dcp / f"__{rank}_0.distcp").write_bytes(b"x" * (10 + rank))
        if metadata:
            (folder / dcp / ".metadata").write_bytes(b"m" * 7)
    for rank in range(processes):
        (folder / f"random_states_{rank}.pkl").write_bytes(b"r" * 5)
    (folder / "scheduler.bin").write_bytes(b"s" * 3)
    if marked:
        cc.write_marker(str(folder), processes)
    return folder


def test_a_finished_save_is_complete_marked_or_not(tmp_path):
    assert cc.missing_parts(str(_checkpoint(tmp_path / "marked")), 2) == []
    assert cc.missing_parts(str(_checkpoint(tmp_path / "stock", marked=False)), 2) == []  # stock accelerate's


def test_the_marker_names_each_file_missing_or_changed(tmp_path):
    folder = _checkpoint(tmp_path / "c")
    (folder / "random_states_1.pkl").unlink()
    (folder / "scheduler.bin").write_bytes(b"s")
    assert cc.missing_parts(str(folder), 2) == ["random_states_1.pkl (missing)", "scheduler.bin (1 bytes, written as 3)"]


def test_without_the_marker_the_dcp_index_and_every_rng_file_are_required(tmp_path):
    folder = _checkpoint(tmp_path / "c", processes=2, metadata=False, marked=False)
    (folder / "random_states_1.pkl").unlink()
    assert cc.missing_parts(str(folder), 2) == [
        "optimizer_0/.metadata (DCP's index, written last)",
        "pytorch_model_fsdp_0/.metadata (DCP's index, written last)",
        "random_states_1.pkl (process 1's RNG states)"]
    assert cc.missing_parts(str(folder), 1) == [p for p in cc.missing_parts(str(folder), 2) if "random" not in p]


def test_the_newest_complete_checkpoint_by_accelerate_s_numbering(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (0, 2, 10):
        _checkpoint(checkpoints / f"checkpoint_{n}")
    assert cc.newest_complete_checkpoint(str(checkpoints), 2) == str(checkpoints / "checkpoint_10")  # 10 after 2
    (checkpoints / "checkpoint_10" / "random_states_0.pkl").unlink()
    assert cc.newest_complete_checkpoint(str(checkpoints), 2) == str(checkpoints / "checkpoint_2")
    assert cc.newest_complete_checkpoint(str(tmp_path / "none"), 2) is None


def test_the_refusal_names_the_folder_what_is_missing_and_what_to_load(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    _checkpoint(checkpoints / "checkpoint_0")
    torn = _checkpoint(checkpoints / "checkpoint_1")
    (torn / "random_states_1.pkl").unlink()
    with pytest.raises(cc.IncompleteCheckpointError) as caught:
        cc.refuse(str(torn), cc.missing_parts(str(torn), 2), 2)
    text = str(caught.value)
    assert text.startswith(f"accel_fp8_fix: load_state refuses {torn} before reading anything")
    assert "random_states_1.pkl (missing)" in text and f"accelerator.load_state('{checkpoints / 'checkpoint_0'}')" in text
    cc.refuse(str(checkpoints / "checkpoint_0"), [], 2)  # complete: no refusal


def test_load_dir_is_accelerate_s_choice(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (1, 9, 10):
        (checkpoints / f"checkpoint_{n}").mkdir(parents=True)
    config = types.SimpleNamespace(automatic_checkpoint_naming=True)
    acc = types.SimpleNamespace(project_configuration=config, project_dir=str(tmp_path))
    assert cc.load_dir(acc, None) == str(checkpoints / "checkpoint_10")
    assert cc.load_dir(acc, "~/x").endswith("/x") and not cc.load_dir(acc, "~/x").startswith("~")
    config.automatic_checkpoint_naming = False
    assert cc.load_dir(acc, None) is None


def test_the_public_names():
    import accel_fp8_fix

    assert accel_fp8_fix.newest_complete_checkpoint is cc.newest_complete_checkpoint
    assert accel_fp8_fix.IncompleteCheckpointError is cc.IncompleteCheckpointError


def test_stock_accelerate_loads_a_folder_without_this_process_s_rng_file_silently(tmp_path, monkeypatch):
    """The failure (A25) with stock accelerate: this process's RNG file is missing and ``load_accelerator_state``
    returns as if it had restored it — the torch RNG stays where it was."""
    import logging

    import torch
    from accelerate import checkpointing
    from accelerate.checkpointing import load_accelerator_state, save_accelerator_state

    monkeypatch.setattr(checkpointing, "logger", logging.getLogger("accelerate.checkpointing"))  # no PartialState here

    torch.manual_seed(1)
    save_accelerator_state(str(tmp_path), [], [], [], [], process_index=0, step=0)
    (tmp_path / "random_states_0.pkl").rename(tmp_path / "random_states_1.pkl.gone")
    torch.manual_seed(2)
    before = torch.get_rng_state()
    load_accelerator_state(str(tmp_path), [], [], [], [], process_index=0)  # no error
    assert torch.equal(torch.get_rng_state(), before)  # not restored to seed 1's state
    assert cc.missing_parts(str(tmp_path), 1) == ["random_states_0.pkl (process 0's RNG states)"]
