"""Memory per rank, by category, from a deterministic counter. Chapter 9.

PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) and its
FSDP2 variant ``FSDPMemTracker`` watch every tensor created while they are
active and sort its bytes into categories (parameters, gradients, optimizer
state, activations, temporaries, ...). They count tensor storages, not what
the allocator or the operating system holds, so the same step gives the same
number on every rank and on every run - unlike RSS, and unlike the
profiler's cumulative counter. They work on the CPU and on fake tensors.

- ``track_step(step, ...)``: run one training step under a tracker; return
  the peak, by category, in bytes; ``parts`` groups the categories into the
  five a chapter plots (``plot_parts``).
- ``storage_bytes(tensors)``: bytes of the distinct storages behind tensors.
- ``Llama``: a Llama-2-7B-shaped decoder (fused q/k/v, SwiGLU, RMSNorm).
- ``fsdp2_peak_on_fake_ranks(world_sizes, ...)``: the fake-tensor run that
  Chapter 9 shows and explains (``fully_shard`` per block and root, Adam,
  the second step measured) for many world sizes, in a child process (or
  here, ``in_process=True``), to recompute the tables below. Later chapters
  reuse it.
- ``LLAMA2_7B_FSDP2``: that prediction for the 32-layer model on 1 to 64
  ranks, computed by ``python -m course_utils.memory`` (about 10 s per world
  size), so that a chapter can show the whole curve; and
  ``LLAMA2_2_LAYERS_FSDP2``, a 2-layer point small enough to recompute live
  and compare byte for byte.
- ``LiveBytes``: a light dispatch mode that counts the bytes of storages made
  while it is active and still alive (current and peak); Chapter 8's
  checkers use it for many small steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# MemTracker's and FSDPMemTracker's category names -> the names the course uses
CATEGORY_NAMES = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "gathered parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "full gradients",
    "Optstate": "optimizer state",
    "OptState": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "Inputs": "inputs",
    "Other": "other",
    "Total": "total",
}


def by_category(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot (``{device: {category: bytes}}``) as ``{name: bytes}``.

    Categories are summed over devices and renamed with ``CATEGORY_NAMES``;
    empty ones are left out, ``"total"`` is always there.
    """
    out: dict[str, int] = {"total": 0}
    for per_device in snapshot.values():
        for key, nbytes in per_device.items():
            raw = getattr(key, "value", key)
            name = CATEGORY_NAMES.get(str(raw), str(raw).lower())
            if nbytes or name == "total":
                out[name] = out.get(name, 0) + int(nbytes)
    return out


# the five parts a chapter plots: FSDP2's categories grouped by what they hold
PARTS = {
    "parameters": ("parameters", "gathered parameters"),
    "gradients": ("gradients", "full gradients"),
    "optimizer state": ("optimizer state",),
    "activations": ("activations",),
}
OTHER_PART = "buffers and temporaries"


def parts(peak: dict[str, int]) -> dict[str, int]:
    """A peak by category grouped into ``PARTS`` plus ``OTHER_PART`` (the
    rest: all-gather and reduce-scatter buffers, temporaries, inputs, module
    buffers). The parts add up to ``peak["total"]``. Chapter 9."""
    out = {name: sum(peak.get(c, 0) for c in cats) for name, cats in PARTS.items()}
    out[OTHER_PART] = peak["total"] - sum(out.values())
    return out


def plot_parts(table: dict[int, dict[str, int]], ax, capacity_gb: float | None = None,
               capacity_label: str = "") -> None:
    """Stacked bars, one per world size, of ``parts(table[n])`` in GB (1e9
    bytes), the total printed on each bar; a dotted line at ``capacity_gb``.
    Chapter 9."""
    ns = sorted(table)
    labels = [str(n) for n in ns]
    bottom = [0.0] * len(ns)
    for i, name in enumerate([*PARTS, OTHER_PART]):
        values = [parts(table[n])[name] / 1e9 for n in ns]
        ax.bar(labels, values, bottom=bottom, label=name, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(labels, bottom, "ko", ms=3, label="total (computed point)")
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (x, total), xytext=(0, 4), ha="center",
                    textcoords="offset points", fontsize=7)
    if capacity_gb is not None:
        ax.axhline(capacity_gb, color="gray", linestyle=":", label=capacity_label)
    ax.set_ylim(0, max([*bottom, capacity_gb or 0]) * 1.15)
    ax.legend(fontsize=7, ncol=2)


def track_step(step: Callable[[], object], *external: nn.Module | torch.optim.Optimizer
               | torch.Tensor, fsdp_model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Run ``step()`` once under a tracker; return its peak bytes by category.

    ``external`` are the modules, optimizers and tensors made before the step
    (the tracker only sees what is created while it runs, unless told). For a
    model sharded with ``fully_shard``, pass it as ``fsdp_model`` (and its
    ``optimizer``): FSDP2's own categories (gathered parameters, all-gather
    buffers) are then reported. Chapter 9.
    """
    from course_utils.compat import MemTracker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trackers' notes on hooks and views
        if fsdp_model is not None:
            from course_utils.compat import FSDPMemTracker

            tracker = FSDPMemTracker(fsdp_model, optimizer)
            tensors = [t for t in external if isinstance(t, torch.Tensor)]
            if tensors:
                tracker.track_inputs(tuple(tensors))
        else:
            tracker = MemTracker()
            tracker.track_external(*external)
        with tracker:
            step()
    return by_category(tracker.get_tracker_snapshot("peak"))


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped).

    Views of one storage count once; a DTensor counts its local shard. Chapter 9.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), local.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


# --- a 7B model on fake ranks ---------------------------------------------------


class Block(nn.Module):
    """One Llama decoder block: RMSNorm, causal attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A decoder with Llama-2-7B's shapes by default (6.74 B parameters). Chapter 9."""

    def __init__(self, vocab: int = 32000, dim: int = 4096, hidden: int = 11008,
                 heads: int = 32, layers: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _fake_step_peak(n: int, layers: int, seq: int, batch: int) -> dict:
    """FSDP2 + Adam, two steps on fake tensors (the second measured), ``n`` ranks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_utils.compat import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))  # outside FakeTensorMode
        with FakeTensorMode():
            model = Llama(layers=layers)
            params = sum(p.numel() for p in model.parameters())
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters())
            tokens = torch.randint(0, 32000, (batch, seq))

            def step():
                logits = model(tokens)
                F.cross_entropy(logits.flatten(0, 1).float(),
                                tokens.flatten()).backward()
                opt.step()
                opt.zero_grad()

            step()  # the first step creates Adam's state: measure the second
            peak = track_step(step, tokens, fsdp_model=model, optimizer=opt)
    finally:
        dist.destroy_process_group()
    return {"parameters": params, "peak": peak}


def _fake_rank(rank: int, nprocs: int, world_sizes: Sequence[int], layers: int,
               seq: int, batch: int) -> dict[int, dict]:
    """The child process: one fake step per world size."""
    warnings.simplefilter("ignore")
    return {n: _fake_step_peak(n, layers, seq, batch) for n in world_sizes}


def fsdp2_peak_on_fake_ranks(world_sizes: Sequence[int], layers: int = 32,
                             seq: int = 2048, batch: int = 1, timeout: float = 300.0,
                             in_process: bool = False) -> dict[int, dict]:
    """Predicted peak bytes per rank of one FSDP2 training step. Chapter 9.

    For each world size ``n``, a fake process group of ``n`` ranks (its
    collectives do nothing) and ``FakeTensorMode`` (tensors with shapes and
    no data) let the real code run: ``Llama(layers=layers)`` in fp32,
    ``fully_shard`` on every block and on the root, Adam, two training steps
    on ``batch`` sequences of ``seq`` tokens, the second (Adam's state
    exists) measured by ``FSDPMemTracker``. Returns ``{n: {"parameters": count,
    "peak": {category: bytes}}}``. What it leaves out: the caching
    allocator's slack and fragmentation, CUDA/NCCL workspaces, and
    communication buffers that a real GPU run keeps while overlapping.

    A process group is process-wide state, so by default this runs in a child
    process (``timeout`` seconds at most); ``in_process=True`` runs here,
    which is faster (no new interpreter) and needs no process group to be
    initialised here already.
    """
    if in_process:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("a process group is initialised in this process: "
                               "use in_process=False")
        with warnings.catch_warnings():
            return _fake_rank(0, 1, list(world_sizes), layers, seq, batch)
    from course_utils.dist import launch

    ranks = launch(_fake_rank, 1, args=(list(world_sizes), layers, seq, batch),
                   timeout=timeout, init=False, echo=False, backend="gloo")
    return ranks[0].value


# Computed by `python -m course_utils.memory` with torch 2.13.0 (CPU wheel):
# fsdp2_peak_on_fake_ranks([1, 2, 4, 8, 16, 32, 64]), Llama-2-7B shapes, fp32,
# Adam, 1 x 2048 tokens, the second training step (Adam's state exists):
# {world size: {category: bytes at that step's peak}}.
LLAMA2_7B_FSDP2: dict[int, dict[str, int]] = {
    1: {
        "activations": 868499464, "gathered parameters": 1858125824,
        "gradients": 25095536640, "inputs": 16384, "optimizer state": 53907325836,
        "parameters": 26953662464, "temporaries": 1818279936, "total": 110501446548,
    },
    2: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 404766720, "inputs": 16384,
        "optimizer state": 26953663372, "parameters": 13476831232,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 67085706132,
    },
    4: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 202383360, "inputs": 16384,
        "optimizer state": 13476832140, "parameters": 6738415616,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 46668075924,
    },
    8: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 101191680, "inputs": 16384,
        "optimizer state": 6738416524, "parameters": 3369207808,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 36459260820,
    },
    16: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 50595840, "inputs": 16384,
        "optimizer state": 3369208716, "parameters": 1684603904,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 31354853268,
    },
    32: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 25297920, "inputs": 16384,
        "optimizer state": 1684604812, "parameters": 842301952,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 28802649492,
    },
    64: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 12648960, "inputs": 16384,
        "optimizer state": 842302860, "parameters": 421150976,
        "reduce-scatter buffers": 809533440, "temporaries": 1008746496,
        "total": 27526547604,
    },
}
LLAMA2_7B_PARAMETERS = 6738415616

# The same with 2 layers instead of 32, on 8 ranks: a point small enough to
# recompute live (under a second) and compare, byte for byte.
LLAMA2_2_LAYERS_FSDP2: dict[int, dict[str, int]] = {
    8: {
        "activations": 1565032456, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "inputs": 16384,
        "optimizer state": 666914884, "parameters": 333457408,
        "temporaries": 1008746496, "total": 6241826892,
    },
}


# --- live bytes: a light counter for one process (Chapter 8) ------------------


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensor storages created while active that are still alive.

    ``current`` and ``peak`` (both above the start) count each storage an
    operation returns once, from its creation until Python frees it (a weak
    reference tells), so the count is exact and the same on every run. What
    existed before (views of it included), and memory made outside PyTorch's
    operators (a file read by ``torch.load``), is not counted. Lighter than
    ``MemTracker`` (no categories, no module hooks), for checks that run many
    small steps.
    Dispatch modes are per thread: enter it in the thread that runs the work.

    >>> with LiveBytes() as live:
    ...     y = torch.ones(256) * 2
    >>> live.current, live.peak
    (1024, 2048)
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._alive: dict = {}

    def _freed(self, key, _ref) -> None:
        self.current -= self._alive.pop(key, (0, None))[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: not new memory
        inputs = {t.untyped_storage().data_ptr() for t in
                  torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self._alive and key not in inputs and storage.nbytes():
                    ref = weakref.ref(storage, lambda r, k=key: self._freed(k, r))
                    self._alive[key] = (storage.nbytes(), ref)
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def main() -> None:
    """Recompute ``LLAMA2_7B_FSDP2`` and print it as Python."""
    import pprint

    pprint.pprint(fsdp2_peak_on_fake_ranks([1, 2, 4, 8, 16, 32, 64], timeout=900),
                  width=88)
    pprint.pprint(fsdp2_peak_on_fake_ranks([8], layers=2), width=88)


if __name__ == "__main__":
    main()
