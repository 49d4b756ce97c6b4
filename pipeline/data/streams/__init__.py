"""The stream: a source's stages, the mix of sources, MixedStream/EvalStream and their state."""
