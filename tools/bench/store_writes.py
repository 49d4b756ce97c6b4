"""`make-shards --out s3://...` against a store that answers each shard's upload with a 500 whose
body is 200 MB (issue 53 item 9), and against the same store answering: wall seconds, bytes the
server sent, the command's peak RSS. The store is tests/test_store_write_limits.py's look-alike
on 127.0.0.1 (it checks every signature); TREE is the checkout whose make-shards runs, so the
figures of an older tree come from the same script:

    python tools/bench/store_writes.py                 # this checkout
    git archive REV pipeline tools | tar -x -C /tmp/old && python tools/bench/store_writes.py /tmp/old
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv):
    tree = os.path.abspath(argv[0]) if argv else HERE
    sys.path[:0] = [os.path.join(HERE, "tests"), HERE]
    import test_store_write_limits as look_alike
    from helpers import serving

    os.environ.update(AWS_ACCESS_KEY_ID="bench-key-id", AWS_SECRET_ACCESS_KEY=look_alike.S3_SECRET,
                      AWS_DEFAULT_REGION="us-east-1")
    look_alike.ROOT = tree
    build = [a for a in look_alike.BUILD if a not in ("--retries", "2", "--io-timeout", "10")]  # the defaults
    for mode in ("ok", ("huge", 500, 200 << 20)):
        with serving(look_alike._S3Writes, put=mode, objects={}, seen=[], sent=0) as server:
            os.environ["AWS_ENDPOINT_URL"] = server.url.rstrip("/")
            t0 = time.monotonic()
            p, peak = look_alike.make_shards_peak([*build, "--out", "s3://bucket/p"])
            last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
            print(f"{'answered' if mode == 'ok' else '500 + 200 MB'}: exit {p.returncode}, "
                  f"{time.monotonic() - t0:.1f} s, {server.sent / 1e6:.1f} MB sent by the server, peak RSS "
                  f"{peak / 1e6:.0f} MB, {len(server.seen)} requests{'; ' + last[:300] if last else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
