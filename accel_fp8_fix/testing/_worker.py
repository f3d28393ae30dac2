"""One rank of :func:`accel_fp8_fix.testing.run_distributed` (``python -m accel_fp8_fix.testing._worker DIR RANK``)."""

import faulthandler
import importlib
import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def main(tmp: str, rank: str) -> None:
    tmp_dir = Path(tmp)
    payload = pickle.loads((tmp_dir / "payload.pkl").read_bytes())
    for path in reversed(payload["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    fn = importlib.import_module(payload["module"])
    for part in payload["qualname"].split("."):
        fn = getattr(fn, part)
    world_size = int(os.environ["WORLD_SIZE"])
    # Shortly before the launcher kills a hung run, print where this rank waits.
    faulthandler.dump_traceback_later(max(payload["timeout"] - 5, 1), exit=False)

    import torch.distributed as dist

    if payload["init_process_group"]:
        dist.init_process_group(
            "gloo",
            rank=int(rank),
            world_size=world_size,
            timeout=timedelta(seconds=payload["collective_timeout"]),
        )
    try:
        result = fn(int(rank), world_size, *payload["args"])
    except BaseException:
        # Report first and leave without destroy_process_group(): with peers gone it can block forever.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    (tmp_dir / f"rank{rank}.result").write_bytes(pickle.dumps(result))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank leaves while a peer may still be inside a collective with it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The result is written and every rank is past its last collective: leave without
    # destroy_process_group / interpreter teardown, where torch's C++ threads occasionally abort
    # ("terminate called without an active exception", seen in CI under load) and fail a finished rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
