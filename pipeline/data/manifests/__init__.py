"""Manifests: what a data set's shards hold (counts, fields, classes) and where they are, resolved into a Source."""
