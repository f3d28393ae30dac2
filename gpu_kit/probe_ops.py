"""The collectives each rank job issues (``probe_ops.json``, written by ``python -m gpu_kit.derive_probe``) and the
verdict of the rank probe (``ranks_probe.py``) on them. Standard library only: the GPU machine reads it before
anything is installed.

``probe_ops.json``: ``{"derived_with": {...versions, date}, "source_sha256": sha256(ranks_job.py + rank_jobs.py),
"ops": {op_name: {"kind", "dtype", "reduce_op", "uneven", "form", "api", ...}}, "jobs": {job_name: [op_name]}}``.
An op name reads ``kind.dtype[.reduce_op][.uneven][.form][.functional]`` (``all_gather.uint8``,
``all_to_all.float32.uneven.functional``, ``all_reduce.float32.max``); ``form`` is ``tensor`` (the default, left out
of the name), ``list`` or ``coalesced``; ``api`` is ``c10d`` (``torch.distributed``) or ``functional``
(``torch.distributed._functional_collectives``, what DTensor, EP and CP issue).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILE = "probe_ops.json"
SOURCES = ("ranks_job.py", "rank_jobs.py")  # what the derivation ran: a change to either calls for a new one


def _directory(directory) -> Path:
    return Path(directory) if directory is not None else HERE


def load(directory=None) -> dict:
    """``probe_ops.json`` (of ``gpu_kit/``, or of ``directory``)."""
    return json.loads((_directory(directory) / FILE).read_text())


def ops_for(job_name: str, directory=None) -> list[str]:
    """The op names the job issues (KeyError for a job the file does not know: rerun derive_probe)."""
    jobs = load(directory)["jobs"]
    if job_name not in jobs:
        raise KeyError(f"{job_name!r} is not in {FILE} (jobs: {sorted(jobs)}): rerun python -m gpu_kit.derive_probe")
    return list(jobs[job_name])


def all_ops(directory=None) -> dict:
    """Every op the probe tries: the union over jobs, ``{op_name: spec}``."""
    return dict(load(directory)["ops"])


def source_sha256(directory=None) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((_directory(directory) / name).read_bytes())
    return digest.hexdigest()


def stale(directory=None) -> str | None:
    """Why ``probe_ops.json`` no longer describes the jobs (None: it does)."""
    directory = _directory(directory)
    try:
        recorded = load(directory).get("source_sha256")
    except (OSError, ValueError) as exc:
        return f"{directory / FILE} unreadable ({type(exc).__name__}: {exc}): run python -m gpu_kit.derive_probe"
    current = source_sha256(directory)
    if recorded != current:
        return (f"{FILE} was derived from another {' + '.join(SOURCES)} (sha256 {str(recorded)[:12]}..., now "
                f"{current[:12]}...): rerun python -m gpu_kit.derive_probe (CPU, a few minutes) and commit it")
    return None


def job_verdict(job_name: str, ranks: list[dict], world: int, directory=None) -> tuple[bool, dict]:
    """Can the job run where the probe gave ``ranks`` (the ``RANKS_PROBE`` json of each rank of a ``world``-rank
    probe)? ``(ok, failed)``: ``failed`` maps ``"ranks"`` (fewer answers than ranks), ``"init"`` or an op the job
    issues to ``{rank: what that rank said}`` (``"ranks"``: a sentence); empty when ok."""
    needed = ops_for(job_name, directory)
    failed: dict = {}
    answered = {r.get("rank", i): r for i, r in enumerate(ranks)}
    if len(answered) < world:
        missing = sorted(set(range(world)) - set(answered))
        failed["ranks"] = f"{len(answered)} of {world} ranks answered (missing: {missing})"
    for rank, result in sorted(answered.items()):
        if result.get("init") != "ok":
            failed.setdefault("init", {})[rank] = result.get("init", "no answer")
            continue
        ops = result.get("ops") or {}
        for op in needed:
            if ops.get(op) != "ok":
                failed.setdefault(op, {})[rank] = ops.get(op, "not tried")
    return not failed, failed
