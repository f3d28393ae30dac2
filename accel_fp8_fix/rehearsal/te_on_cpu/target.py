"""The GPU machine the CPU rehearsal answers as: one setting, named profiles.

Every hardware- or version-like answer the rehearsal gives Transformer Engine's frames comes from here:
the compute capability and ``torch.version.cuda`` (``cuda_as_cpu``), the cuBLASLt and cuDNN versions
(``tex.get_cublasLt_version`` / ``tex.get_cudnn_version``), the SM count, memory and L2 size.

Settings, read on every query (so a test can change them with ``monkeypatch.setenv``):

``ACCEL_FP8_FIX_REHEARSAL_TARGET=<profile>``
    The whole machine: one of ``PROFILES`` (default ``h200-cu130``, the project's GPU machine).
``ACCEL_FP8_FIX_CPU_TE_ARCH=sm89|sm90|sm100``
    Older, kept: overrides **only the compute capability** of the chosen profile (CUDA, cuBLASLt, cuDNN,
    SM count and memory stay the profile's). ``ACCEL_FP8_FIX_CPU_TE_ARCH=sm100`` alone therefore means
    "an H200's software stack answering capability 10.0"; for a coherent Blackwell pick
    ``ACCEL_FP8_FIX_REHEARSAL_TARGET=b200-cu130``.

Unknown values raise ``ValueError`` naming the variable, the value and the accepted ones.

Where the numbers come from (looked up 2026-12-01 from the wheels' metadata on PyPI, with
``pip install --dry-run --no-deps --report``; no wheel downloaded):

* CUDA version: the CUDA build of the torch wheel (``torch.version.cuda``). torch 2.11.0's PyPI manylinux
  wheel is the CUDA 13.0 build (METADATA ``Requires-Dist: cuda-toolkit[cublas,cudart,...]==13.0.2``), the
  same build as download.pytorch.org's ``2.11.0+cu130`` on the project's H200 (docs/gpu.md,
  gpu_kit/pins.toml). CUDA 12.8: torch 2.10.0's PyPI wheel (``nvidia-cuda-runtime-cu12==12.8.90``), the last
  PyPI torch built for 12.8 (torch 2.11's ``+cu128`` build lives on download.pytorch.org, unreachable here).
* cuBLASLt: ``cublasLtGetVersion()`` = major*10000 + minor*100 + patch of the cuBLAS the wheel pins.
  cu130: cuda-toolkit 13.0.2's ``cublas`` extra requires ``nvidia-cublas==13.1.0.3.*`` -> 130100.
  cu128: torch 2.10.0 requires ``nvidia-cublas-cu12==12.8.4.1`` -> 120804.
* cuDNN: ``cudnnGetVersion()`` = major*10000 + minor*100 + patch (cuDNN 9's encoding, which TE's
  ``decode_cudnn_version`` reads). cu130: torch 2.11.0 requires ``nvidia-cudnn-cu13==9.19.0.56`` -> 91900.
  cu128: torch 2.10.0 requires ``nvidia-cudnn-cu12==9.10.2.21`` -> 91002.
* SM count / memory / L2: the product's ``cudaDeviceProp`` as NVIDIA's data sheets give it (H200 SXM: 132
  SMs, 141 GB HBM3e, 60 MiB L2; H100 SXM: 132 SMs, 80 GB, 50 MiB L2; B200: 148 SMs, 180 GB per GPU in an
  HGX B200, 126 MiB L2; L40S: 142 SMs, 48 GB, 96 MiB L2). Memory is given in GiB as ``total_memory``
  reports it (H200: about 139.8 GiB, as the project's device tool describes its H200); the exact byte
  counts of a real board differ slightly (ECC, firmware reservations).
  L2 as torch's ``get_device_properties`` prints it on real boards (``L2_cache_size`` in MiB; a modal.com
  script of ai-bot-pro/achatbot, deploy/modal/src/llm/vllm/vlm/skywork_r1v.py): H200 60 MiB (132 SMs,
  143156 MiB), B200 126 MiB, and "NVIDIA H100 80GB HBM3" 50 MiB in several published printouts. The H200
  enables all twelve of GH100's memory controllers (six HBM3e stacks) and with them the whole 60 MB L2; the
  H100 SXM and PCIe enable ten and 50 MB (chipsandcheese.com, "Nvidia's H100: Funny L2"). Not yet read on
  the project's H200: the GPU kit's probe compares (gpu_kit/device.py). L40S's 96 MiB is not confirmed by a
  printout (one spec listing says 48 MB).
* Stream priority range: ``cudaDeviceGetStreamPriorityRange`` gives (0, -5) on sm75 and newer; not yet read on
  the device.

``cuda_as_cpu``'s device properties (SM count, memory, L2) are not read from here yet: that module is being
rewritten separately; ``profile().sm_count`` / ``total_memory`` / ``l2_cache`` are the values to use.
"""

from __future__ import annotations

import dataclasses
import os

ENV_TARGET = "ACCEL_FP8_FIX_REHEARSAL_TARGET"
ENV_ARCH = "ACCEL_FP8_FIX_CPU_TE_ARCH"
DEFAULT = "h200-cu130"

ARCHES = {"sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0)}


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    gpu: str
    capability: tuple[int, int]
    cuda: str  # torch.version.cuda
    cublaslt: int  # cublasLtGetVersion()
    cudnn: int  # cudnnGetVersion()
    sm_count: int  # cudaDeviceProp.multiProcessorCount
    total_memory: int  # bytes, cudaDeviceProp.totalGlobalMem
    l2_cache: int  # bytes, cudaDeviceProp.l2CacheSize
    sources: str
    # cudaDeviceGetStreamPriorityRange (least, greatest): 0 and -5 on sm75 and newer (reported for Turing and
    # A100, e.g. ExtremeFLOW/neko PR #830); not yet read on the project's H200
    stream_priority_range: tuple[int, int] = (0, -5)

    @property
    def cuda_tuple(self) -> tuple[int, int]:
        major, minor = self.cuda.split(".")[:2]
        return int(major), int(minor)


_GIB = 2**30
_MIB = 2**20

_CU130 = ("CUDA 13.0: torch 2.11.0 (PyPI) requires cuda-toolkit==13.0.2 -> nvidia-cublas==13.1.0.3 (cuBLASLt "
          "130100) and nvidia-cudnn-cu13==9.19.0.56 (cuDNN 91900)")
_CU128 = ("CUDA 12.8: torch 2.10.0 (PyPI, the CUDA 12.8 build) requires nvidia-cuda-runtime-cu12==12.8.90, "
          "nvidia-cublas-cu12==12.8.4.1 (cuBLASLt 120804) and nvidia-cudnn-cu12==9.10.2.21 (cuDNN 91002)")

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("h200-cu130", "NVIDIA H200", (9, 0), "13.0", 130100, 91900, 132, int(139.8 * _GIB), 60 * _MIB,
                "docs/gpu.md (the project's device machine: H200, torch 2.11.0+cu130); " + _CU130),
        Profile("h100-cu128", "NVIDIA H100 80GB HBM3", (9, 0), "12.8", 120804, 91002, 132, 80 * _GIB, 50 * _MIB,
                _CU128 + "; TE refuses Float8BlockScaling there (it needs CUDA >= 12.9)"),
        Profile("b200-cu130", "NVIDIA B200", (10, 0), "13.0", 130100, 91900, 148, 180 * _GIB, 126 * _MIB, _CU130),
        Profile("l40s-cu128", "NVIDIA L40S", (8, 9), "12.8", 120804, 91002, 142, 48 * _GIB, 96 * _MIB, _CU128),
    )
}


def _read(variable: str, accepted) -> str | None:
    value = os.environ.get(variable)
    if value is None or not value.strip():
        return None
    value = value.strip().lower()
    if value not in accepted:
        raise ValueError(f"{variable}={value!r}: expected one of {sorted(accepted)}")
    return value


def profile() -> Profile:
    """The profile the rehearsal answers as now (``ENV_TARGET``, then ``ENV_ARCH`` on the capability)."""
    chosen = PROFILES[_read(ENV_TARGET, PROFILES) or DEFAULT]
    arch = _read(ENV_ARCH, ARCHES)
    if arch is not None and ARCHES[arch] != chosen.capability:
        chosen = dataclasses.replace(chosen, capability=ARCHES[arch], gpu=f"{chosen.gpu} (answering {arch})")
    return chosen


def capability() -> tuple[int, int]:
    return profile().capability


def cuda_version() -> str:
    """``torch.version.cuda`` as TE's frames read it."""
    return profile().cuda
