"""The parts of tools/bench_loader.py, one concern a module; the script is the command line.

    inputs   the synthetic inputs, the shards of each encoding, the 10x corpus
    methods  the loaders timed (A the tutorial's, B stock webdataset, C and C8 this stream) and
             the interleaved throughput runs
    proc     the process tree read from /proc (descendants, their CPU time, a memory value)
    cpu      CPU time of the tree around one run, and the share stolen by the hypervisor
    memory   peak memory of one loader in a fresh process (the `--child` runs)
    micro    what one part costs: cProfile of C, the read ceiling, tar formats, stages
    jpeg     the JPEG path beside each bare decoder, small and large images (--jpeg)
    host     what the figures were measured on: the CPU, torch's threads, the commit
    report   the printed lines and the JSON record
    suite    what the command runs, in order: the full benchmark, --stages, --tar-format, --jpeg

The peers (LitData, Mosaic) are tools/bench_peers.py.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



