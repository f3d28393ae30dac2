"""The rank jobs: several ranks on the one GPU through ``accelerate launch`` with the config flag (``ranks_job.py``),
in the order the GPU run takes them. Standard library only: ``gpu_run`` (GPU machine, before anything is installed)
and ``derive_probe`` (CPU, the collective-order audit of the same jobs) both read this table.

Each job is an accelerate config (``config_text``) plus environment; ``device="cpu"`` gives the same job on CPU
processes over gloo with the rehearsal (what ``derive_probe`` audits).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankJob:
    name: str
    world: int
    parallelism: dict  # parallelism_config_* sizes
    load: str = "build"  # ranks_job.py's third argument: build | distributed_config | expert_parallel
    env: dict = field(default_factory=dict)
    purpose: str = ""

    @property
    def layer(self) -> str:
        return "Qwen3MoeDecoderLayer" if self.load == "expert_parallel" else "LlamaDecoderLayer"


# In order of what only a GPU can tell: the FP8 all-gather at world size > 1 (FSDP2's copy-in stream and the
# quantize-once shard path), expert parallelism (uneven all-to-all dispatch), context parallelism (torch's ring),
# then FSDP2 x TP built here and loaded N-D by transformers (A18).
JOBS = (
    RankJob("fsdp2_ag", 2, {"dp_shard": 2}, env={"ACCELERATE_FP8_ALL_GATHER": "fp8"},
            purpose="FSDP2 with the FP8 all-gather on: FSDP2's copy-in stream at world size 2"),
    RankJob("fsdp2_ep", 4, {"dp_shard": 4}, load="expert_parallel",
            purpose="FSDP2 x EP: transformers' all-to-all dispatch, experts on TE grouped GEMMs in FP8"),
    RankJob("fsdp2_cp", 4, {"dp_shard": 2, "cp": 2},
            purpose="FSDP2 x CP inside maybe_context_parallel, torch's ring on the GPU's SDPA"),
    RankJob("fsdp2_tp", 4, {"dp_shard": 2, "tp": 2}, purpose="FSDP2 x TP, TP-sharded by the job"),
    RankJob("fsdp2_tp_loaded", 4, {"dp_shard": 2, "tp": 2}, load="distributed_config",
            purpose="FSDP2 x TP loaded N-D by transformers (DistributedConfig)"),
)
BY_NAME = {job.name: job for job in JOBS}

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: {use_cpu}
num_machines: 1
num_processes: {world}
machine_rank: 0
gpu_ids: all
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: HYBRID
  amax_history_len: 16
  amax_compute_algo: max
  accel_fp8_fix: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: {layer}
  fsdp_cpu_ram_efficient_loading: false
parallelism_config:
{parallelism}"""


def config_text(job: RankJob, device: str = "cuda") -> str:
    parallelism = "".join(f"  parallelism_config_{dim}_size: {size}\n" for dim, size in job.parallelism.items())
    return CONFIG.format(use_cpu="true" if device == "cpu" else "false", world=job.world, layer=job.layer,
                         parallelism=parallelism)
