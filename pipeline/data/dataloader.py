"""The stream where torch users put a DataLoader: a plain loop, Lightning, `accelerate`.

    loader = StatefulLoader(MixedStream(sources, weights, batch_size=64), num_workers=4)
    for epoch in range(3):
        for batch in loader:          # each iteration one epoch, a new order each time
            ...
    state = loader.state_dict()       # mid-epoch too; JSON, as torchdata's StatefulDataLoader
    loader.load_state_dict(state)     # a new loader goes on where this one stopped

`state_dict()`/`load_state_dict()` are the calls torchdata's `StatefulDataLoader` answers and
Lightning's fit loop makes on a train dataloader that has them (it saves the state into its
checkpoint and loads it on resume); `accelerate` passes such a loader through
`prepare` when told not to shard it again (`DataLoaderConfiguration(dispatch_batches=False,
split_batches=False)` and the stream's own Topology: the stream already gives each rank its
share). The state is the stream's (pipeline.data.stream.MixedStream.state_dict) and the
next epoch this face starts: nothing else, so nothing can disagree with it.
"""
from pipeline.data.loader import make_loader


class StatefulLoader:
    """Iterate once per epoch: the first pass is epoch 0 (or where a loaded state stopped),
    each later pass the next epoch. Keyword arguments go to make_loader."""

    def __init__(self, stream, num_workers=0, **kw):
        self.stream = stream
        self.loader = make_loader(stream, num_workers, **kw)
        self.next_epoch = 0  # the epoch the next pass starts, unless a state was loaded
        self._resumed = False

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self._resumed:  # the loaded state decides this pass's epoch and where it starts
            self._resumed = False
        else:
            self.stream.set_epoch(self.next_epoch)
            self.next_epoch += 1
        return iter(self.loader)

    def state_dict(self):
        """{"next_epoch", "stream": the stream's state_dict()}; JSON-serialisable."""
        return {"next_epoch": self.next_epoch, "stream": self.stream.state_dict()}

    def load_state_dict(self, state):
        """Go on from state_dict(): the next pass continues the saved epoch where it stopped
        (or starts the next one, for a state saved at an epoch's end)."""
        if not isinstance(state, dict) or not {"next_epoch", "stream"} <= set(state):
            raise ValueError(f"{str(state)[:80]}: a StatefulLoader.state_dict() expected ({{'next_epoch', 'stream'}})")
        did = self.stream.load_state_dict(state["stream"])
        self.next_epoch = int(state["next_epoch"]) + (did["deal"] == "next epoch")
        self._resumed = True

    def close(self):
        self.loader.close()
