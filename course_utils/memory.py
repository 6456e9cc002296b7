"""Memory per rank, by category, from a deterministic counter. Chapter 9.

PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) and its
FSDP2 variant ``FSDPMemTracker`` watch every tensor created while they are
active and sort its bytes into categories (parameters, gradients, optimizer
state, activations, temporaries, ...). They count tensor storages, not what
the allocator or the operating system holds, so the same step gives the same
number on every rank and on every run - unlike RSS, and unlike the
profiler's cumulative counter. They work on the CPU and on fake tensors.

- ``track_step(step, ...)``: run one training step under a tracker; return
  the peak, by category, in bytes.
- ``storage_bytes(tensors)``: bytes of the distinct storages behind tensors.
- ``Llama``: a Llama-2-7B-shaped decoder (fused q/k/v, SwiGLU, RMSNorm).
- ``fsdp2_peak_on_fake_ranks(world_sizes, ...)``: run the real FSDP2 code
  (``fully_shard`` per block and root, Adam, one step) on a fake process
  group with fake tensors, in a child process (or here, ``in_process=True``):
  the peak bytes one rank would hold, predicted without allocating them.
  Later chapters reuse it.
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
    from torch.distributed._tools.mem_tracker import MemTracker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trackers' notes on hooks and views
        if fsdp_model is not None:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

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
    """FSDP2 + Adam, one step on fake tensors, in a fake group of ``n`` ranks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

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
    ``fully_shard`` on every block and on the root, Adam, one forward,
    backward and optimizer step on ``batch`` sequences of ``seq`` tokens,
    measured by ``FSDPMemTracker``. Returns ``{n: {"parameters": count,
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
# Adam, 1 x 2048 tokens: {world size: {category: bytes at the step's peak}}.
LLAMA2_7B_FSDP2: dict[int, dict[str, int]] = {
    1: {
        "activations": 262144000, "gradients": 26953662464, "inputs": 16384,
        "optimizer state": 56004477836, "parameters": 26953662464,
        "total": 110173963148,
    },
    2: {
        "activations": 262144000, "gradients": 13476831232, "inputs": 16384,
        "optimizer state": 28788671372, "parameters": 13476831232,
        "total": 56004494220,
    },
    4: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 202383360, "inputs": 16384,
        "parameters": 6738415616, "reduce-scatter buffers": 809533440,
        "temporaries": 1008746496, "total": 33191243784,
    },
    8: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 101191680, "inputs": 16384,
        "parameters": 3369207808, "reduce-scatter buffers": 809533440,
        "temporaries": 1008746496, "total": 29720844296,
    },
    16: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 50595840, "inputs": 16384,
        "parameters": 1684603904, "reduce-scatter buffers": 809533440,
        "temporaries": 1008746496, "total": 27985644552,
    },
    32: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 25297920, "inputs": 16384,
        "parameters": 842301952, "reduce-scatter buffers": 809533440,
        "temporaries": 1008746496, "total": 27118044680,
    },
    64: {
        "activations": 21764489224, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "gradients": 12648960, "inputs": 16384,
        "parameters": 421150976, "reduce-scatter buffers": 809533440,
        "temporaries": 1008746496, "total": 26684244744,
    },
}
LLAMA2_7B_PARAMETERS = 6738415616

# The same with 2 layers instead of 32, on 8 ranks: a point small enough to
# recompute live (under a second) and compare, byte for byte.
LLAMA2_2_LAYERS_FSDP2: dict[int, dict[str, int]] = {
    8: {
        "activations": 1565032456, "all-gather buffers": 809533440,
        "gathered parameters": 1858125824, "inputs": 16384,
        "parameters": 333457408, "temporaries": 1008746496, "total": 5574912008,
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
