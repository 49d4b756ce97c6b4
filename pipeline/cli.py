"""Command-line plumbing shared by the entry points."""
import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump), exit code 2."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
