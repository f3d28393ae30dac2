"""A user's training script, as `accelerate launch` runs it (tests/distributed/test_clean_exit.py): FSDP2 through
accelerate, a tiny transformers Qwen2 built from a config, a few steps, and no `end_training()` /
`destroy_process_group()` at the end — most scripts have neither. It must leave with exit status 0.

    accelerate launch --config_file CONFIG tests/support/clean_exit_script.py [--steps N] [--in-flight] [--end-training]

`--in-flight` ends with an all-reduce still running on gloo's worker thread when the script returns (what widens
the teardown race: the worker drops its tensors while the interpreter finalizes). `--end-training` ends with
`accelerator.end_training()` instead (what examples/demo.py does): stock destroys the process group there, and the
groups FSDP2 and the mesh still hold keep their worker threads into teardown all the same.
"""

import argparse

import torch
from accelerate import Accelerator
from transformers import Qwen2Config, Qwen2ForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--in-flight", action="store_true")
    parser.add_argument("--end-training", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    te_modules = sum(type(m).__module__.startswith("transformer_engine") for m in model.modules())
    accelerator.print(f"mixed precision {accelerator.mixed_precision}, te modules {te_modules}")
    for step in range(args.steps):
        ids = torch.randint(0, 128, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), "mean")
        accelerator.print(f"step {step} loss {mean.item():.4f}")
    if args.in_flight:
        torch.distributed.all_reduce(torch.ones(1 << 16), async_op=True)
    accelerator.print("training done")
    if args.end_training:
        accelerator.end_training()


if __name__ == "__main__":
    main()
