"""Multi-process generation on CPU: two ``torchrun`` processes over gloo.

* Tensor parallelism (transformers' native TP, ``DistributedConfig(tp_plan="auto")``): every rank
  returns exactly what a single process returns, greedy and seeded sampling, with adaptive γ and
  EOS rows finishing at different steps; the cache sizes itself from the local KV heads. One case
  seeds each rank differently: only the broadcast of decisions keeps the ranks together (without
  it the ranks desynchronise and the run aborts).
* ``synced_gpus`` (FSDP2 through ``DistributedConfig(fsdp_size=2)``, where HF turns it on by
  default): each rank has its own prompts, prompt length (so a different number of prefill
  chunks) and ``max_new_tokens``; each rank's output equals a single-process run on its inputs,
  and all ranks run the same number of forwards (fewer would deadlock the weight gathers).

The worker (``tests/parallel/distributed_worker.py``) and the references here run the same ``run_case``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distributed_worker as worker
from conftest import make_model

import hf_magicdec
from hf_magicdec.parallel import lockstep as distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT_S = 240


def _torchrun(mode: str, model_dir: Path, out_dir: Path) -> list[dict]:
    """Run the worker on 2 CPU processes; returns each rank's results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(WORKER.parent), str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), mode, str(model_dir), str(out_dir)]
    # Own session: on a timeout the whole group (torchrun and its workers) is ended.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} timed out after {LAUNCH_TIMEOUT_S}s (ranks out of step?)\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {mode} failed with exit code {proc.returncode}\n{output[-6000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random Llama (6 query heads, 2 KV heads: one KV head per rank at TP 2), saved for
    ``from_pretrained``, and the same weights as a plain single-process model."""
    model = make_model("llama-gqa3", layers=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tp_results(saved_model, tmp_path_factory):
    path, _ = saved_model
    return _torchrun("tp", path, tmp_path_factory.mktemp("tp-out"))


@pytest.fixture(scope="module")
def fsdp_results(saved_model, tmp_path_factory):
    path, _ = saved_model
    return _torchrun("fsdp", path, tmp_path_factory.mktemp("fsdp-out"))


def test_tensor_parallel_layout(tp_results, saved_model):
    _, model = saved_model
    for rank, result in enumerate(tp_results):
        meta = result["meta"]
        assert meta["rank"] == rank and meta["world"] == 2 and meta["tp_size"] == 2 and meta["tp_group_size"] == 2
        assert meta["synced"] is False  # TP alone does not turn on synced_gpus (as in HF)
        # Each rank caches its own KV heads only: the cache sized itself from the keys it saw.
        assert meta["cache_kv_heads"] == [model.config.num_key_value_heads // 2]


@pytest.mark.parametrize("case", list(worker.TP_CASES))
def test_tensor_parallel_matches_single_process(tp_results, saved_model, case):
    _, model = saved_model
    settings = worker.TP_CASES[case]
    # The reference is rank 0's view: seed 1234 (the seed_by_rank case seeds rank 1 differently).
    reference = worker.run_case(model, settings, rank=0, per_rank=False)
    rank0, rank1 = (result[case] for result in tp_results)
    for key in ("sequences", "gamma_trace", "accepted", "forwards"):
        assert rank0[key] == rank1[key], f"{case}: ranks disagree on {key}"
    assert rank0["sequences"] == reference["sequences"], f"{case}: TP output differs from a single process"
    assert rank0["gamma_trace"] == reference["gamma_trace"]
    assert rank0["accepted"] == reference["accepted"]
    if not settings["do_sample"]:
        assert rank0["sequences"] == rank0["stock"] == reference["stock"], "greedy must equal stock generate"
    if settings["eos"]:
        lengths = {sum(tok != worker.PAD for tok in row) for row in rank0["sequences"]}
        assert len(lengths) > 1, "test setup: rows should finish at different steps"


def test_fsdp_synced_gpus_layout(fsdp_results):
    for result in fsdp_results:
        assert result["meta"]["synced"] is True and result["meta"]["tp_size"] == 1


@pytest.mark.parametrize("case", list(worker.FSDP_CASES))
def test_fsdp_synced_gpus_matches_single_process(fsdp_results, saved_model, case):
    _, model = saved_model
    settings = worker.FSDP_CASES[case]
    per_rank = [result[case] for result in fsdp_results]
    # Different prompts per rank, yet the same number of forwards (prefill chunks and idle steps).
    assert per_rank[0]["forwards"] == per_rank[1]["forwards"]
    assert per_rank[0]["sequences"] != per_rank[1]["sequences"]
    references = [worker.run_case(model, settings, rank=rank, per_rank=True) for rank in range(2)]
    for rank, (got, reference) in enumerate(zip(per_rank, references)):
        assert got["sequences"] == reference["sequences"], f"{case}: rank {rank} differs from a single process"
        if not settings["do_sample"]:
            assert got["sequences"] == got["stock"]
    # The rank that finished first idled: it ran more forwards than it needs alone. (With adaptive
    # γ every rank follows rank 0's plan, so a single process on rank 1's inputs may pick other γs.)
    alone = [reference["forwards"] for reference in references]
    assert min(alone) < per_rank[0]["forwards"], "test setup: one rank should have idled"
    if settings["gamma"] != "auto":
        # Plus at most the returned cache's one tail forward (rows that ended early, computed as
        # stock holds their pad tokens), which every rank runs together when any rank needs it.
        assert max(alone) <= per_rank[0]["forwards"] <= max(alone) + 1


# ---------------------------------------------------------------- single process
def test_single_process_helpers_are_no_ops(tiny_models):
    model = tiny_models("llama-gqa3")
    assert not distributed.is_distributed() and distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.tp_size(model) == 1
    assert distributed.resolve_synced_gpus(model, True) is False  # nobody to wait for
    lockstep = distributed.Lockstep.for_model(model, True, torch.device("cpu"))
    assert lockstep is distributed.LOCAL and not lockstep.active
    a, b = torch.tensor([1, 2]), torch.tensor([3])
    assert lockstep.share(a) is a and lockstep.share(a, b) == (a, b)
    assert lockstep.agree({"x": 1}) == {"x": 1} and lockstep.pool(3, 4) == (3, 4)
    assert lockstep.any_alive(True) and not lockstep.any_alive(False)


def test_planner_uses_tp_degree(tiny_models):
    from hf_magicdec.planner import get_hardware

    model = tiny_models("llama-gqa3")
    h100 = get_hardware("h100")
    assert distributed.with_tp_degree(h100, model) is h100
    model._tp_size = 4
    try:
        assert distributed.with_tp_degree(h100, model).tp == 4
        assert distributed.with_tp_degree(get_hardware("h100", tp=2), model).tp == 2  # explicit TP wins
    finally:
        model._tp_size = None


def test_synced_gpus_single_process_equals_stock(tiny_models):
    """``synced_gpus=True`` used to raise; in one process it is a no-op, as in HF."""
    model = tiny_models("llama-gqa3")
    ids, mask = worker.prompts(0, per_rank=False)[:2]
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative=hf_magicdec.MagicDecConfig.from_any(draft="streamingllm", draft_budget=16,
                                                                         gamma=3, sink_tokens=4), synced_gpus=True)
    assert torch.equal(out, reference)
