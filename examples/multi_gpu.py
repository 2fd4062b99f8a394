"""MagicDec on a model spread over several devices: a ``device_map`` in one process, or tensor
parallelism with one process per device (one node or several). See docs/multi_gpu.md.

device_map (one process; layers spread over the GPUs, the rest offloaded to CPU / disk)::

    python examples/multi_gpu.py                     # SmolLM2-135M (offline), device map planned for the workload
    python examples/multi_gpu.py --tiny              # a random tiny Llama: no files needed, runs anywhere
    python examples/multi_gpu.py --max-memory 0=20GiB,1=20GiB,cpu=64GiB --model Qwen/Qwen2.5-7B-Instruct
    python examples/multi_gpu.py --tiny --max-memory cpu=4MiB,disk=1GiB     # CPU only: some layers on disk

tensor parallelism (transformers' native TP; every rank runs the same call and gets the same output)::

    torchrun --nproc-per-node 4 examples/multi_gpu.py --tp --model Qwen/Qwen2.5-7B-Instruct
    torchrun --nproc-per-node 2 examples/multi_gpu.py --tp --tiny          # CPU, gloo backend
    # two nodes, 8 GPUs each (run on both; HOST is the first node):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/multi_gpu.py --tp --model meta-llama/Llama-3.1-70B-Instruct

The TP degree must divide the model's KV heads (SmolLM2-135M has 3: use 3 processes, or --tiny).
Greedy output is token-identical to stock ``generate``; the script checks it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import hf_magicdec  # noqa: F401  (the import enables generate(speculative=...))
from hf_magicdec import MagicDecConfig
from hf_magicdec.parallel import lockstep as distributed
from hf_magicdec.parallel.device_map import plan_device_map
from hf_magicdec_bench import models


def _tiny_checkpoint(directory: str) -> str:
    """A random tiny Llama saved to ``directory`` (6 query heads, 2 KV heads: TP 1 or 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: a random model then has something to accept
    model.save_pretrained(directory)
    return directory


def _checkpoint(name: str) -> str:
    """A local checkpoint directory: offline names are converted once into hf_magicdec's cache."""
    if name.lower() in models.KNOWN_MODELS:
        path = models.model_cache_dir(name.lower())
        if not (path / "config.json").exists():
            models.load(name, progress=False)
        return str(path)
    return name


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def _parse_memory(text: str | None) -> dict | None:
    if not text:
        return None
    memory = {}
    for item in text.split(","):
        key, value = item.split("=")
        memory[int(key) if key.strip().isdigit() else key.strip()] = value.strip()
    return memory


def _prompts(args, tokenizer, vocab: int) -> torch.Tensor:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab, (args.batch, args.context), generator=g)
    from hf_magicdec_bench import data

    return data.prompt_batch(tokenizer, args.batch, args.context)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of --model")
    ap.add_argument("--tp", action="store_true", help="tensor parallel (launch with torchrun)")
    ap.add_argument("--max-memory", help="device_map mode: e.g. 0=20GiB,1=20GiB,cpu=64GiB (default: what is free)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64, help="draft budget")
    ap.add_argument("--gamma", type=int, default=3)
    args = ap.parse_args(argv)

    spec = MagicDecConfig.from_any(draft="streamingllm", draft_budget=args.budget, gamma=args.gamma, sink_tokens=4)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_checkpoint(tmp) if args.tiny else _checkpoint(args.model)
        if args.tp:
            from transformers import AutoConfig, AutoModelForCausalLM
            from transformers.distributed import DistributedConfig

            if "RANK" not in os.environ:
                ap.error("--tp needs torchrun (e.g. torchrun --nproc-per-node 2 examples/multi_gpu.py --tp --tiny)")
            world, config = int(os.environ["WORLD_SIZE"]), AutoConfig.from_pretrained(path)
            if config.num_attention_heads % world or (config.num_key_value_heads or 1) % world:
                ap.error(f"transformers' TP splits whole heads: {world} ranks must divide the "
                         f"{config.num_attention_heads} query and {config.num_key_value_heads} KV heads of {path}")
            # Every rank loads its shard of the weights; heads and MLP columns are split over the ranks.
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         distributed_config=DistributedConfig(tp_plan="auto"))
            where = f"tensor parallel over {distributed.tp_size(model)} ranks ({torch.distributed.get_backend()})"
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            # Room for the weights *and* MagicDec's cache (full KV + draft views) for this workload.
            plan = plan_device_map(AutoConfig.from_pretrained(path), args.batch, args.context + args.new_tokens,
                                   config=spec, max_memory=_parse_memory(args.max_memory), dtype=dtype)
            print(plan.summary())
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=plan.device_map,
                                                         offload_folder=os.path.join(tmp, "offload"))
            where = f"device_map over {sorted(set(map(str, plan.device_map.values())))}"
        tokenizer = None if args.tiny else _tokenizer(path)
        model.eval()
        ids = _prompts(args, tokenizer, model.config.vocab_size).to(model.device)
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                      do_sample=False)
        reference = model.generate(**inputs)  # stock transformers
        out = model.generate(**inputs, speculative=spec, return_dict_in_generate=True)
        identical = torch.equal(reference, out.sequences)
        if distributed.rank() == 0:
            s = out.speculation
            print(f"{'tiny llama' if args.tiny else args.model}: {where}")
            print(f"batch {args.batch} x {args.context} prompt tokens, {args.new_tokens} new tokens, greedy, "
                  f"draft {s.draft} budget {s.draft_budget} gamma {s.gamma}")
            print(f"identical to stock generate: {'yes' if identical else 'NO'}")
            print(f"acceptance rate {s.acceptance_rate:.3f}, tokens per verification step {s.tokens_per_step:.2f}")
            if tokenizer is not None:
                print("row 0 continues:", repr(tokenizer.decode(out.sequences[0, ids.shape[1]:],
                                                                skip_special_tokens=True)))
        if args.tp:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
