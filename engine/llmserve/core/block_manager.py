"""Paged KV-cache bookkeeping: a block allocator and per-sequence block tables (no tensors).

The KV cache is cut into fixed-size *physical blocks* of ``block_size`` token slots
(PagedAttention, Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"). A sequence owns a *block table* (``seq.block_ids``): logical block
``i`` (token positions ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``seq.block_ids[i]``. Blocks are handed out one at a time as a sequence grows, so a request
reserves at most ``block_size - 1`` slots it does not use, instead of a contiguous region of its
maximum length.

* :class:`BlockAllocator` -- O(1) free list + reference counts (no notion of sequences).
* :class:`BlockManager` -- grows and frees ``seq.block_ids``; memory accounting.

The tensors themselves live in :class:`llmserve.worker.kv_cache.KVCache`.
"""

from __future__ import annotations
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable
if TYPE_CHECKING:  # pragma: no cover
    from .sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is requested but every physical block is in use.

    The scheduler checks :meth:`BlockManager.can_append` first (and preempts if needed), so
    seeing this from the engine means a bookkeeping bug, not a user error.
    """


# ---------------------------------------------------------------------------------------------
# Allocator
# ---------------------------------------------------------------------------------------------
class BlockAllocator:
    """Physical block ids ``0 .. num_blocks-1`` with an O(1) free list and reference counts.

    Order (tests rely on it, so it is part of the contract):

    * a fresh allocator hands out ``0, 1, 2, ...`` in increasing order;
    * freed blocks are reused LIFO: the most recently freed block is the next one allocated.

    The free list is a Python list used as a stack (``pop()``/``append()`` are O(1)).
    Reference counts let several block tables share one block (prefix sharing, not used yet):
    :meth:`allocate` returns a block with count 1, :meth:`incref` adds an owner, and
    :meth:`decref` (alias :meth:`free`) drops one; the block returns to the free list when its
    count reaches 0.

    Args:
        num_blocks: number of physical blocks, >= 1.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    __slots__ = ("num_blocks", "_free", "_ref_counts")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Stack of free ids; the top (end of the list) is allocated next, so 0 sits on top.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Owners of ``block_id`` (0 = free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self.ref_count(block_id) == 0

    # ---- mutation ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take a free block (reference count 1). O(1).

        Raises:
            NoFreeBlocksError: every block is in use.
        """
        if not self._free:
            raise NoFreeBlocksError(
                f"all {self.num_blocks} KV cache blocks are in use; free or preempt a sequence first")
        block_id = self._free.pop()
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add an owner to an allocated block. O(1).

        Raises:
            ValueError: ``block_id`` out of range or currently free.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot incref block {block_id}: it is free (allocate it first)")
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one owner; the block goes back on top of the free list when none remain. O(1).

        Returns:
            True if the block became free.

        Raises:
            ValueError: ``block_id`` out of range or already free (double free).
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (double free)")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)
            return True
        return False

    free = decref

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be an integer in [0, {self.num_blocks}), got {block_id!r}")

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"


# ---------------------------------------------------------------------------------------------
# Memory accounting
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryStats:
    """A snapshot of KV cache memory use (see :meth:`BlockManager.memory_stats`).

    Units: ``*_blocks`` in blocks, ``*_slots`` in token slots, ``*_bytes`` in bytes.

    Attributes:
        block_size: token slots per block.
        bytes_per_token_slot: bytes of K and V for one token over all layers.
        num_total_blocks / num_used_blocks / num_free_blocks / peak_used_blocks: allocator state
            and its high-water mark since the last :meth:`BlockManager.reset_peak`.
        reserved_bytes: the whole cache (``num_total_blocks * block_size * bytes_per_token_slot``).
        used_bytes: blocks currently allocated, in bytes; ``peak_used_bytes`` its high-water mark.
        num_seqs: sequences counted below.
        filled_slots: slots holding K/V of those sequences (their ``num_computed_tokens``).
        paged_slots: slots of the blocks those sequences own (``len(block_ids) * block_size``).
        fragmentation_slots: ``paged_slots - filled_slots``: unused slots in partly filled
            blocks (internal fragmentation; at most ``block_size - 1`` per sequence once its
            step's tokens are written).
        contiguous_slots: what a contiguous allocation of each request's maximum length would
            reserve: ``sum(min(prompt + max_tokens, max_model_len))`` over the sequences.
        paged_bytes / fragmentation_bytes / contiguous_bytes: the three above in bytes.
        reduction: ``1 - paged_slots / contiguous_slots`` (fraction of memory the paged layout
            saves; 0.0 when there are no sequences).
    """

    block_size: int
    bytes_per_token_slot: int
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    peak_used_blocks: int
    reserved_bytes: int
    used_bytes: int
    peak_used_bytes: int
    num_seqs: int
    filled_slots: int
    paged_slots: int
    fragmentation_slots: int
    contiguous_slots: int
    paged_bytes: int
    fragmentation_bytes: int
    contiguous_bytes: int
    reduction: float

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Block manager
# ---------------------------------------------------------------------------------------------
class BlockManager:
    """Grows and frees sequences' block tables (``seq.block_ids``) on a :class:`BlockAllocator`.

    Blocks are allocated lazily: :meth:`append_slots` only adds the blocks a step needs, so a
    sequence owns ``ceil(tokens / block_size)`` blocks. No tensors are touched.

    Args:
        num_blocks: physical blocks (excluding the KV cache's scratch block), >= 1.
        block_size: token slots per block, >= 1.

    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.peak_used_blocks = 0

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.allocator.num_used / self.allocator.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks holding ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: "Sequence", num_new_tokens: int) -> int:
        """Blocks :meth:`append_slots` would allocate to cover ``num_computed_tokens + num_new_tokens``."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_ids))

    def can_append(self, seq: "Sequence", num_new_tokens: int) -> bool:
        """Whether enough blocks are free for ``seq`` to compute ``num_new_tokens`` more tokens."""
        return self.num_new_blocks(seq, num_new_tokens) <= self.allocator.num_free

    # ---- mutation ---------------------------------------------------------------------------
    def append_slots(self, seq: "Sequence", num_new_tokens: int) -> None:
        """Grow ``seq.block_ids`` to cover ``seq.num_computed_tokens + num_new_tokens`` tokens.

        All-or-nothing: when too few blocks are free nothing is allocated.

        Raises:
            NoFreeBlocksError: fewer free blocks than needed (check :meth:`can_append` first).
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > self.allocator.num_free:
            raise NoFreeBlocksError(
                f"sequence {seq.request_id!r} needs {n} more blocks for {num_new_tokens} tokens, "
                f"only {self.allocator.num_free} of {self.num_total_blocks} are free")
        for _ in range(n):
            seq.block_ids.append(self.allocator.allocate())
        used = self.allocator.num_used
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def free(self, seq: "Sequence") -> None:
        """Release every block of ``seq`` and clear its table.

        Blocks are released last-to-first, so with the LIFO free list the next allocation of
        the same number of blocks returns the same ids in the same order.
        """
        for block_id in reversed(seq.block_ids):
            self.allocator.decref(block_id)
        seq.block_ids.clear()

    def trim(self, seq: "Sequence", num_tokens: int) -> int:
        """Shrink ``seq.block_ids`` to the blocks holding its first ``num_tokens`` tokens.

        Used to roll back speculative tokens (:mod:`llmserve.engine.speculative`): blocks past
        ``ceil(num_tokens / block_size)`` are released last-to-first; slots of rejected tokens
        inside the kept last block are simply overwritten later. Does not touch
        ``seq.num_computed_tokens``.

        Returns:
            The number of blocks released.

        Raises:
            ValueError: ``num_tokens`` < 0.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        keep = self.blocks_needed(num_tokens)
        released = 0
        while len(seq.block_ids) > keep:
            self.allocator.decref(seq.block_ids.pop())
            released += 1
        return released

    def reset_peak(self) -> None:
        """Restart the high-water mark from the current use."""
        self.peak_used_blocks = self.allocator.num_used

    # ---- addressing ---------------------------------------------------------------------------
    def slot(self, seq: "Sequence", position: int) -> int:
        """Flat cache slot of token ``position``: ``block_ids[pos // bs] * bs + pos % bs``.

        Raises:
            IndexError: ``position`` is not covered by the block table.
        """
        bs = self.block_size
        if position < 0 or position // bs >= len(seq.block_ids):
            raise IndexError(
                f"position {position} of sequence {seq.request_id!r} is outside its "
                f"{len(seq.block_ids)} blocks of {bs} tokens")
        return seq.block_ids[position // bs] * bs + position % bs

    def slots(self, seq: "Sequence", start: int, num_tokens: int) -> list[int]:
        """Flat slots of positions ``start .. start + num_tokens - 1`` (see :meth:`slot`)."""
        return [self.slot(seq, p) for p in range(start, start + num_tokens)]

    # ---- accounting ---------------------------------------------------------------------------
    def memory_stats(self, seqs: Iterable["Sequence"], bytes_per_token_slot: int,
                     max_model_len: int | None = None) -> MemoryStats:
        """Memory accounting of the cache and of ``seqs`` (usually the running sequences).

        Args:
            seqs: the sequences whose tables and fragmentation are counted.
            bytes_per_token_slot: bytes of K+V for one token over all layers
                (:meth:`KVCache.bytes_per_token`).
            max_model_len: caps each request's contiguous reservation (None: no cap).

        Returns:
            A :class:`MemoryStats`. The contiguous baseline reserves ``prompt + max_tokens``
            slots per request, as a per-request static cache would.
        """
        seqs = list(seqs)
        bs = self.block_size
        filled = sum(s.num_computed_tokens for s in seqs)
        paged = sum(len(s.block_ids) for s in seqs) * bs
        cap = max_model_len if max_model_len is not None else float("inf")
        contiguous = int(sum(min(s.max_total_tokens, cap) for s in seqs))
        block_bytes = bs * bytes_per_token_slot
        return MemoryStats(
            block_size=bs,
            bytes_per_token_slot=bytes_per_token_slot,
            num_total_blocks=self.num_total_blocks,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=self.num_free_blocks,
            peak_used_blocks=self.peak_used_blocks,
            reserved_bytes=self.num_total_blocks * block_bytes,
            used_bytes=self.num_used_blocks * block_bytes,
            peak_used_bytes=self.peak_used_blocks * block_bytes,
            num_seqs=len(seqs),
            filled_slots=filled,
            paged_slots=paged,
            fragmentation_slots=paged - filled,
            contiguous_slots=contiguous,
            paged_bytes=paged * bytes_per_token_slot,
            fragmentation_bytes=(paged - filled) * bytes_per_token_slot,
            contiguous_bytes=contiguous * bytes_per_token_slot,
            reduction=(1.0 - paged / contiguous) if contiguous else 0.0,
        )

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"BlockManager(blocks={self.num_total_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks})")
