"""The environment the plugin starts `vhi agent` in (no vLLM needed)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin.agent_process import agent_env  # noqa: E402


class AgentEnvTest(unittest.TestCase):
    def test_the_agent_sees_every_gpu(self):
        env = {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin", "VLLM_HI_HOST": "h:1"}
        got = agent_env(env)
        self.assertNotIn("CUDA_VISIBLE_DEVICES", got)
        self.assertEqual(got, {"PATH": "/bin", "VLLM_HI_HOST": "h:1"})
        self.assertIn("CUDA_VISIBLE_DEVICES", env)  # the engine's own is untouched


if __name__ == "__main__":
    unittest.main()
