"""The stream where torch users put a DataLoader: a plain loop, Lightning, `accelerate`.

    loader = StatefulLoader(MixedStream(sources, weights, batch_size=64), num_workers=4)
    for epoch in range(3):
        for batch in loader:          # each iteration one epoch, a new order each time
            ...
    state = loader.state_dict()       # mid-epoch too; JSON, as torchdata's StatefulDataLoader
    loader.load_state_dict(state)     # a new loader goes on where this one stopped

`state_dict()`/`load_state_dict()` are the calls torchdata's `StatefulDataLoader` answers and
Lightning's fit loop makes on a train dataloader that has them (it saves the state into its
checkpoint and loads it on resume); `accelerate`'s `prepare` passes the loader through as it
is (it is no torch DataLoader: the stream already gives each rank its share) and
`accelerator.register_for_checkpointing(loader)` saves its state with `save_state`. The state
is the stream's (pipeline.data.streams.stream.MixedStream.state_dict) and the next epoch this face
starts: nothing else, so nothing can disagree with it.

A batch counts as read when the loader hands it out. A loop that fetches batches ahead of
using them (Lightning prefetches one) passes `record=False` and calls `used(batch)` as it
trains each one, so that a state taken between steps never counts a batch not trained.
An iterator that is made but never advanced starts nothing (Lightning makes one early).
"""
import numbers

from pipeline.data.handover.loader import make_loader
from pipeline.errors import short
from pipeline.ordering.order import MAX_COUNT


class StatefulLoader:
    """Iterate once per epoch: the first pass is epoch 0 (or where a loaded state stopped),
    each later pass the next epoch. Keyword arguments go to make_loader."""

    def __init__(self, stream, num_workers=0, **kw):
        self.stream = stream
        self.loader = make_loader(stream, num_workers, **kw)
        self.next_epoch = 0  # the epoch the next pass starts, unless a state was loaded
        self.epoch = None  # the epoch of the pass under way (or the last one)
        self._resumed = False

    def __len__(self):
        return len(self.loader)

    @property
    def pending(self):
        """The epoch the next pass reads: a loaded state's own, else next_epoch."""
        return self.next_epoch - 1 if self._resumed else self.next_epoch

    def __iter__(self):
        return self._pass()

    def _pass(self):
        """A generator: nothing happens until its first batch is asked for."""
        if self._resumed:  # the loaded state decides this pass's epoch and where it starts
            self._resumed = False
        else:
            self.stream.set_epoch(self.next_epoch)
            self.next_epoch += 1
        self.epoch = self.next_epoch - 1
        yield from self.loader

    def used(self, batch):
        """With record=False: `batch` was trained, so a state taken now counts it."""
        self.stream.record(batch["state"])

    def state_dict(self):
        """{"next_epoch", "stream": the stream's state_dict()}; JSON-serialisable."""
        return {"next_epoch": self.next_epoch, "stream": self.stream.state_dict()}

    def load_state_dict(self, state):
        """Go on from state_dict(): the next pass continues the saved epoch where it stopped
        (or starts the next one, for a state saved at an epoch's end). Everything is checked
        before the stream takes the state (next_epoch against the stream state's epoch too):
        a refused state leaves the loader and the stream as they were."""
        if not isinstance(state, dict) or not {"next_epoch", "stream"} <= set(state):
            raise ValueError(f"{str(state)[:80]}: a StatefulLoader.state_dict() expected ({{'next_epoch', 'stream'}})")
        epoch = state["next_epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or not 0 <= epoch <= MAX_COUNT:
            raise ValueError(f"loader state next_epoch: {short(epoch, 60)}; an integer in 0..{MAX_COUNT} expected (a "
                             f"damaged or edited state: load the one state_dict() gave)")
        at, begun = self.stream.goes_on_at(state["stream"])  # checked in full before the stream takes it
        if epoch not in ((at + 1,) if begun else (at, at + 1)):  # saved in at's pass, or before it began
            raise ValueError(f"loader state next_epoch {epoch} disagrees with its stream state, which goes on "
                             f"{'inside' if begun else 'at the start of'} epoch {at} (next_epoch "
                             f"{at + 1 if begun else f'{at} or {at + 1}'} expected): load the one state_dict() gave")
        self.stream.load_state_dict(state["stream"])
        self.next_epoch = at + 1
        self._resumed = True

    def close(self):
        self.loader.close()
