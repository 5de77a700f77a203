"""Plugin logic that needs no vLLM: python3 -m unittest discover deploy/vllm-plugin/tests"""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi import config  # noqa: E402
from vllm_hi.wire import Leases, WriteLog, decode_ints, encode_ints  # noqa: E402


class IntListTest(unittest.TestCase):
    def test_round_trip_matches_go(self):
        # api/hooks.IntList encodes [1,2] (uint32 LE) as this base64.
        self.assertEqual(encode_ints([1, 2]), "AQAAAAIAAAA=")
        for xs in ([], [0], [1, 2, 3, 4294967295, 151643]):
            self.assertEqual(decode_ints(encode_ints(xs)), xs)
        self.assertEqual(decode_ints([5, 6]), [5, 6])
        with self.assertRaises(ValueError):
            encode_ints([-1])
        with self.assertRaises(ValueError):
            decode_ints("AQA=")


class WriteLogTest(unittest.TestCase):
    def test_changes_since_a_cursor(self):
        log = WriteLog(block_size=4)
        g = log.begin_step()
        log.stamp_tokens("r", [7, 9], 0, 6, g)  # prompt: block 7 full, block 9 slots 0-1
        log.end_step()
        first = log.cursor
        g = log.begin_step()
        log.stamp_tokens("r", [7, 9], 6, 1, g)  # one decode token: block 9 slot 2
        log.end_step()
        ch = log.changes(first, lambda b: False)
        self.assertEqual(ch["written"], [{"block": 9, "first_slot": 2, "num_slots": 1, "request_id": "r"}])
        self.assertEqual(ch["cursor"], 2)
        all_ = log.changes(0, lambda b: False)["written"]
        self.assertEqual([(w["block"], w["first_slot"], w["num_slots"]) for w in all_], [(7, 0, 4), (9, 0, 3)])

    def test_frees_between_steps_advance_the_cursor(self):
        log = WriteLog(block_size=4)
        log.stamp_free([3, 4])
        self.assertEqual(log.cursor, 1)
        self.assertEqual(log.changes(0, lambda b: b == 3)["freed"], [3])
        self.assertEqual(log.changes(1, lambda b: True)["freed"], [])


class LeasesTest(unittest.TestCase):
    def test_expiry_resumes(self):
        l = Leases()
        l.pause(["a", "b"], now=100.0, lease_s=5)
        self.assertIn("a", l)
        self.assertEqual(l.expire(104.0), [])
        self.assertEqual(sorted(l.expire(105.0)), ["a", "b"])
        self.assertEqual(len(l), 0)


class ConfigTest(unittest.TestCase):
    def test_env(self):
        c = config.load({"VLLM_HI_TYPE": "a", "VLLM_HI_HOST": "10.0.0.1:8002", "VLLM_HI_DATA_PORT": "9000"})
        self.assertEqual((c.type, c.host, c.data_port, c.enabled), ("A", "10.0.0.1:8002", 9000, True))
        self.assertFalse(config.load({}).enabled)
        self.assertEqual(config.load({"VLLM_HI_TYPE": "B", "VLLM_HI_ID": " b-1234 "}).id, "b-1234")
        for bad in ({"VLLM_HI_TYPE": "C"}, {"VLLM_HI_HOST": "nohost"}, {"VLLM_HI_DATA_PORT": "70000"},
                    {"VLLM_HI_TRANSFER_BACKEND": "carrier-pigeon"}):
            with self.assertRaises(config.ConfigError):
                config.load(bad)


if __name__ == "__main__":
    unittest.main()
