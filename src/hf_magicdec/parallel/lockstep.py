"""Keeping the ranks of a multi-process ``generate`` call in step.

Two multi-process settings need the engine's help (see ``docs/multi_gpu.md``):

*Tensor parallelism* (transformers' ``tp_plan="auto"`` / ``DistributedConfig``, under
``torchrun``). Every rank of a TP group holds the same batch, runs the same forwards and sees the
same full logits (the LM head gathers its output), but each forward is a chain of collectives:
if one rank drafted a different token, accepted a different prefix or stopped a row earlier, the
ranks would feed different tokens into one all-reduce (silently wrong output) or run a different
number of forwards (a hang). So every decision the engine takes (each draft token, the number of
accepted tokens and the recovered / bonus token of each row, the first token after prefill, and
the plan) is **broadcast from the first rank of the TP group**. A broadcast of ``[b]`` token ids
costs far less than the ``2 x layers`` all-reduces of the forward it follows, and it makes the
ranks agree even when they were seeded differently or when reductions are not bitwise
reproducible. Rows finishing and adaptive γ then follow: they are functions of those decisions.

*synced_gpus* (ZeRO-3 / FSDP: each rank has its own batch, but every forward gathers the
sharded weights from all ranks). As in ``GenerationMixin._sample``, a rank whose rows are all
finished keeps running forwards until every rank is done. Here an iteration is γ draft forwards
plus one verify forward, so the ranks also agree on γ (adaptive γ pools the acceptance counts
of all ranks, and the plan is rank 0's), on the draft scratch size, and on the number of
prefill forwards (a rank with a shorter prompt runs idle forwards to match).

Without ``torch.distributed`` (or with a single process) every helper here is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

log = logging.getLogger("hf_magicdec")

__all__ = [
    "Lockstep",
    "LOCAL",
    "is_distributed",
    "rank",
    "world_size",
    "tp_size",
    "tp_group",
    "resolve_synced_gpus",
    "with_tp_degree",
]


# ---------------------------------------------------------------------------- process helpers
def is_distributed() -> bool:
    """``torch.distributed`` is available and initialised with more than one process."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and world_size() > 1


def rank() -> int:
    """Global rank (0 without ``torch.distributed``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def world_size() -> int:
    """Number of processes (1 without ``torch.distributed``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def tp_size(model) -> int:
    """Tensor-parallel degree of a model sharded by transformers (``tp_plan`` /
    ``distributed_config``); 1 for every other model (including ``device_map`` and FSDP-only)."""
    size = getattr(model, "_tp_size", None)
    return int(size) if size else 1


def tp_group(model):
    """The process group of ``model``'s tensor-parallel ranks (they share one batch).

    transformers keeps its device meshes on the model: ``_mesh_manager.get_mesh("tp")`` (5.x
    ``DistributedConfig``) or a ``"tp"`` dimension of ``_device_mesh``. Falls back to the whole
    world when the TP degree equals the world size.

    Raises
    ------
    RuntimeError
        If the model is tensor-parallel over fewer ranks than the world and its TP mesh cannot be
        found (broadcasting over the world would mix different batches).
    """
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        try:
            return manager.get_mesh("tp").get_group()
        except Exception as exc:  # layout of the mesh manager changed: try the next source
            log.debug("no tp mesh from _mesh_manager: %s", exc)
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "tp" in names:
            return mesh["tp"].get_group()
        if mesh.ndim == 1:
            return mesh.get_group()
    if tp_size(model) == world_size():
        return torch.distributed.group.WORLD
    raise RuntimeError(
        f"The model is tensor-parallel over {tp_size(model)} of {world_size()} ranks but its TP device mesh "
        "was not found (model._mesh_manager / model._device_mesh): cannot tell which ranks share a batch."
    )


def resolve_synced_gpus(model, requested: bool | None) -> bool:
    """``synced_gpus`` as ``GenerationMixin.generate`` resolves it: the explicit value, else on
    under DeepSpeed ZeRO-3 or FSDP with more than one process. Always False without
    ``torch.distributed`` (a single process has nobody to wait for)."""
    if not is_distributed():
        return False
    if requested is not None:
        return bool(requested)
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        zero3 = bool(is_deepspeed_zero3_enabled())
    except ImportError:  # pragma: no cover - moved in another transformers release
        zero3 = False
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:  # pragma: no cover
        try:
            from transformers.integrations.fsdp import is_fsdp_managed_module
        except ImportError:
            return zero3
    return zero3 or bool(is_fsdp_managed_module(model))


def with_tp_degree(hardware, model):
    """``hardware`` (a :class:`~hf_magicdec.planner.HardwareSpec`) as a TP group of the model's
    degree, unless it already names one: the planner then splits weights, heads and vocabulary
    and charges the all-reduces (see ``docs/cost_model.md``)."""
    tp = tp_size(model)
    if tp > 1 and getattr(hardware, "tp", 1) == 1:
        return hardware.with_tp(tp)
    return hardware


def _comm_device(group, device: torch.device) -> torch.device:
    """Where a collective's tensors must live for ``group``'s backend."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


# ---------------------------------------------------------------------------- the lockstep
class Lockstep:
    """What one ``generate`` call does to keep its ranks in step (a no-op for a single process).

    Parameters
    ----------
    group : ProcessGroup or None
        Tensor-parallel group whose ranks share one batch: decisions are broadcast from its first
        rank. None: the ranks (if any) decide independently.
    synced : bool
        ``synced_gpus``: ranks with different batches run the same number of forwards.
    idle_forward : callable or None
        Runs one throw-away forward (needed when ``synced``).
    """

    def __init__(self, group=None, synced: bool = False, idle_forward: Callable[[], Any] | None = None):
        self.group = group
        self.synced = bool(synced)
        self._idle_forward = idle_forward
        self._forwards = 0  # forwards counted since plan_forwards (synced_gpus)
        self._target = 0  # prefill forwards every rank runs (synced_gpus)
        self._hook = None

    @classmethod
    def for_model(cls, model, synced_gpus: bool, device: torch.device, pad_token_id=None) -> "Lockstep":
        """The lockstep of one call on ``model`` (inputs on ``device``; ``pad_token_id``: int,
        0-d tensor or None, the token idle forwards feed)."""
        if not is_distributed():
            return LOCAL
        group = tp_group(model) if tp_size(model) > 1 else None
        if group is None and not synced_gpus:
            return LOCAL
        return cls(group, synced_gpus, _make_idle_forward(model, device, pad_token_id) if synced_gpus else None)

    @property
    def active(self) -> bool:
        return self.group is not None or self.synced

    # ------------------------------------------------------------------ TP: one decision for all
    def share(self, *tensors: torch.Tensor):
        """The first TP rank's values of these integer tensors (token ids, accepted counts).

        Returns the tensor itself for one argument, a tuple for several. Same shapes, dtypes and
        devices as given; a no-op outside tensor parallelism.
        """
        if self.group is None:
            return tensors[0] if len(tensors) == 1 else tensors
        device = tensors[0].device
        flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.long) for t in tensors])
        buf = flat.to(_comm_device(self.group, device))
        torch.distributed.broadcast(buf, group=self.group, group_src=0)
        buf = buf.to(device)
        out, start = [], 0
        for t in tensors:
            out.append(buf[start : start + t.numel()].view(t.shape).to(t.dtype))
            start += t.numel()
        return out[0] if len(out) == 1 else tuple(out)

    def agree(self, obj: Any) -> Any:
        """One rank's (picklable) object on every rank: global rank 0's under ``synced_gpus``,
        else the first TP rank's. Used for the plan, so every rank runs the same configuration."""
        if not self.active:
            return obj
        box = [obj]
        # torch picks the object-collective device for the backend (the current GPU for NCCL).
        torch.distributed.broadcast_object_list(box, group=None if self.synced else self.group, group_src=0)
        return box[0]

    # ------------------------------------------------------------------ synced_gpus
    def _reduce(self, values: list[int], op) -> list[int]:
        group = torch.distributed.group.WORLD
        t = torch.tensor(values, dtype=torch.long, device=_comm_device(group, torch.device("cpu")))
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks under ``synced_gpus`` (draft scratch size)."""
        if not self.synced:
            return value
        return self._reduce([value], torch.distributed.ReduceOp.MIN)[0]

    def pool(self, *counts: int) -> tuple[int, ...]:
        """Counts summed over all ranks under ``synced_gpus`` (adaptive γ: accepted and drafted
        tokens, rows alive and their tokens), so that every rank's controller sees the same numbers
        and picks the same γ."""
        if not self.synced:
            return counts
        return tuple(self._reduce(list(counts), torch.distributed.ReduceOp.SUM))

    def watch(self, model) -> None:
        """Count ``model``'s forwards (``synced_gpus``) so prefill forward counts can be matched."""
        if self.synced and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count)

    def _count(self, *_args) -> None:
        self._forwards += 1

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextlib.contextmanager
    def watching(self, model):
        """:meth:`watch` for the duration of a block."""
        self.watch(model)
        try:
            yield self
        finally:
            self.close()

    def plan_forwards(self, count: int) -> None:
        """Before prefill under ``synced_gpus``: agree on the number of prefill forwards (the
        largest ``count`` over the ranks; prompt lengths, hence prefill chunks, differ). It must
        be agreed before any rank starts: a rank waiting in a collective while another still
        needs it for a forward's weight gather would deadlock."""
        if self.synced:
            self._target = self._reduce([count], torch.distributed.ReduceOp.MAX)[0]
            self._forwards = 0

    def match_forwards(self) -> None:
        """After prefill under ``synced_gpus``: idle forwards up to the agreed prefill count."""
        if not self.synced:
            return
        self.idle_forwards(self._target - self._forwards)
        self._forwards = self._target = 0

    def any_alive(self, alive: bool) -> bool:
        """Whether another iteration runs: this rank has rows left (``alive``) or, under
        ``synced_gpus``, any rank has (one all-reduce per iteration, like HF's
        ``_has_unfinished_sequences``); a rank with nothing left then runs idle iterations
        (:meth:`idle_forwards`) until every rank is done."""
        if not self.synced:
            return alive
        return self._vote(alive)

    def idle_forwards(self, count: int) -> None:
        """``count`` throw-away forwards: an idle rank's share of an iteration under ``synced_gpus``."""
        for _ in range(count):
            self._idle_forward()

    def _vote(self, alive: bool) -> bool:
        return self._reduce([int(bool(alive))], torch.distributed.ReduceOp.SUM)[0] > 0


#: The lockstep of a single process: every method is the identity.
LOCAL = Lockstep()


def _make_idle_forward(model, device: torch.device, pad_token_id: int) -> Callable[[], None]:
    """A forward of one pad token without a cache: it touches every layer (and so takes part in
    every FSDP / ZeRO-3 gather and every TP all-reduce) and changes no state."""
    ids = torch.full((1, 1), 0 if pad_token_id is None else int(pad_token_id), dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    kwargs = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}

    def forward() -> None:
        model(input_ids=ids, position_ids=positions, use_cache=False, return_dict=True, **kwargs)

    return forward
