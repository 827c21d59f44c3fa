"""Runs `launch/train.py`'s entry point once per set of overrides in one process, as the CLI would,
and prints what each returned: {"code", "stderr", "seconds"} per set, as JSON on the last line.
Usage: python tests/config_errors.py '<json list of override lists>'"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.train import main  # noqa: E402

results = []
for overrides in json.loads(sys.argv[1]):
    err, t0 = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(overrides))
        except BaseException:  # noqa: BLE001 - what the CLI would have shown
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - t0})
print(json.dumps(results))
