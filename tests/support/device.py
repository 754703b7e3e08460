"""Where the tests run models: `$FLY_TEST_DEVICE` ("cpu" by default; benchmarks/gpu_check.sh sets "cuda").

support.tiny_models.make_pair puts its models there and test daemons are started with `--device TEST_DEVICE`.
"""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("FLY_TEST_DEVICE", "cpu")
