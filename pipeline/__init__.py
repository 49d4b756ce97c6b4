"""Stream several WebDataset tar-shard datasets into one DDP model.

Data flows one way, and the subpackages follow it:
`writers` (sources -> shards, manifests, indexes of other writers' tars) -> files, HTTP or `pipe:`
-> `data` (remote I/O, tar read, decode, the partition into slots, shuffle, mix, batches, the
hand-over from workers) -> `train` (the DDP loop, checkpoints, metrics, the report).
`files`, `errors` and `cli` are shared by all three.

`from pipeline import stream` and `from pipeline.stream import ...` keep working (small
modules that stand for `pipeline.data.stream` and `pipeline.ordering.topology`).
"""
