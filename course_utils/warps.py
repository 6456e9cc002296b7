"""Which 32-byte sectors each warp touches, and which warps diverge.

Introduced in Chapter 1 ("The CUDA execution model"). The tracer does not run a
kernel: it evaluates, for every thread of a launch, the same index arithmetic
the kernel uses, written as a plain Python function of ``(block, thread)``.
That works with or without a GPU, and the result is exact for the addresses,
not a timing. It models one thing the hardware does: the threads of a warp
issue a memory instruction together, and the memory system serves it in
32-byte sectors, so a request costs one sector per distinct sector touched.
Caches, reuse between requests and timing are not modelled.

An access function returns the global-memory accesses of one thread in program
order: a list whose items are element indices (``int``) or ``(array, index)``
pairs when a kernel touches several arrays. An empty list means the thread does
nothing (it failed the bounds guard). The i-th items of the threads of a warp
form the warp's i-th request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from itertools import product

WARP_SIZE = 32
SECTOR_BYTES = 32

Dim = tuple[int, int, int]


def _dim3(d: int | Sequence[int]) -> Dim:
    """``256`` or ``(16, 16)`` -> ``(x, y, z)`` with missing sizes 1, as CUDA does."""
    d = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(d) <= 3 or any(int(s) < 1 for s in d):
        raise ValueError(f"a grid or block size is 1 to 3 positive ints, not {d}")
    return tuple(int(s) for s in d) + (1,) * (3 - len(d))  # type: ignore[return-value]


def warps(grid: int | Sequence[int], block: int | Sequence[int],
          warp_size: int = WARP_SIZE) -> Iterator[list[tuple[Dim, Dim]]]:
    """Yield each warp of a launch as a list of ``(block_idx, thread_idx)``. Chapter 1.

    Threads are numbered within a block x fastest, then y, then z, and cut
    into warps of 32 consecutive numbers; a block's last warp may be partial.
    Indices are ``(x, y, z)`` tuples, like CUDA's blockIdx and threadIdx.
    """
    gx, gy, gz = _dim3(grid)
    bx, by, bz = _dim3(block)
    for b in product(range(gz), range(gy), range(gx)):
        block_idx = (b[2], b[1], b[0])
        threads = [(block_idx, (t[2], t[1], t[0]))
                   for t in product(range(bz), range(by), range(bx))]
        for start in range(0, len(threads), warp_size):
            yield threads[start:start + warp_size]


@dataclass
class Trace:
    """Sectors per warp request for one launch (see ``trace_sectors``). Chapter 1."""

    sectors: list[int]        # distinct sectors of each warp request
    requested_bytes: int      # bytes the threads asked for (distinct addresses)
    itemsize: int

    @property
    def requests(self) -> int:
        """How many warp-wide memory requests the launch issued."""
        return len(self.sectors)

    @property
    def total_sectors(self) -> int:
        """Sectors moved in all: what the memory system actually transfers."""
        return sum(self.sectors)

    @property
    def sectors_per_request(self) -> float:
        """Mean sectors per request: 4 is ideal for 32 threads x 4 bytes."""
        return self.total_sectors / max(self.requests, 1)

    @property
    def efficiency(self) -> float:
        """Bytes asked for / bytes moved (1.0 = every byte moved was used)."""
        return self.requested_bytes / max(self.total_sectors * SECTOR_BYTES, 1)

    def __str__(self) -> str:
        return (f"{self.requests} warp requests, {self.total_sectors} sectors, "
                f"{self.sectors_per_request:.1f} sectors/request, "
                f"{self.efficiency:.0%} of moved bytes used")


def _key(access, itemsize: int) -> tuple[Hashable, int, int]:
    """``(array, sector, byte address)`` of one access."""
    array, index = access if isinstance(access, tuple) else (None, access)
    address = int(index) * itemsize
    return array, address // SECTOR_BYTES, address


def trace_sectors(accesses: Callable[[Dim, Dim], Sequence],
                  grid: int | Sequence[int], block: int | Sequence[int],
                  itemsize: int = 4, warp_size: int = WARP_SIZE) -> Trace:
    """Count the 32-byte sectors each warp-wide memory request touches. Chapter 1.

    ``accesses(block_idx, thread_idx)`` returns one thread's accesses in
    program order (element indices, or ``(array, index)`` pairs); ``itemsize``
    is the bytes per element (4 for float32). Request i of a warp gathers the
    i-th access of each of its threads that has one.
    """
    sectors: list[int] = []
    requested = 0
    for warp in warps(grid, block, warp_size):
        per_thread = [list(accesses(b, t)) for b, t in warp]
        for i in range(max((len(a) for a in per_thread), default=0)):
            keys = [_key(a[i], itemsize) for a in per_thread if i < len(a)]
            sectors.append(len({(array, s) for array, s, _ in keys}))
            requested += len({(array, addr) for array, _, addr in keys}) * itemsize
    return Trace(sectors=sectors, requested_bytes=requested, itemsize=itemsize)


def count_divergent_warps(branch: Callable[[Dim, Dim], Hashable],
                          grid: int | Sequence[int], block: int | Sequence[int],
                          warp_size: int = WARP_SIZE) -> tuple[int, int]:
    """``(divergent warps, all warps)`` for a branch condition. Chapter 1.

    ``branch(block_idx, thread_idx)`` returns which way a thread goes (any
    hashable value). A warp diverges when its threads do not all go the same
    way: it then runs each way in turn, with the other threads idle.
    """
    divergent = total = 0
    for warp in warps(grid, block, warp_size):
        total += 1
        divergent += len({branch(b, t) for b, t in warp}) > 1
    return divergent, total
