"""GPU truth kit: real Transformer Engine carried to a GPU machine without network, and the checks run there.

* ``python -m gpu_kit build`` (this machine, network): downloads the pinned TE wheels, builds TE's torch
  extension for the target Python / torch, and writes the bundle as parts of at most 60 MiB plus a manifest
  (sha256 of every part and file) under ``.gpu_kit/parts`` (git-ignored). Steps whose pins did not change
  are not redone.
* ``python -m gpu_kit plan``: the device commands, one per part (each carries that part), the last of which
  reassembles, verifies, installs (``pip --no-index --no-deps --target``) and runs ``gpu_kit.gpu_run``.
* ``python -m gpu_kit install``: reassemble + verify + install, on the GPU machine or (the CPU dry run) here.

``gpu_kit.kit`` is standard library only: it runs under the GPU machine's interpreter before anything is
installed. See docs/gpu.md.
"""
