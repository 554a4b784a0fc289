# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of ``--infinigen-residency device-first``: whether an engine's sparse
layers are still in vLLM's device blocks (``Residency``, one per scheduler, kept on its
block pool and shared by the sparse groups' managers of ``spec.py``), its moves to the
pool and returns, and what the workers copy from the pool in a step (``restored``,
``filled``). ``spec.py`` says when each happens."""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(__name__)


QUICK_UNDO = 64  # scheduler steps: a return undone by a move sooner doubles the patience
MAX_PATIENCE = 1024


class Residency:
    """Whether an engine's sparse layers are still in the device blocks: one
    per scheduler (its block pool), shared by the sparse groups' managers."""

    def __init__(self) -> None:
        self.moved = False
        self.managers: list = []  # the sparse groups' (spec.py's InfiniGenSparseManager)
        self._moves = {"pool": 0, "device": 0}  # not yet reported, by destination
        # Requests over the pool whose sparse blocks come back at their next
        # allocation (``restore``); of those, the ones that got them in the step
        # being scheduled (``cleared``: the workers empty their sparse rows, which
        # still name the blocks of the move, before appending the new ones) and
        # still hold them (``restored``: the workers copy their K/V from the pool;
        # a move in the same step frees them again).
        self.to_restore: set[str] = set()
        self.cleared: set[str] = set()
        self.restored: set[str] = set()
        # Requests allocated while resident with a prefix-cache hit, in the step
        # being scheduled: the hit's blocks the sparse groups did not have cached
        # (first, stop), which the workers fill from the pool; and whether the pool
        # is capped (the connector says).
        self.filled: dict[str, tuple[int, int]] = {}
        self.pool_capped = False
        # Every KV-cache group a request allocates in, set by the connector (None:
        # the dense group and the sparse ones); a sliding-window group (Gemma 3's)
        # needs its blocks too.
        self.num_groups: int | None = None
        # Against flip-flops (each return copies its requests' K/V): the steps the
        # return's condition must hold in a row, doubled when a return is undone
        # by a move within QUICK_UNDO steps, back to 1 after one that lasted (an
        # idle return too: ``move_back``).
        self.patience = 1
        self._fit_steps = 0
        self._steps = 0
        # The last return's step (None: none since the last move), and whether it
        # copied requests back (``restore``) or found none left (``move_back``).
        self._returned_at: int | None = None
        self._copied = False

    def move(self) -> int:
        """Frees every sparse group's blocks of every request, which run over the
        pool until they finish or come back (``restore``). Returns the blocks freed."""
        freed = 0
        requests = self.live_requests()
        for manager in self.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                held = [block for block in blocks if not block.is_null]
                # Uncached first: those of this step's tokens are never written now.
                manager.block_pool.evict_blocks(_cached(held))
                manager.block_pool.free_blocks(reversed(held))
                freed += len(held)
                manager.req_to_blocks[request_id] = []
                if request_id in manager.num_cached_block:
                    manager.num_cached_block[request_id] = 0
        self.moved = True
        self.to_restore.clear()  # over the pool again, with the rest
        self.restored.clear()  # their blocks are freed; nothing to copy
        self.filled.clear()  # (the pool serves their hits)
        if self._returned_at is not None:
            if self._steps - self._returned_at >= QUICK_UNDO:
                self.patience = 1  # a return that lasted
            elif self._copied:
                self.patience = min(2 * self.patience, MAX_PATIENCE)
            self._returned_at = None
        self._fit_steps = 0
        self._moves["pool"] += 1
        logger.info("InfiniGen: the device blocks ran short: %d request(s) moved to the pool "
                    "and the selection (--infinigen-residency device-first), %d blocks of the "
                    "sparse layers freed", len(requests), freed)
        return freed

    def groups(self) -> int:
        """The KV-cache groups a request's new tokens take blocks in, each at most
        as many as a full-attention group (a sliding window's take fewer)."""
        return self.num_groups or len(self.managers) + 1

    def holds_requests(self) -> bool:
        """Whether a request is live in the sparse groups (allocated, not freed)."""
        return any(manager.req_to_blocks for manager in self.managers)

    def move_back(self) -> None:
        """Resident again: every request that ran over the pool has finished. A
        return too: the patience is 1 again if it lasts (``move``); undone soon,
        it stays (no copy was made, so nothing to double against)."""
        self.moved = False
        self._returned_at = self._steps
        self._copied = False
        self._moves["device"] += 1
        logger.info("InfiniGen: every request that ran over the pool has finished: new "
                    "requests are resident again (device blocks and vLLM's kernel; "
                    "--infinigen-residency device-first)")

    def live_requests(self) -> set[str]:
        """The requests live in the sparse groups (over the pool while moved)."""
        return {request_id for manager in self.managers for request_id in manager.req_to_blocks}

    def tick(self) -> None:
        """One scheduler step, resident or not (the connector, each step)."""
        self._steps += 1

    def step(self, fits: bool) -> bool:
        """A step over the pool (``fits``: whether its live requests would fit
        back); whether to return now (``restore``)."""
        self._fit_steps = self._fit_steps + 1 if fits else 0
        return self._fit_steps >= self.patience

    def restore(self, requests: set[str], blocks: int, free: int) -> None:
        """Resident again from the next step while ``requests`` over the pool
        are live: each gets its sparse blocks (``blocks`` in all, of ``free``)
        at its next allocation, and the workers copy its K/V from the pool."""
        self.moved = False
        self.to_restore = set(requests)
        self._returned_at = self._steps
        self._copied = True
        self._moves["device"] += 1
        logger.info("InfiniGen: the %d request(s) over the pool fit in the device blocks "
                    "again (%d blocks of the sparse layers, %d free, for %d step(s) in a row): "
                    "resident from the next step, their K/V copied back from the pool "
                    "(--infinigen-residency device-first)", len(requests), blocks, free,
                    self._fit_steps)

    def take_returns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The requests whose sparse blocks came back in the step just scheduled:
        those whose rows the workers empty, and those whose K/V they copy."""
        cleared, restored = tuple(sorted(self.cleared)), tuple(sorted(self.restored))
        self.to_restore -= self.cleared
        self.cleared, self.restored = set(), set()
        return cleared, restored

    def take_fills(self) -> tuple[tuple[str, int, int], ...]:
        """The requests whose prefix-cache hit's sparse blocks the workers fill from
        the pool in the step just scheduled, with the first and the end of them."""
        filled = tuple((request_id, *span) for request_id, span in sorted(self.filled.items()))
        self.filled = {}
        return filled

    def forget(self, request_id: str) -> None:
        """``request_id`` was freed (finished or preempted): nothing comes back. Freed
        before the workers' copy into its blocks (preempted in the step that gave them:
        vLLM's priority policy), those blocks are uncached in every sparse group (their
        hashes were set at allocation; nothing will write them)."""
        if request_id in self.restored or request_id in self.filled:
            unwritten = (slice(None) if request_id in self.restored
                         else slice(*self.filled[request_id]))
            for manager in self.managers:
                manager.block_pool.evict_blocks(
                    _cached(manager.req_to_blocks.get(request_id, [])[unwritten]))
        self.to_restore.discard(request_id)
        self.cleared.discard(request_id)
        self.restored.discard(request_id)
        self.filled.pop(request_id, None)

    def take_moves(self) -> dict[str, int]:
        """The moves since the last call, by destination (``pool``, ``device``)."""
        moves, self._moves = self._moves, {"pool": 0, "device": 0}
        return moves


def _cached(blocks) -> set[int]:
    """The ids of ``blocks`` in vLLM's prefix cache."""
    return {block.block_id for block in blocks if block.block_hash is not None}


def residency_of(block_pool) -> Residency:
    """The residency of the scheduler owning ``block_pool`` (kept on the pool,
    which every group's manager shares)."""
    residency = getattr(block_pool, "infinigen_residency", None)
    if residency is None:
        residency = block_pool.infinigen_residency = Residency()
    return residency
