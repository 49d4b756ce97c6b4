"""Shards: reading the tar members of a shard into samples, and the buffer a read fills."""
