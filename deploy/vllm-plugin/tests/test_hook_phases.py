"""Where a slow hook call's time went: the log line an operator reads when
a migration's pause is long (no vLLM needed)."""

import logging
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hi_plugin import hooks  # noqa: E402


class PhasesTest(unittest.TestCase):
    def test_a_slow_call_logs_its_phases_under_vllms_logger(self):
        ph = hooks.Phases()
        ph.add("engine core", 12.5)
        ph.add("engine core", 2.5)
        ph.add("encoding", 1.0)
        ph.t0 -= (hooks.SLOW_HOOK_MS + 10) / 1e3
        # Under "vllm": vLLM's logging config prints that logger's INFO
        # lines; a logger of its own would print only warnings.
        with self.assertLogs("vllm", level="INFO") as got:
            ph.log_if_slow("export", 32)
        self.assertEqual(len(got.records), 1)
        msg = got.records[0].getMessage()
        self.assertIn("vllm_hi export of 32 requests took", msg)
        self.assertIn("engine core 15.0, encoding 1.0 ms", msg)

    def test_a_quick_call_logs_nothing(self):
        ph = hooks.Phases()
        ph.add("engine core", 1.0)
        logger = logging.getLogger("vllm.vllm_hi")
        with self.assertNoLogs(logger, level="INFO"):
            ph.log_if_slow("install", 4)


if __name__ == "__main__":
    unittest.main()
