"""Real DeepSpeed ZeRO-3 (CPU, gloo) and the support hook's read of the LM head: is the head's weight empty when
the hook runs, and does reading it change what ZeRO-3 keeps? One or two processes:

    WAY=now DS_ACCELERATOR=cpu python probe.py                 # one process; WAY=before: the read before be1552e
    WAY=now DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 probe.py

Needs deepspeed (not a project dependency; 0.19.8 was used). Prints, per way of reading the vocabulary, the
head's shape outside any forward and inside the backbone's forward hook (its ZeRO status before the read:
ZeRO-3's parameter getter gathers a parameter read during any forward), the largest difference of the captured
(log Z, log p) from an unsharded copy, and the parameters ZeRO-3 registered as external to a module (fetched
with it from then on). Runs in this repository's .venv with deepspeed put on PYTHONPATH."""

import copy
import os
from collections import OrderedDict

import torch

for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from rollout_guard.integrations.trl import support  # noqa: E402

SETTINGS = (5, 1.0, 0.0)  # top_k = 5


def capture(model, ids, vocabulary):
    support.head_vocabulary = vocabulary
    seen, out = {}, []

    def hook(module, args, output):
        if hasattr(model.lm_head._parameters, "_in_forward"):  # ZeRO-3's dict: its getter gathers in a forward
            raw = OrderedDict.__getitem__(model.lm_head._parameters, "weight")
            seen["raw"] = f"{raw.ds_status.name} {tuple(raw.data.shape)}"
        seen["in_hook"] = tuple(model.lm_head.weight.shape) if vocabulary is OLD else "not read"
        out.append(support.token_log_mass(output.last_hidden_state[:, :-1], ids[:, 1:], model.lm_head, 1.0, None,
                                          0.7, SETTINGS))

    handle = model.model.register_forward_hook(hook)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return out[0], f"{seen['in_hook']} (before reading: {seen.get('raw', 'unsharded')})"


NEW = support.head_vocabulary


def OLD(head):  # before be1552e
    return int(head.weight.shape[0])


deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=5000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
reference = copy.deepcopy(model)
ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(1))
expected, _ = capture(reference, ids, NEW)
zero3 = {"train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, config=zero3, optimizer=torch.optim.AdamW(model.parameters()))
rank = int(os.environ["RANK"])
ways = {"before": ("weight.shape[0] (before)", OLD), "now": ("out_features (now)", NEW)}
for name, vocabulary in [ways[os.environ.get("WAY", "now")]] * 2:  # each way in a process of its own; two passes
    outside = tuple(model.lm_head.weight.shape)
    got, in_hook = capture(model, ids, vocabulary)
    difference = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
    external = {module_name or "root": [tuple(p.ds_shape) for _, p in module.ds_external_parameters()]
                for module_name, module in model.named_modules()
                if hasattr(module, "ds_external_parameters") and list(module.ds_external_parameters())}
    after = tuple(model.lm_head.weight.shape)
    print(f"rank {rank} {name}: head outside a forward {outside}, read in the hook {in_hook}, after {after}; "
          f"max |difference| from unsharded {difference:.2e}; external parameters {external}", flush=True)
