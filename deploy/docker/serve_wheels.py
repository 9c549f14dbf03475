"""The wheelhouse to an offline image build (`deploy/docker/stack.sh images`): GET and HEAD of the
directory's index and of the package files directly in it, nothing else, on one address, until
killed. The classic builder cannot mount a host directory, so the build's `pip install` reads the
wheels from here (`--find-links http://ADDRESS:PORT/`) instead of from a layer.

Usage: python serve_wheels.py DIRECTORY ADDRESS PORT
"""

from __future__ import annotations

import functools
import http.server
import sys
import urllib.parse
from pathlib import Path

PACKAGES = (".whl", ".tar.gz", ".zip")


class WheelHandler(http.server.SimpleHTTPRequestHandler):
    """Only `/` (the links pip reads) and `/<file>` for a package file of the directory; any other
    path is 404 and any other method 501 (the base class's answer to methods it lacks)."""

    def send_head(self):  # noqa: ANN201 - the base class's signature
        path = urllib.parse.unquote(self.path.split("?", 1)[0].split("#", 1)[0])
        name = path.lstrip("/")  # pip asks for torch-2.13.0%2Bcpu-...whl: names are compared decoded
        if path != "/" and ("/" in name or "\\" in name or not name.endswith(PACKAGES)
                            or not (Path(self.directory) / name).is_file()):
            self.send_error(404, "not a package file of the wheelhouse")
            return None
        return super().send_head()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        sys.stderr.write(f"serve_wheels: {self.address_string()} {format % args}\n")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    directory, address, port = argv
    handler = functools.partial(WheelHandler, directory=str(Path(directory).resolve()))
    with http.server.ThreadingHTTPServer((address, int(port)), handler) as server:
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
