"""The interface every stage of the stream has, as torchdata's nodes have it.

`next(n)` gives the stage's next item (for the per-source stages: the chunk of the next n
positions), pulled from `upstream`; `state()` is where it stands and `reset(state)` goes back
there (None: the start). A composite nests its children's state under their names
(`stages.SourceStream`, `stages.Mix`). Most stages are pure functions of what they are handed
and keep no state: a stream's position lives in two places only, each slot's count
(`stages.Positions`) and each worker's batch position (`stages.Mix`).
"""


class Node:
    upstream = None

    def next(self, n=None):
        return self.upstream.next(n)

    def state(self):
        return {}

    def reset(self, state=None):
        pass
