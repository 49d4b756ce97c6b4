"""The order of the samples: which sample each position of an epoch holds (`order`), which
(rank, worker) reads which positions and in what mix (`deal`), where a stream stands as a
checkpoint keeps it (`place`), who a process is among ranks and workers (`topology`), and the
mixture's weights (`weights`). Arithmetic on positions: nothing here reads a byte of data."""
