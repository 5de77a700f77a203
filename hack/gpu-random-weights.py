"""Write random bfloat16 weights for a model directory that has only its
config (the Qwen3-8B shape of .gpu's make_models, say), as safetensors
shards, so that vLLM loads them from disk: --load-format dummy cannot
reload weights, and a level-2 sleep's wake-up reloads them.

    python3 hack/gpu-random-weights.py MODEL_DIR [SHARD_GB]

The tensors are drawn on the GPU when there is one (fast), N(0, 0.02).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

model_dir = sys.argv[1]
shard_bytes = int(float(sys.argv[2] if len(sys.argv) > 2 else 4) * (1 << 30))
config = AutoConfig.from_pretrained(model_dir)
with torch.device("meta"):
    shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).state_dict().items()}
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device=device).manual_seed(1234)
index, shard, size, n = {}, {}, 0, 0


def flush():
    global shard, size, n
    if shard:
        name = f"model-{n:05d}.safetensors"
        save_file(shard, os.path.join(model_dir, name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1


for k, shape in shapes.items():
    if k.endswith("norm.weight"):
        t = torch.ones(shape, dtype=torch.bfloat16)
    else:
        t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
    shard[k] = t
    size += t.numel() * 2
    if size >= shard_bytes:
        flush()
flush()
total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
json.dump({"metadata": {"total_size": total}, "weight_map": index},
          open(os.path.join(model_dir, "model.safetensors.index.json"), "w"), indent=1)
print(f"{len(shapes)} tensors, {total / 1e9:.1f} GB in {n} shards -> {model_dir}")
