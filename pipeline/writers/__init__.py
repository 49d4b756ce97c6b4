"""What writes and checks shards: sources (torchvision, ImageFolder, synthetic), the shard
writer, indexes of other writers' WebDatasets, and shard-set previews."""
