"""A program for tests/test_warm.py: reports how it was started, then does what its argument says."""

import json
import os
import sys
import time

print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                  "warm": "transformers" in sys.modules, "stdin": sys.stdin.readline().strip(),
                  "env": os.environ.get("WARM_TEST_VALUE")}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
raise SystemExit(int(sys.argv[1]))
