"""Worker for tests/parallel/test_distributed.py, launched by ``torchrun`` (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/parallel/distributed_worker.py MODE MODEL_DIR OUT_DIR

MODE ``tp``: the model is loaded tensor-parallel (``DistributedConfig(tp_plan="auto")``); every rank
gets the same prompts. MODE ``fsdp``: the model is loaded fully sharded
(``DistributedConfig(fsdp_size=WORLD)``, which makes ``synced_gpus`` default to on); every rank
gets its own prompts and its own ``max_new_tokens``. Each rank writes ``OUT_DIR/rank{r}.json``:
per case, the sequences, the speculation trace and how many forwards the model ran.

The test process calls :func:`run_case` itself on a plain single-process copy of the model to get
the reference outputs, so both sides run exactly the same code.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import hf_magicdec  # noqa: E402,F401  (installs the speculative= routing)
from hf_magicdec import MagicDecConfig  # noqa: E402
from hf_magicdec.engine.cache import MagicDecLayer  # noqa: E402

VOCAB, PAD, EOS = 128, 0, 2

# name -> settings. "per_rank": prompts / lengths depend on the rank (fsdp only).
# "seed_by_rank": each rank seeds its RNG differently; TP must still agree (broadcast decisions).
TP_CASES = {
    "greedy": dict(draft="streamingllm", draft_budget=16, gamma=3, do_sample=False, eos=True),
    "greedy_snapkv": dict(draft="snapkv", draft_budget=16, gamma=2, do_sample=False, eos=False),
    "greedy_adaptive": dict(draft="streamingllm", draft_budget=16, gamma="auto", do_sample=False, eos=True),
    "sample": dict(draft="streamingllm", draft_budget=16, gamma=3, do_sample=True, eos=True),
    "sample_seed_by_rank": dict(draft="streamingllm", draft_budget=16, gamma=3, do_sample=True, eos=False,
                                seed_by_rank=True),
}
FSDP_CASES = {
    "greedy": dict(draft="streamingllm", draft_budget=16, gamma=3, do_sample=False, eos=True),
    "greedy_adaptive": dict(draft="streamingllm", draft_budget=16, gamma="auto", do_sample=False, eos=True),
    "sample": dict(draft="snapkv", draft_budget=16, gamma=2, do_sample=True, eos=True, seed_by_rank=True),
}


def prompts(rank: int, per_rank: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded ragged prompts ``(input_ids, attention_mask, max_new_tokens)``; with
    ``per_rank`` the batch, length and generation length differ between ranks."""
    batch, length, new = (3 + rank, 36 + 13 * rank, 10 + 14 * rank) if per_rank else (3, 40, 24)
    g = torch.Generator().manual_seed(100 + (rank if per_rank else 0))
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        real = int(torch.randint(length // 3, length + 1, (1,), generator=g))
        mask[b, : length - real] = 0
    ids[mask == 0] = PAD
    return ids, mask, new


def run_case(model, case: dict, rank: int, per_rank: bool) -> dict:
    """One MagicDec generate call; returns what the test compares."""
    ids, mask, new = prompts(rank, per_rank)
    options = {"streamingllm": dict(sink_tokens=4), "snapkv": dict(window=8)}[case["draft"]]
    spec = MagicDecConfig.from_any(draft=case["draft"], draft_budget=case["draft_budget"], gamma=case["gamma"],
                          prefill_chunk_size=16, **options)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=case["do_sample"],
                  eos_token_id=EOS if case["eos"] else None, pad_token_id=PAD)
    if case["do_sample"]:
        kwargs.update(top_k=20, temperature=0.9)
        torch.manual_seed(1234 + (rank if case.get("seed_by_rank") else 0))
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        out = model.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    finally:
        hook.remove()
    stock = model.generate(**{**kwargs, "do_sample": False}) if not case["do_sample"] else None
    return {
        "sequences": out.sequences.tolist(),
        "stock": None if stock is None else stock.tolist(),
        "gamma_trace": list(out.speculation.gamma_trace),
        "accepted": out.speculation.accepted_lengths,
        "forwards": forwards[0],
    }


def main(mode: str, model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # Initialise the group ourselves with a short timeout: a rank stuck in a collective then fails
    # the test in a minute instead of waiting for transformers' two-hour default.
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if mode == "tp":
        dist_config, cases, per_rank = DistributedConfig(tp_plan="auto"), TP_CASES, False
    elif mode == "fsdp":
        dist_config, cases, per_rank = DistributedConfig(fsdp_size=world, tp_size=1), FSDP_CASES, True
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=dist_config, dtype=torch.float32)
    model.eval()
    # Record the KV-head count each cache layer sized itself with (local heads under TP).
    cache_heads: set[int] = set()
    original_init = MagicDecLayer.lazy_initialization

    def recording_init(self, key_states, value_states):
        cache_heads.add(int(key_states.shape[1]))
        return original_init(self, key_states, value_states)

    MagicDecLayer.lazy_initialization = recording_init
    tp = hf_magicdec.parallel.lockstep.tp_size(model)
    group = hf_magicdec.parallel.lockstep.tp_group(model) if tp > 1 else None
    results = {"meta": {"rank": rank, "world": world, "tp_size": tp,
                        "tp_group_size": None if group is None else torch.distributed.get_world_size(group),
                        "synced": hf_magicdec.parallel.lockstep.resolve_synced_gpus(model, None)}}
    for name, case in cases.items():
        results[name] = run_case(model, case, rank, per_rank)
    results["meta"]["cache_kv_heads"] = sorted(cache_heads)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
