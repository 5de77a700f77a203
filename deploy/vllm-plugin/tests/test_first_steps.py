"""The target's first steps after a commit, timed (no vLLM needed)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin.first_steps import FirstSteps  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FirstStepsTest(unittest.TestCase):
    def test_one_line_for_the_first_steps_after_a_commit(self):
        c = Clock()
        f = FirstSteps(clock=c)
        self.assertIsNone(f.output())  # no commit yet: nothing to time
        for _ in range(3):  # a migration's installs commit one by one
            c.t += 0.001
            f.committed(1)
        line = None
        for i in range(FirstSteps.STEPS):
            f.scheduled(0.002, 3)
            c.t += 0.010
            line = f.output()
            if i < FirstSteps.STEPS - 1:
                self.assertIsNone(line)
        self.assertIn("after committing 3 installed requests", line)
        self.assertIn("their outputs 10.0, 20.0, 30.0, 40.0 ms after the commit", line)
        self.assertIn("their scheduling: 3 requests in 2.0 ms,", line)
        self.assertIsNone(f.output())  # logged once

    def test_a_commit_after_outputs_starts_over(self):
        c = Clock()
        f = FirstSteps(clock=c)
        f.committed(5)
        c.t += 0.004
        f.output()
        f.committed(2)
        for _ in range(FirstSteps.STEPS):
            c.t += 0.001
            line = f.output()
        self.assertIn("after committing 2 installed requests", line)
        self.assertIn("their outputs 1.0, 2.0, 3.0, 4.0 ms", line)


if __name__ == "__main__":
    unittest.main()
