"""Which engine replicas were sent which prompt prefixes: the memory of prefix-aware routing (cluster/engine_router.py).

A prompt is cut into blocks of `block_tokens` token ids (the engine's KV page size: the engine reuses whole pages
of a prefix it holds); a trailing partial block is left out. Block k's key hashes the prompt's first k + 1 blocks,
chained (`hash((key of block k - 1, ids of block k))`), so one key names one whole prefix and two prompts share
key k exactly when they share their first k + 1 blocks (up to a 64-bit hash collision, which costs one misrouted
request, never a wrong token: the engine's own cache compares token ids).

`PrefixIndex` maps a key to the replicas that were sent a prompt with that prefix, most recent last. It holds at
most `max_blocks` keys and forgets the least recently recorded first; a prompt's keys are recorded longest first,
so the long tails of prompts go before the short prefixes they share (a system prompt outlives its questions).
It only remembers what the router sent where: a replica may have evicted those pages since.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

DEFAULT_MAX_BLOCKS = 65536  # keys held; at 64-token pages, 4M prompt tokens; 11 MiB measured (tracemalloc)


def prefix_keys(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """One key per whole block of `token_ids`: key k names the prefix of blocks 0..k."""
    ids, keys, key = tuple(token_ids), [], 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        key = hash((key, ids[start:start + block_tokens]))
        keys.append(key)
    return keys


@dataclass(frozen=True)
class PrefixMatch:
    """The longest recorded prefix of a prompt: how many blocks, and the replicas it was sent to (latest first)."""

    blocks: int
    replicas: tuple[str, ...]


NO_MATCH = PrefixMatch(0, ())


class PrefixIndex:
    """Prefix keys -> replica ids, least recently recorded keys evicted beyond `max_blocks`."""

    def __init__(self, block_tokens: int, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError(f"block_tokens and max_blocks must be >= 1, got {block_tokens} and {max_blocks}")
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self.entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()  # key -> replica ids, most recent last
        self.blocks_per_replica: Counter[str] = Counter()

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        return prefix_keys(token_ids, self.block_tokens)

    def longest_match(self, keys: Sequence[int], live: Collection[str]) -> PrefixMatch:
        """The longest prefix among `keys` recorded for a replica in `live`, with those replicas."""
        for blocks in range(len(keys), 0, -1):
            holders = [replica for replica in reversed(self.entries.get(keys[blocks - 1], ())) if replica in live]
            if holders:
                return PrefixMatch(blocks, tuple(holders))
        return NO_MATCH

    def record(self, keys: Sequence[int], replica: str) -> None:
        """`replica` was sent a prompt with these prefix keys."""
        for key in reversed(keys):
            holders = self.entries.pop(key, ())
            if replica in holders:
                holders = tuple(r for r in holders if r != replica)
            else:
                self.blocks_per_replica[replica] += 1
            self.entries[key] = (*holders, replica)
        while len(self.entries) > self.max_blocks:
            _, holders = self.entries.popitem(last=False)
            self._forget(holders)

    def drop_replicas(self, gone: Collection[str]) -> None:
        """Forgets every prefix of replicas that left the deployment (stopped, replaced, dead)."""
        gone = set(gone) & set(self.blocks_per_replica)
        if not gone:
            return
        for key, holders in list(self.entries.items()):
            kept = tuple(replica for replica in holders if replica not in gone)
            if not kept:
                del self.entries[key]
            elif len(kept) != len(holders):
                self.entries[key] = kept  # an existing key keeps its place in the eviction order
        for replica in gone:
            del self.blocks_per_replica[replica]

    def blocks_of(self, replica: str) -> int:
        """How many prefix keys name `replica`: what it was sent, a tie-breaker between equally loaded replicas."""
        return self.blocks_per_replica.get(replica, 0)

    def _forget(self, holders: tuple[str, ...]) -> None:
        for replica in holders:
            self.blocks_per_replica[replica] -= 1
            if self.blocks_per_replica[replica] <= 0:
                del self.blocks_per_replica[replica]
