"""The data path: remote I/O and the cache, tar reading, decoding, the stages of a source's
stream, the mixture, the batch format and the hand-over from loader workers."""
