"""Plugin logic that needs no vLLM: python3 -m unittest discover deploy/vllm-plugin/tests"""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin import config  # noqa: E402
from vllm_hi_plugin.wire import Leases, WriteLog, decode_ints, encode_ints  # noqa: E402


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


class IntListTailTest(unittest.TestCase):
    def test_the_tail_and_a_prefix_without_decoding_the_whole(self):
        import random

        from vllm_hi_plugin.wire import decode_ints, encode_ints, extends, ints_after

        rng = random.Random(7)
        for n in range(0, 40):
            xs = [rng.randrange(0, 1 << 32) for _ in range(n)]
            v = encode_ints(xs)
            for k in range(0, n + 1):
                self.assertEqual(ints_after(v, k), xs[k:], (n, k))
                self.assertEqual(ints_after(xs, k), xs[k:])
                p = encode_ints(xs[:k])
                self.assertTrue(extends(v, p, k), (n, k))
                self.assertTrue(extends(xs, xs[:k], k))
                if k:
                    # Any one token different, anywhere in the prefix.
                    i = rng.randrange(k)
                    other = xs[:k]
                    other[i] = (other[i] + 1 + rng.randrange(1000)) % (1 << 32)
                    self.assertFalse(extends(v, encode_ints(other), k), (n, k, i))
                    self.assertEqual(decode_ints(v)[:k] == other, False)
            # A longer prefix than v never matches.
            self.assertFalse(extends(v, encode_ints(xs + [5]), n + 1))


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

    def test_whole_blocks_stamped_at_once_change_one_at_a_time(self):
        # An install's commit stamps whole blocks in one go (they share one
        # tuple of generations); a later write to one of them changes that
        # block alone, and a write beyond the block table is not stamped.
        log = WriteLog(block_size=4)
        g1 = log.mutation()
        log.stamp_tokens("r", [3, 5, 8, 2, 6], 2, 15, g1)  # block 3 slots 2-3, 5/8/2 whole, 6 slot 0
        g2 = log.begin_step()
        log.stamp_tokens("r", [3, 5, 8, 2, 6], 9, 1, g2)  # block 8 slot 1
        log.stamp_tokens("q", [4], 3, 9, g2)  # past its one block: slot 3 only
        log.end_step()
        got = {w["block"]: (w["first_slot"], w["num_slots"], w["request_id"]) for w in log.changes(0, lambda b: False)["written"]}
        self.assertEqual(got, {3: (2, 2, "r"), 5: (0, 4, "r"), 8: (0, 4, "r"), 2: (0, 4, "r"), 6: (0, 1, "r"), 4: (3, 1, "q")})
        since = log.changes(g1, lambda b: False)["written"]
        self.assertEqual([(w["block"], w["first_slot"], w["num_slots"]) for w in since], [(4, 3, 1), (8, 1, 1)])

    def test_frees_between_steps_advance_the_cursor(self):
        log = WriteLog(block_size=4)
        log.stamp_free([3, 4])
        self.assertEqual(log.cursor, 1)
        self.assertEqual(log.changes(0, lambda b: b == 3)["freed"], [3])
        self.assertEqual(log.changes(1, lambda b: True)["freed"], [])


class InstalledStampsTest(unittest.TestCase):
    def test_an_installs_stamps_applied_later_read_as_applied_at_once(self):
        """A commit's stamps wait for the next read of the log; whatever
        happened in between (the requests' next tokens, their blocks freed
        and taken by other requests, more installs), changes() reads the
        same as with the stamps applied at the commit."""
        import random

        bs = 4
        for seed in range(200):
            rng = random.Random(seed)
            now, later = WriteLog(block_size=bs), WriteLog(block_size=bs)
            free = set()
            tables = {}
            pool = list(range(1, 24))
            rng.shuffle(pool)

            def both(fn):
                fn(now)
                fn(later)

            for op in range(12):
                kind = rng.choice(["install", "step", "free"] if tables else ["install"])
                if kind == "install" and len(pool) >= 3:
                    rid = f"r{op}"
                    blocks = [pool.pop() for _ in range(rng.randint(1, 3))]
                    free.difference_update(blocks)
                    n = rng.randint(1, len(blocks) * bs)
                    tables[rid] = [blocks, n]
                    g = now.mutation()
                    self.assertEqual(later.mutation(), g)
                    now.stamp_tokens(rid, blocks, 0, n, g)
                    later.stamp_installed(rid, blocks, n, g)
                elif kind == "step":
                    rid = rng.choice(sorted(tables))
                    blocks, n = tables[rid]
                    if n >= len(blocks) * bs:
                        continue
                    both(lambda log: log.begin_step())
                    g = now.issued
                    both(lambda log: log.stamp_tokens(rid, blocks, n, 1, g))
                    both(lambda log: log.end_step())
                    tables[rid][1] = n + 1
                elif kind == "free":
                    rid = rng.choice(sorted(tables))
                    blocks, _ = tables.pop(rid)
                    both(lambda log: log.stamp_free(blocks))
                    free.update(blocks)
                    pool.extend(blocks)
                    rng.shuffle(pool)
                if rng.random() < 0.2:  # a read in between applies what waits
                    since = rng.randint(0, now.issued)
                    self.assertEqual(later.changes(since, free.__contains__), now.changes(since, free.__contains__))
            for since in range(0, now.issued + 1):
                self.assertEqual(later.changes(since, free.__contains__), now.changes(since, free.__contains__),
                                 (seed, since))


class WriteLogAsyncTest(unittest.TestCase):
    """With asynchronous scheduling the next step is scheduled (and its
    writes stamped) before the last one's output is processed: the cursor
    must not claim a step whose writes have not landed."""

    def test_the_cursor_follows_the_oldest_step_in_flight(self):
        log = WriteLog(block_size=4)
        g1 = log.begin_step()
        log.stamp_tokens("r", [5], 0, 1, g1)
        g2 = log.begin_step()  # scheduled while step 1 runs
        log.stamp_tokens("r", [5], 1, 1, g2)
        log.end_step()  # step 1's output: step 2 still in flight
        self.assertEqual(log.cursor, g1)
        self.assertTrue(log.in_step)
        # A round that copies now and reads changes since g1 later sees
        # step 2's slot, whose bytes may land after this copy.
        log.end_step()
        self.assertEqual(log.cursor, g2)
        self.assertFalse(log.in_step)
        self.assertEqual(log.changes(g1, lambda b: False)["written"],
                         [{"block": 5, "first_slot": 1, "num_slots": 1, "request_id": "r"}])

    def test_a_free_waits_for_the_steps_scheduled_before_it(self):
        log = WriteLog(block_size=4)
        log.begin_step()
        g2 = log.begin_step()
        log.end_step()  # update_from_output of step 1 ...
        log.stamp_free([3])  # ... frees a finished request's block while step 2 runs
        free_gen = log.free_gen[3]
        c = log.cursor
        self.assertLess(c, g2)
        self.assertGreater(free_gen, g2)
        g3 = log.begin_step()  # the next step is scheduled after the free
        log.end_step()  # step 2 done: the free is covered, step 3 is not
        self.assertEqual(log.cursor, free_gen)
        self.assertLess(log.cursor, g3)
        # A reader that read at c is told of the free in its next round.
        self.assertEqual(log.changes(c, lambda b: True)["freed"], [3])
        log.end_step()
        self.assertEqual(log.cursor, g3)

    def test_generations_only_grow(self):
        log = WriteLog(block_size=4)
        seen = [log.mutation()]
        for _ in range(3):
            seen.append(log.begin_step())
            seen.append(log.mutation())
        for _ in range(3):
            before = log.cursor
            log.end_step()
            self.assertGreaterEqual(log.cursor, before)
        self.assertEqual(seen, sorted(set(seen)))
        self.assertEqual(log.cursor, seen[-1])
        self.assertFalse(log.inflight)


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
        # Several Hosts sharing a store: the agent registers with each.
        self.assertEqual(config.load({"VLLM_HI_TYPE": "A", "VLLM_HI_HOST": "10.0.0.1:8002,10.0.0.2:8002"}).host,
                         "10.0.0.1:8002,10.0.0.2:8002")
        for bad in ({"VLLM_HI_TYPE": "C"}, {"VLLM_HI_HOST": "nohost"}, {"VLLM_HI_HOST": "10.0.0.1:8002,nohost"},
                    {"VLLM_HI_HOST": "10.0.0.1:8002,10.0.0.2:x"}, {"VLLM_HI_DATA_PORT": "70000"},
                    {"VLLM_HI_TRANSFER_BACKEND": "carrier-pigeon"}):
            with self.assertRaises(config.ConfigError):
                config.load(bad)


if __name__ == "__main__":
    unittest.main()
