"""Stream several WebDataset tar-shard datasets into one DDP model.

Data flows one way, and the subpackages follow it:
`writers` (sources -> shards, manifests, indexes of other writers' tars) -> files, HTTP or `pipe:`
-> `data` (remote I/O, tar read, decode, the partition into slots, shuffle, mix, batches, the
hand-over from workers) -> `train` (the DDP loop, checkpoints, metrics, the report).
`files`, `errors` and `cli` are shared by all three.

`pipeline.stream` is the streaming API users import (the data path's stream, with a `resolve`
that indexes a set on first use); `pipeline.topology` stands for `pipeline.ordering.topology`.
"""
