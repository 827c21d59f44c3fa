"""A program for tests/test_warm.py: reports how it was started, then does what its argument says."""

import json
import multiprocessing
import os
import sys
import time


def hello(queue: multiprocessing.Queue) -> None:
    queue.put(f"spawned from {os.path.basename(__file__)}")


if __name__ == "__main__":
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                      "warm": "transformers" in sys.modules, "stdin": sys.stdin.readline().strip(),
                      "env": os.environ.get("WARM_TEST_VALUE"), "file": __file__}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    if sys.argv[1] == "spawn":  # multiprocessing's spawn re-imports this file in a fresh interpreter
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        worker = ctx.Process(target=hello, args=(queue,))
        worker.start()
        print(queue.get(timeout=60), flush=True)
        worker.join(60)
        raise SystemExit(worker.exitcode)
    raise SystemExit(int(sys.argv[1]))
