"""The demo: FSDP2 + Transformer Engine FP8 through `accelerate launch`, with no accel_fp8_fix import.

Run by scripts/demo.sh on CPU processes (gloo) with the Transformer Engine *emulation*; the same script
runs unchanged on GPUs with real TE. accel_fp8_fix is switched on by `fp8_config: {accel_fp8_fix: true}`
in the accelerate config file (examples/fsdp2_fp8.yaml), not by this script.
"""

import sys

import torch
from torch import nn

from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, TERecipeKwargs


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim=128, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(steps=int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
        ),
        kwargs_handlers=[TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")],
    )
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except Exception as exc:  # the stock failure, shown plainly (demo with the patches off)
        accelerator.print(f"prepare() failed on stock accelerate: {type(exc).__name__}: {exc}")
        raise SystemExit(1)

    te_modules = [m for m in model.modules() if hasattr(m, "fp8_meta")]
    generator = torch.Generator().manual_seed(accelerator.process_index)
    x = torch.randn(32, 128, generator=generator)
    y = torch.randn(32, 16, generator=generator)
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fp8_active = any(getattr(m, "fp8", False) for m in te_modules)
        accelerator.print(f"step {step}: loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}  fp8 active: {fp8_active}")

    setup = getattr(accelerator, "accel_fp8_fix", None)
    if "accel_fp8_fix" in sys.modules:
        import accel_fp8_fix

        accelerator.print(f"patch set: {accel_fp8_fix.report().patch_set} ({accel_fp8_fix.report().mode})")
    else:
        accelerator.print("patch set: none (accel_fp8_fix not active)")
    accelerator.print(
        f"distributed: {accelerator.distributed_type}, {accelerator.num_processes} processes; "
        f"TE modules: {len(te_modules)}; FP8 on: {bool(setup and setup.fp8_enabled)}"
        + (f"; amax group ranks {list(setup.amax_group_ranks)}" if setup else "")
    )
    if not (setup and setup.fp8_enabled):
        accelerator.print("FP8 was NOT active: stock accelerate never wraps the FSDP2 model in TE autocast (A2).")
    accelerator.end_training()


if __name__ == "__main__":
    main()
