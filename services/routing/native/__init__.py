"""The router's KV index in C: the `KvIndex` semantics of the Python radix tree, at NVIDIA
Dynamo's speed and under its memory per block.

Built by `python -m services.routing.native.build` (`make install` runs it); importing
`NativeRadixTree` from `native_radix_tree` raises ImportError where it was not built, and
`services.routing.index_choice.new_index` then falls back to the Python `RadixTree`.

Why C, from a profile of the Python radix tree replaying the indexer benchmark's trace (1.10M
stored and 0.14M removed blocks, 16 workers; events decoded beforehand, cProfile and timers):
- a stored block costs about 1.5 us, nearly all of it the store loop's own bytecode (the inline
  probe of the holder's table, the typed-array reads and writes, the mask update: some 40
  bytecodes at 20 to 40 ns each); a removed block about 3 us, in the Python calls that release,
  prune and unlink nodes (about six a block);
- the caller's (hash, hash) tuple per block adds about 0.3 us on either index.
The interpreter's cost per bytecode is the floor, not the data structure: the loop is already
table-driven with no call per block, so even halving its bytecodes would leave it at about
Dynamo's rate, never at 2x. In C the same loop costs about 0.3 us a block, and that is mostly
one cache miss in the holder's table plus the Python objects handed in; the query walk is a few
microseconds for 256 levels.
"""
