"""A window's samples as the read stage hands them on: columns of its good samples, and where
each sits among the window's places as its manifest counts them (`WindowData.slots`), so that
damage empties its own places only."""
import numpy as np

from pipeline.data.shards.readbuffer import Rows


class WindowData:
    """The samples of one window as columns: keys, labels (class indices), the shard each
    came from, and images: `arena.Rows` (raw pixels where the window's shards were read)
    when every shard was read by `read.regular_members` with raw pixels, else a list of
    encoded images with their extensions."""

    def __init__(self):
        self.keys, self.labels, self.urls, self.chunks = [], [], [], []
        self.refused = []  # (url, key, error) of a training window's samples refused while read, in row order
        self.places = 0  # the window's samples as its manifest counts them: its rows, refused and lost ones too
        self.where, self.refused_at = [], []  # the place of each row, of each refused sample
        self.slots = None  # sealed: per place, its row, len + k for refused[k], len + len(refused) if lost

    def add(self, keys, images, exts, labels, url, places):
        """One shard's samples: images `Rows` (exts "raw") or a list (exts a list), at `places`
        of the window (its pieces' places one after another, each sample at its manifest's)."""
        self.keys += keys
        self.labels.append(np.asarray(labels, np.int64))
        self.urls += [url] * len(keys)
        self.chunks.append((images, exts))
        self.where.append(np.asarray(places, np.int64))

    def seal(self):
        """The columns joined; where samples are missing, `slots`: each sample keeps the place its
        manifest gives it, so that damage takes only its own places, never moves another sample's
        (the window's shuffle, and the `skipped` count of an epoch's positions, see them there)."""
        self.where = np.concatenate(self.where) if self.where else np.zeros(0, np.int64)
        if self.places > len(self.keys):
            self.slots = np.full(self.places, len(self.keys) + len(self.refused), np.int64)
            self.slots[self.where] = np.arange(len(self.keys))
            self.slots[np.asarray(self.refused_at, np.int64)] = len(self.keys) + np.arange(len(self.refused))
        self.labels = np.concatenate(self.labels) if self.labels else np.zeros(0, np.int64)
        self.key_column = np.array(self.keys, dtype=object)  # taken by index arrays, as the other columns
        if self.chunks and all(isinstance(images, Rows) for images, _ in self.chunks):
            self.images, self.exts = Rows.join([images for images, _ in self.chunks]), "raw"
        else:
            self.images, self.exts = [], []
            for images, exts in self.chunks:
                dense = isinstance(images, Rows)
                self.images += images.tobytes() if dense else images
                self.exts += [exts] * len(images) if dense else exts
        del self.chunks
        return self

    def __len__(self):
        return len(self.keys)
