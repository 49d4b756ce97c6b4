"""A batch's keys as they cross from a worker: one string, split only when read.

A worker sends its batch's keys joined by NUL (workers.pack); splitting them into 256
strings cost the consuming process about 10 us a batch, an eighth of its whole budget
(docs/benchmarks.md, "The hand-over from workers"), and most loops never read a key.
`Keys` holds the joined string and the count, and makes the list the first time anything
but its length is asked: it reads as the list did (len, index, slices, iteration, `in`,
equality with a list, +, *, copy()), and `copy()`, `+` and `*` give lists. It pickles as the
plain list (a pickle or torch.save file reads back as a list without this package;
torch.load's weights_only needs `torch.serialization.safe_globals([list])`, or `list(keys)`
saved). Mutation (append, sort, k[0] = ...) is refused, as of a tuple. `list(keys)` gives
a real list (for json, say).
"""
from collections.abc import Sequence

SEP = "\0"  # no key holds it (workers.pack sends a list as it is when one does)


class Keys(Sequence):
    """n keys joined by SEP in `text`, as a read-only sequence of str."""

    __slots__ = ("_text", "_n", "_list")

    def __init__(self, text, n):
        self._text, self._n, self._list = text, n, None

    @classmethod
    def of(cls, keys):
        """A list's keys as Keys, so that a batch's keys are one type whatever the workers."""
        made = cls(None, len(keys))
        made._list = keys
        return made

    def _keys(self):
        if self._list is None:
            self._list = self._text.split(SEP) if self._n else []
        return self._list

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        return self._keys()[i]

    def __iter__(self):
        return iter(self._keys())

    def __contains__(self, key):
        return key in self._keys()

    def __eq__(self, other):
        if isinstance(other, Keys):
            if self._text is not None and other._text is not None:
                return self._n == other._n and self._text == other._text
            return self._keys() == other._keys()
        return self._keys() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # as a list's

    def __add__(self, other):
        return self._keys() + list(other) if isinstance(other, (list, Keys)) else NotImplemented

    def __radd__(self, other):
        return other + self._keys() if isinstance(other, list) else NotImplemented

    def __mul__(self, n):
        return self._keys() * n if hasattr(n, "__index__") else NotImplemented

    __rmul__ = __mul__

    def copy(self):
        """A real list of the keys, as list.copy gives."""
        return list(self._keys())

    def __repr__(self):
        return repr(self._keys())

    def __reduce__(self):
        # as the plain list, read back without this package (and by torch.load with list allowed)
        return list, (list(self._keys()),)
