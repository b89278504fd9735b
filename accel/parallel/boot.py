"""A worker process's entry (accel/parallel/workers.py starts it with the host's Python, the host's import path in
PYTHONPATH): this checkout loaded as the package sd_accel the way a host loads it (the root __init__.py), then the
worker's loop. Run as a script: its folder comes first on the path, and none of its modules is named as a host's is."""

import json
import os
import runpy
import sys


def main() -> None:
    # Before any import can print: the host reads the replies from stdout, and whatever else is printed goes to stderr
    # (the host's log).
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    config = json.loads(sys.argv[1])
    runpy.run_path(os.path.join(config["root"], "__init__.py"))  # under any name but sd_accel it loads sd_accel
    from sd_accel.accel.parallel import workers

    workers.serve(config, replies)


if __name__ == "__main__":
    main()
