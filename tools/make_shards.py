"""tools/make_shards.py: the command of pipeline/writers/make_shards.py (`make-shards` once the
package is installed), kept here for the scripts and docs that name it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.writers.make_shards import main, parse_args  # noqa: E402,F401  (parse_args: tests, users' code)

if __name__ == "__main__":
    sys.exit(main())
