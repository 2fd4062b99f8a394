"""What a speculation step dispatches besides the decoder forwards, counted rather than timed.

On a GPU every operation is a kernel launch of several microseconds of host time, so the
bookkeeping between forwards (the acceptance, the emit, the commit feeding every layer's draft
window, a view re-choosing its static part) must be a fixed number of operations whatever the
model's depth; on a CPU, which is compute-bound, a timing would hide it. Counted with a dispatch
mode that sees every aten operation, minus those inside ``model.model`` (the decoder stack), as
the mean over a call's speculation steps; rows leaving the batch (once per row, on the step it
leaves) are counted apart.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import EOS, make_model, ragged_prompts

#: Operations outside the decoder forwards per speculation step (γ = 3), at any depth.
BUDGET = 150
VIEWS = {
    "streamingllm": dict(sink_tokens=4),
    "snapkv": dict(window=8),
    "attended": dict(page_size=8, recent_window=8),
    "dynamic": dict(page_size=8),
    "full": dict(),
}


class _OutsideOps(TorchDispatchMode):
    """Counts aten operations dispatched while no forward of ``decoder`` is running."""

    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self.depth, self.outside = 0, 0
        self._hooks = [decoder.register_forward_pre_hook(lambda *a: self._enter(1)),
                       decoder.register_forward_hook(lambda *a: self._enter(-1))]

    def _enter(self, step: int) -> None:
        self.depth += step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.depth:
            self.outside += 1
        return func(*args, **(kwargs or {}))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _outside_per_step(model, view: str, gamma: int = 3) -> float:
    from hf_magicdec.engine import loop

    ids, mask = ragged_prompts(batch=4, length=160, seed=5, min_len=120)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=EOS, speculative="magicdec",
                  draft=view, draft_budget=64, gamma=gamma, **VIEWS[view])
    model.generate(**kwargs, max_new_tokens=8)  # what a first call builds once
    counter, per_step, leaving = _OutsideOps(model.model), [], []
    step, drop = loop.Engine._step, loop.Engine._drop_finished

    def counted(self, *args, **kw):
        before = counter.outside
        read = step(self, *args, **kw)
        per_step.append(counter.outside - before)
        return read

    def dropping(self, *args, **kw):
        before = counter.outside
        drop(self, *args, **kw)
        leaving.append(counter.outside - before)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop.Engine, "_step", counted)
        patch.setattr(loop.Engine, "_drop_finished", dropping)
        try:
            with counter:
                model.generate(**kwargs, max_new_tokens=40)
        finally:
            counter.close()
    assert len(per_step) >= 8, per_step
    return (sum(per_step) - sum(leaving)) / len(per_step)


@pytest.mark.parametrize("view", list(VIEWS))
def test_bookkeeping_per_step_is_bounded_and_does_not_grow_with_depth(view):
    shallow = _outside_per_step(make_model("llama-gqa3", layers=2), view)
    deep = _outside_per_step(make_model("llama-gqa3", layers=24), view)
    assert shallow <= BUDGET and deep <= BUDGET, (shallow, deep)
    assert deep <= 1.15 * shallow, (shallow, deep)
