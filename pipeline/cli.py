"""Command-line plumbing shared by the entry points."""
import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump), exit code 2."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    def at_least(self, args, lows):
        """One line for the first option below its minimum (None means not given)."""
        for name, low in lows.items():
            value = getattr(args, name)
            if value is not None and value < low:
                self.error(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
