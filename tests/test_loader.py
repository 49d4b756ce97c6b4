"""pipeline.loader: the hand-over from DataLoader workers (BatchRing buffers, uint8 in shared
memory, normalisation on arrival) and persistent workers that follow set_epoch."""
import numpy as np
import pytest
import torch

from helpers import HALF, key_index, keys_of, run_epoch, train_sources
from pipeline.data.loader import BatchRing, RingBuffer, _as_is, _RingFed
from pipeline.data.stream import MixedStream, make_loader
from pipeline.data.topology import Worker


class _AsSent(torch.utils.data.IterableDataset):
    """Each batch's image as a worker sends it when the loader's ring is full: (shared, dtype)."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        ring = _RingFed(self.stream, BatchRing(1, 1, self.stream.layout.batch_shape(self.stream.batch_size)))
        ring.ring.busy.fill_(1)  # every ring buffer busy: the worker falls back to a new shared tensor
        for b in self.stream.batches(Worker.current(), lambda n: ring._borrow_buffer(0, n)):
            yield torch.from_numpy(b["image"]).is_shared() or _shared_numpy(b["image"]), b["image"].dtype


def _shared_numpy(array):
    """True if a numpy array's memory is a shared-memory mapping (it views a shared tensor)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    address = array.__array_interface__["data"][0]
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return "torch_" in line or "/dev/shm" in line or "(deleted)" in line
    return False


@pytest.mark.parametrize("normalize", [True, False])
def test_worker_batches_are_uint8_made_in_shared_memory(data, normalize):
    """A batch not made in shared memory is copied there when a worker sends it, and float
    images are 4x the bytes of uint8 (3 MB against 768 KB a batch of 256): the loader's
    main cost with workers. make_loader normalises on arrival (test above)."""
    stream = MixedStream(train_sources(data.dir), HALF, 16, epoch_samples=64, normalize=normalize)
    sent = list(torch.utils.data.DataLoader(_AsSent(stream), batch_size=None, num_workers=1))
    assert sent and all(s[0] and s[1] == np.uint8 for s in sent)


def _check_pixels(data, batch):
    """Every image of a uint8 batch equals its original, MNIST's zero border included."""
    for i, (key, src) in enumerate(zip(batch["key"], batch["source"].tolist())):
        name = ("mnist", "cifar10")[src]
        original = data.synth[name, "train"].image(key_index(key))
        img = batch["image"][i].numpy()
        if src == 0:
            expect = np.zeros((3, 32, 32), np.uint8)
            expect[:, 2:30, 2:30] = original[0]
            assert (img == expect).all(), key
        else:
            assert (img == original).all(), key


def test_worker_batches_leave_through_the_ring_and_reused_buffers_start_clean(data):
    """40 batches over 2 workers reuse each of a worker's 6 ring buffers 3 times or more: a
    CIFAR10 image left in a buffer must not show through the border of a later MNIST one.
    Batches copied out of the ring are ordinary tensors; a batch sent as a new shared-memory
    file would arrive shared."""
    stream = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=8 * 40, normalize=False)
    batches = list(make_loader(stream, 2))
    assert len(batches) == 40
    for b in batches:
        assert not b["image"].is_shared()
        _check_pixels(data, b)


def test_a_full_ring_falls_back_to_new_shared_tensors():
    ring = BatchRing(workers=1, depth=2, batch_shape=(4, 3, 8, 8))
    taken = [ring.take(0, 4) for _ in range(3)]
    assert [t[0] for t in taken] == [RingBuffer(0, 0), RingBuffer(0, 1), None]
    assert taken[0][1].shape == (4, 3, 8, 8) and taken[2][1] is None
    ring.release(RingBuffer(0, 0))  # what the main process does once it has copied the batch out
    assert ring.take(0, 2)[0] == RingBuffer(0, 0)


def test_a_new_pass_frees_buffers_an_abandoned_pass_left_busy(data):
    """Batches of a pass the consumer abandons are discarded unread, so nothing frees
    their buffers; each worker frees its own as it starts a pass."""
    stream = MixedStream(train_sources(data.dir), HALF, 8, epoch_samples=32, normalize=False)
    ring = BatchRing(workers=1, depth=2, batch_shape=(8, 3, 32, 32))
    ring.busy.fill_(1)
    sent = list(torch.utils.data.DataLoader(_RingFed(stream, ring), batch_size=None, num_workers=1,
                                            collate_fn=_as_is))
    # two buffers, freed as the pass starts; nothing here frees them again, so the last two
    # batches take the fallback: new shared tensors
    assert [isinstance(b["image"], RingBuffer) for b in sent] == [True, True, False, False]



@pytest.mark.slow
def test_persistent_workers_follow_set_epoch_and_weights(even):
    """One loader for several epochs: its workers must see each set_epoch (and new weights)."""
    def fresh(epoch, weights):
        s = MixedStream(train_sources(even), weights, 8, seed=3, shuffle_buffer=8)
        s.set_epoch(epoch, weights)
        return keys_of(run_epoch(s, workers=2))

    s = MixedStream(train_sources(even), HALF, 8, seed=3, shuffle_buffer=8)
    loader = make_loader(s, 2)
    seen = []
    for epoch, weights in ((0, HALF), (1, HALF), (2, {"mnist": 1.0, "cifar10": 0.0})):
        s.set_epoch(epoch, weights)
        seen.append([k for b in loader for k in b["key"]])
        assert seen[-1] == fresh(epoch, weights)
    assert seen[0] != seen[1]
    assert all(k.startswith("mnist") for k in seen[2])
