"""Cache engineering: turning a request into exact cache states that can be shared, evicted and restored.

- `program`: compile owners + drop/reposition operations into per-token positions and visibility
  (`validate` checks the operations: CacheOpError).
- `oracle`: the walk of docs/design.md 2.3 executed token by token (the reference for every engine test).
- `segments`: run many segments in one forward with dense masked attention (torch reference).
- `pool`: the paged KV pool's bookkeeping (pages, refcounts, integrity check).
- `keys`, `index`: cache keys over (events, token, position) and the index of cached pages (exact and
  re-rotatable matches, drop-aware LRU eviction).
- `restore`: recompute only the missing KV that some query reads, in one pass.

See docs/walk.md and docs/cache-keys.md.
"""
