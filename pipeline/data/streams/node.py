"""The interface every stage of the stream has, as webdataset's and torchdata's stages have it.

`next(n)` gives the stage's next item (for the per-source stages: the chunk of the next n
positions), pulled from `upstream`. Stages keep no state a checkpoint needs: a stream's place
lives in two numbers only, each source's count of positions read (`stages.Positions`, from
which `stages.RunPlan` starts a new chain) and each worker's batch count (`mix.RandomMix`);
a resume builds its chains from them.
"""


class Node:
    upstream = None

    def next(self, n=None):
        return self.upstream.next(n)
