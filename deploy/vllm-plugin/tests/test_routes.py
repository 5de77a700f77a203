"""The route table the plugin serves is the Go side's (api/hooks), and every
route has a handler: python3 -m unittest discover deploy/vllm-plugin/tests"""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin import routes  # noqa: E402


class RoutesTest(unittest.TestCase):
    def test_every_route_has_a_handler(self):
        table = routes.table()
        names = [r["name"] for r, _ in table]
        self.assertIn("pause", names)
        self.assertEqual(len(names), len(set(names)))
        for r, fn in table:
            self.assertTrue(r["path"].startswith("/vllm_hi/engine/"), r)
            self.assertIn(r["method"], ("GET", "POST"), r)
            self.assertTrue(callable(fn), r)

    def test_a_disagreement_is_an_error(self):
        saved = dict(routes.HANDLERS)
        try:
            del routes.HANDLERS["pause"]
            with self.assertRaises(RuntimeError):
                routes.table()
            routes.HANDLERS["pause"] = saved["pause"]
            routes.HANDLERS["teleport"] = saved["pause"]
            with self.assertRaises(RuntimeError):
                routes.table()
        finally:
            routes.HANDLERS.clear()
            routes.HANDLERS.update(saved)


if __name__ == "__main__":
    unittest.main()
