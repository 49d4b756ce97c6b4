"""Stream several WebDataset tar-shard datasets into one DDP model.

Data flows one way, and the subpackages follow it:
`writers` (sources -> shards, manifests, indexes of other writers' tars) -> files, HTTP or `pipe:`
-> `data` (store, shards, decoding, fields, manifests, streams, and the hand-over from workers
on top) -> `train` (the DDP loop, checkpoints, metrics, the report).
`files`, `errors` and `cli` are shared by all three.

`pipeline.stream` and `pipeline.topology` are the public API (`from pipeline.stream import
MixedStream, make_loader, resolve`, `from pipeline.topology import Topology`); its `resolve`
indexes a set that has no manifest on first use. docs/layout.md draws the folders of `data`,
bottom to top.
"""
