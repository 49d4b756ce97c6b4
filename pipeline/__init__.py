"""Stream several WebDataset tar-shard datasets into one DDP model.

Data flows one way: `sources` -> `shards` -> files or HTTP -> `stream` -> `train`.
"""
