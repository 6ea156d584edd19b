"""Worker for test_trl_support's sharded case: run with ``python -m torch.distributed.run --nproc_per_node 2``.

Each process builds a real TRL GRPOTrainer (CPU, gloo), shards its policy with FSDP2 (``fully_shard`` on every
decoder layer, optionally on the LM head, then on the root: the layout accelerate's FSDP2 plugin makes) so that
outside a forward pass every process holds half of each weight, and scores the same tokens through TRL's own
``_get_per_token_logps_and_entropies`` with the support capture active. Each rank writes (``rank<r>.json``) the
largest difference to the log-mass of an unsharded copy's full logits, and how many tokens fell back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(model_dir: str, out: str, shard_head: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rollout_guard.integrations.trl.support import SupportCapture
    from rollout_guard.support import kept_log_mass
    from tests.integrations.test_trl_attach import make_trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = make_trainer(Path(model_dir), Path(out) / f"trainer{rank}", top_k=5, temperature=0.7)
    model = trainer.model
    for layer in model.model.layers:
        fully_shard(layer)
    if shard_head:
        fully_shard(model.lm_head)
    fully_shard(model)
    weight = model.lm_head.weight  # outside the forward: this process's shard only
    local_rows = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
    ids = torch.randint(3, 30, (4, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    capture = SupportCapture(trainer, (5, 1.0, 0.0))
    with torch.no_grad(), capture.active():
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 7)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        expected = kept_log_mass(reference(input_ids=ids).logits[:, -8:-1].float() / 0.7, top_k=5)
    captured = capture.calls[0] if capture.calls else torch.zeros_like(expected)
    result = {"rank": rank, "error": repr(capture.error) if capture.error is not None else None,
              "local_head_rows": local_rows, "vocabulary": int(reference.lm_head.weight.shape[0]),
              "max_difference": float((captured - expected).abs().max()),
              "fell_back": int((captured == 0).sum()), "cut": float(expected.max())}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "head")
