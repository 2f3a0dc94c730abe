"""The argument parser every raypar command line uses. It lives in ``data``, the lowest room with a
command line (``python -m ray_jobs.data``), so that command and ``core``'s generated flags share it
without an import running back up."""

from __future__ import annotations

import argparse
import typing


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
