"""Start the OpenAI-compatible server: `python server.py --model checkpoints/stories260K-mtp
--host 127.0.0.1 --port 8000` (the same as `jaxmtp serve`; --help lists the options)."""

import sys

from jaxmtp.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
