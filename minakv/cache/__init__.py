"""Cache engineering: turning a request into exact cache states that can be shared, evicted and restored.

- `program`: compile owners + drop/reposition operations into per-token positions and visibility
  (`validate` checks the operations: CacheOpError).
- `plan`: a request's KV entries (born tokens and the re-rotated copies a reposition needs), the segments
  that compute them, and which entries to compute when some are cached (the dependency closure).
- `keys`: what an entry holds (its record) and the hash chain that keys a page of entries.
- `pool`: the paged KV pool's bookkeeping (pages, refcounts, integrity check).
- `index`: the cached pages by key (exact matches, holes after eviction, drop-aware LRU eviction).
- `kvcache`: the scheduler's view of it all: pool + index, allocate / match / release.

The walk oracle and the dense segment reference the engine is tested against are in minakv.reference.
See docs/walk.md and docs/cache-keys.md.
"""
