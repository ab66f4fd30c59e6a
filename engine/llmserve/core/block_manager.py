"""Paged KV-cache bookkeeping: a block allocator and per-sequence block tables (no tensors).

The KV cache is cut into fixed-size *physical blocks* of ``block_size`` token slots
(PagedAttention, Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"). A sequence owns a *block table* (``seq.block_ids``): logical block
``i`` (token positions ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``seq.block_ids[i]``. Blocks are handed out one at a time as a sequence grows, so a request
reserves at most ``block_size - 1`` slots it does not use, instead of a contiguous region of its
maximum length.

* :class:`BlockAllocator` -- O(1) free list + reference counts (no notion of sequences), and,
  with prefix caching, the table of cached blocks and the LRU of cached blocks nobody uses.
* :class:`BlockManager` -- grows and frees ``seq.block_ids``; prefix-cache lookups; memory
  accounting.

Automatic prefix caching (the scheme of vLLM V1's automatic prefix caching; SGLang's radix cache
is the tree-shaped alternative). A *full* block's identity is a hash chained over its parent's
hash and its own token ids (:func:`hash_block_tokens`): block ``i`` of a sequence hashes
``(hash of block i-1, tokens[i*bs:(i+1)*bs])``, so equal hashes mean equal *prefixes*, not only
equal blocks. Rules:

* only full blocks whose K/V have all been computed are registered (:meth:`BlockManager.cache_computed_blocks`,
  called by the scheduler at the start of the next step and before a sequence's blocks are
  freed), so a sequence that hits a cached block never reads K/V that is not written yet;
* blocks are reference-counted and shared read-only: a sequence writes K/V only at positions
  ``>= num_computed_tokens``, and every block it shares lies wholly below that;
* a block whose count drops to 0 keeps its hash and joins an LRU of *evictable* blocks; it is
  evicted (hash dropped, content forgotten) only when an allocation finds no never-cached free
  block. A sequence frees its blocks last-to-first, so its deepest blocks are evicted first
  (a chain is looked up from the root and stops at the first miss: evicting a root would strand
  its descendants);
* a hit is capped at ``(num_tokens - 1) // block_size`` blocks, so the step always has at least
  one query token to sample from. A prompt of exactly ``k * block_size`` tokens that is wholly
  cached therefore recomputes its last block into a private block instead of recomputing only its
  last token into the shared one (which would *write* into a block other sequences read). The
  recomputed copy has the same hash as the cached block; it stays unregistered (duplicates are
  never registered) and returns to the plain free list.

The tensors themselves live in :class:`llmserve.worker.kv_cache.KVCache`.
"""

from __future__ import annotations
import hashlib
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable, Sequence as _Seq
if TYPE_CHECKING:  # pragma: no cover
    from .sequence import Sequence


#: Parent hash of a sequence's first block (a fixed constant, so hashes are reproducible across
#: processes; vLLM V1 seeds the same role with a random or configured value).
ROOT_BLOCK_HASH = hashlib.sha256(b"llmserve prefix cache root").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: _Seq[int]) -> bytes:
    """Identity of a full block: ``sha256(parent_hash || int64-LE(token_ids))`` (32 bytes).

    Args:
        parent_hash: the hash of the previous block of the same sequence, or ``None`` for the
            first block (:data:`ROOT_BLOCK_HASH` is used).
        token_ids: the block's ``block_size`` token ids.

    Chaining over the parent makes the hash identify the whole prefix up to and including the
    block (vLLM V1 ``hash_block_tokens``: hash of parent hash, token ids and extra keys; no extra
    keys here: no LoRA or multimodal inputs). SHA-256 rather than Python's ``hash``: a collision
    would silently serve another prompt's K/V.
    """
    h = hashlib.sha256(ROOT_BLOCK_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


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
    * freed blocks without a hash are reused LIFO: the most recently freed block is the next one
      allocated;
    * freed blocks *with* a hash (cached) are reused only when no block without one is free,
      least recently freed first (LRU eviction).

    The free list is a Python list used as a stack (``pop()``/``append()`` are O(1)); the
    evictable cached blocks are an ``OrderedDict`` in freeing order (O(1) append, pop-oldest and
    removal). Reference counts let several block tables share one block: :meth:`allocate`
    returns a block with count 1, :meth:`incref` adds an owner, :meth:`acquire_cached` takes a
    cached block (from the LRU when nobody holds it), and :meth:`decref` (alias :meth:`free`)
    drops one; at count 0 the block returns to the free list, or to the LRU when it has a hash.
    ``num_free`` counts both: an evictable block is free memory that still remembers its K/V.

    Args:
        num_blocks: number of physical blocks, >= 1.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    __slots__ = ("num_blocks", "_free", "_ref_counts", "_evictable", "_block_hash", "_cached",
                 "num_evictions")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Stack of free ids; the top (end of the list) is allocated next, so 0 sits on top.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks
        # prefix cache: free cached blocks, oldest first; hash of each block; hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no owner: never-cached free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered hash (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Free blocks that still hold a hash (evicted in LRU order when needed)."""
        return len(self._evictable)

    def evictable_order(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first (inspection and tests)."""
        return list(self._evictable)

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash registered for ``block_id``, or None."""
        self._check_id(block_id)
        return self._block_hash[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._cached.get(block_hash)

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
        if self._free:
            block_id = self._free.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)        # least recently freed
            del self._cached[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(
                f"all {self.num_blocks} KV cache blocks are in use; free or preempt a sequence first")
        self._ref_counts[block_id] = 1
        return block_id

    def acquire_cached(self, block_id: int) -> None:
        """Add an owner to a cached block (a prefix hit); an evictable one leaves the LRU. O(1).

        Raises:
            ValueError: ``block_id`` out of range or holds no hash.
        """
        self._check_id(block_id)
        if self._block_hash[block_id] is None:
            raise ValueError(f"block {block_id} is not cached (no hash registered)")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Record that in-use ``block_id`` holds the full block identified by ``block_hash``.

        Returns:
            True if registered now; False if the block already has this hash or another block
            is cached under it (a duplicate: it stays unregistered and is freed as a plain block).

        Raises:
            ValueError: the block is free, or already holds a different hash.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot register free block {block_id}")
        current = self._block_hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already holds another hash")
            return False
        if block_hash in self._cached:
            return False
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_cache(self) -> int:
        """Forget every evictable cached block (they become plain free blocks); blocks in use
        keep their hash. Returns the number of blocks forgotten."""
        n = 0
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            self._free.append(block_id)
            n += 1
        return n

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
        """Drop one owner. O(1). When none remain the block goes back on top of the free list,
        or, holding a hash, to the most recent end of the LRU of evictable cached blocks.

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
            if self._block_hash[block_id] is not None:
                self._evictable[block_id] = None
            else:
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

    With ``enable_prefix_caching`` it also keeps the prefix cache (module docstring): the
    scheduler asks :meth:`find_cached_prefix` at admission, pins the hit with
    :meth:`take_cached_blocks`, and calls :meth:`cache_computed_blocks` once K/V is written.

    Args:
        num_blocks: physical blocks (excluding the KV cache's scratch block), >= 1.
        block_size: token slots per block, >= 1.
        enable_prefix_caching: share full blocks between sequences with equal prefixes
            (default False here; :class:`~llmserve.config.CacheConfig` turns it on for engines).

    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.peak_used_blocks = 0
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # prefix-cache counters, in tokens: queried at admission, and found cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, seq: "Sequence") -> list[bytes]:
        """Hashes of ``seq``'s full blocks of known tokens (prompt + read outputs), extended
        lazily in ``seq.block_hashes`` (computed once per block over the sequence's life)."""
        hashes = seq.block_hashes
        bs = self.block_size
        known = seq.num_prompt_tokens + seq.num_output_tokens
        while (len(hashes) + 1) * bs <= known:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            seq.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def find_cached_prefix(self, seq: "Sequence") -> list[int]:
        """Physical ids of the longest cached prefix of ``seq``, in block order (nothing pinned).

        At most ``(seq.num_tokens - 1) // block_size`` blocks, so at least one token is left to
        compute (the step that samples needs a query token; see the module docstring for why a
        fully cached ``k * block_size`` prompt recomputes its last block). Empty when prefix
        caching is off or ``seq`` already holds blocks.
        """
        if not self.enable_prefix_caching or seq.block_ids:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if seq.needs_prompt_logprobs:     # unscored prompt positions must be computed
            limit = min(limit, len(seq.prompt_logprobs) // self.block_size)
        hit: list[int] = []
        for h in self.block_hashes(seq)[:limit]:
            block_id = self.allocator.lookup(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def num_admission_blocks(self, seq: "Sequence", cached: list[int], num_new_tokens: int) -> int:
        """Free blocks that admitting ``seq`` with prefix hit ``cached`` and ``num_new_tokens``
        tokens to compute consumes: the new blocks, plus the hit blocks that are evictable now
        (taking them removes them from the free pool)."""
        new = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return new + sum(1 for b in cached if self.allocator.ref_count(b) == 0)

    def take_cached_blocks(self, seq: "Sequence", cached: list[int]) -> None:
        """Pin the prefix hit ``cached`` as the first blocks of ``seq`` (an empty table) and
        count the query (``seq.num_tokens`` tokens) and the hit (``len(cached) * block_size``).

        Pin the hit before allocating anything else for ``seq``: an allocation may evict an
        unpinned evictable block. The caller sets ``seq.num_computed_tokens`` to the hit length.

        Raises:
            ValueError: ``seq`` already holds blocks, or a block is not cached.
        """
        if seq.block_ids:
            raise ValueError(f"sequence {seq.request_id!r} already holds blocks")
        for block_id in cached:
            self.allocator.acquire_cached(block_id)
        seq.block_ids.extend(cached)
        seq.num_committed_blocks = len(cached)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached) * self.block_size
        used = self.allocator.num_used
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def cache_computed_blocks(self, seq: "Sequence") -> int:
        """Register ``seq``'s full blocks whose K/V are computed (``num_computed_tokens``, only
        tokens whose ids are known) and that are not registered yet. Call it after the step that
        computed them was launched (device work is stream-ordered, so a later step that reads
        the block runs after the write). Returns the number of blocks registered."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        known = seq.num_prompt_tokens + seq.num_output_tokens
        full = min(seq.num_computed_tokens, known, len(seq.block_ids) * bs) // bs
        start = seq.num_committed_blocks
        if full <= start:
            return 0
        hashes = self.block_hashes(seq)
        n = 0
        for i in range(start, full):
            n += self.allocator.register(seq.block_ids[i], hashes[i])
        seq.num_committed_blocks = full
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody uses (e.g. between benchmark phases); returns the
        number forgotten. Blocks in use keep their hashes."""
        return self.allocator.reset_cache()

    def prefix_cache_stats(self) -> dict:
        """``enabled``, ``queries`` / ``hits`` (tokens, since the last reset), ``hit_rate``
        (hits / queries, 0.0 without queries), ``cached_blocks`` (blocks holding a hash now),
        ``evictable_blocks`` and ``evicted_blocks`` (evictions since the last reset)."""
        q, h = self.prefix_cache_queries, self.prefix_cache_hits
        return {"enabled": self.enable_prefix_caching, "queries": q, "hits": h,
                "hit_rate": h / q if q else 0.0, "cached_blocks": self.allocator.num_cached,
                "evictable_blocks": self.allocator.num_evictable,
                "evicted_blocks": self.allocator.num_evictions}

    def reset_prefix_cache_stats(self) -> None:
        """Zero the query, hit and eviction counters (the cache itself is kept)."""
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.allocator.num_evictions = 0

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
        the same number of blocks returns the same ids in the same order, and cached blocks
        enter the LRU deepest first (evicted before their parents). With prefix caching, the
        computed full blocks are registered first (:meth:`cache_computed_blocks`), so a finished,
        aborted or preempted sequence leaves its prefix behind for later requests.
        """
        self.cache_computed_blocks(seq)
        for block_id in reversed(seq.block_ids):
            self.allocator.decref(block_id)
        seq.block_ids.clear()
        if self.enable_prefix_caching:
            seq.num_committed_blocks = 0

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
        if self.enable_prefix_caching and seq.num_committed_blocks > keep:
            seq.num_committed_blocks = keep
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
